// The expresslane playground: one prompt streamed to two tiers side by side, with live TTFT,
// tokens/s and cost, and a lanes panel read from /metrics. Plain browser JavaScript: no
// framework, no CDN, nothing but this server.
"use strict";

const EXAMPLES = [
  "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number.",
  "Write `read_config(path)` in Python. Description: Read a JSON config file.",
  "List the files in the folder Lib.",
];
const $ = (sel, root = document) => root.querySelector(sel);
const info = { model: null, tiers: [], prices: null };

function headers() {
  const h = { "content-type": "application/json" };
  const key = $("#api-key").value.trim();
  if (key) h.authorization = "Bearer " + key;
  return h;
}

async function loadInfo() {
  const r = await fetch("/playground/info");
  Object.assign(info, await r.json());
  $("#model").textContent = "model: " + info.model;
  const enabled = info.tiers.filter((t) => t.enabled).map((t) => t.name);
  const wanted = [enabled.includes("ultrafast") ? "ultrafast" : enabled[0],
    enabled.includes("flex") ? "flex" : "default"];
  document.querySelectorAll(".pane").forEach((pane, i) => {
    const select = $(".tier", pane);
    for (const name of enabled) select.add(new Option(name, name));
    select.value = wanted[i];
  });
}

// Server-sent events of a fetch response: yields each event's parsed `data:` JSON.
async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data && data !== "[DONE]") yield JSON.parse(data);
    }
  }
}

function requestBody(api, tier, prompt) {
  const max = Number($("#max-tokens").value) || 96;
  const temperature = Number($("#temperature").value) || 0;
  const common = { model: info.model, stream: true, service_tier: tier, temperature };
  if (api === "chat") {
    return { ...common, messages: [{ role: "user", content: prompt }], max_tokens: max,
      stream_options: { include_usage: true } };
  }
  return { ...common, input: prompt, max_output_tokens: max, store: false };
}

// What one streamed event adds: text, the usage at the end, the tier that served it.
function readEvent(api, ev) {
  if (api === "chat") {
    const text = ev.choices && ev.choices.length ? ev.choices[0].delta.content || "" : "";
    return { text, usage: ev.usage || null, tier: ev.service_tier, error: ev.error };
  }
  if (ev.type === "response.output_text.delta") return { text: ev.delta };
  if (ev.type === "response.completed" || ev.type === "response.incomplete") {
    const u = ev.response.usage;
    return { text: "", tier: ev.response.service_tier, usage: u && {
      prompt_tokens: u.input_tokens, completion_tokens: u.output_tokens,
      cached: (u.input_tokens_details || {}).cached_tokens || 0 } };
  }
  if (ev.type === "error" || ev.type === "response.failed") {
    return { text: "", error: ev.error || (ev.response && ev.response.error) || ev };
  }
  return { text: "" };
}

function cost(usage, tier) {
  if (!info.prices || !usage) return null;
  const lane = info.tiers.find((t) => t.name === tier);
  const m = lane ? lane.price_multiplier : 1;
  const cached = usage.cached || (usage.prompt_tokens_details || {}).cached_tokens || 0;
  const p = info.prices;
  return ((usage.prompt_tokens - cached) * p.input_per_1m + cached * p.cached_input_per_1m
    + usage.completion_tokens * p.output_per_1m) / 1e6 * m;
}

class PaneRun {
  constructor(pane) {
    this.pane = pane;
    this.out = $(".output", pane);
    this.sent = performance.now();
    this.first = null;
    this.last = null;
    this.chunks = 0;
  }

  show(name, text) { $("." + name, this.pane).textContent = text; }

  reset() {
    this.out.textContent = "";
    this.out.classList.remove("error");
    for (const name of ["ttft", "tps", "tokens", "cost"]) this.show(name, "–");
    this.show("served", "");
    this.pane.dataset.chunks = "0";
  }

  text(delta) {
    if (!delta) return;
    const now = performance.now();
    if (this.first === null) {
      this.first = now;
      this.show("ttft", ((now - this.sent) / 1000).toFixed(3) + " s");
    }
    this.last = now;
    this.chunks += 1;
    this.pane.dataset.chunks = String(this.chunks);
    this.out.textContent += delta;
    this.out.scrollTop = this.out.scrollHeight;
    this.speed(this.chunks);
  }

  // Live: chunks stand in for tokens (a chunk holds one or more); at the end, the usage.
  speed(tokens) {
    if (this.first === null || this.last === null || tokens < 2) return;
    const seconds = (this.last - this.first) / 1000;
    if (seconds > 0) this.show("tps", ((tokens - 1) / seconds).toFixed(1));
    this.show("tokens", String(tokens));
  }

  finish(usage, tier) {
    if (tier) this.show("served", "served by " + tier);
    if (!usage) return;
    this.speed(usage.completion_tokens);
    this.show("tokens", `${usage.prompt_tokens} in / ${usage.completion_tokens} out`);
    const c = cost(usage, tier);
    if (c !== null) this.show("cost", "$" + c.toFixed(7));
  }

  fail(message) {
    this.out.classList.add("error");
    this.out.textContent += (this.out.textContent ? "\n" : "") + message;
  }
}

async function runPane(pane, api, prompt) {
  const run = new PaneRun(pane);
  run.reset();
  const tier = $(".tier", pane).value;
  const path = api === "chat" ? "/v1/chat/completions" : "/v1/responses";
  try {
    const r = await fetch(path, { method: "POST", headers: headers(),
      body: JSON.stringify(requestBody(api, tier, prompt)) });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      run.fail(`${r.status}: ${(body.error && body.error.message) || r.statusText}`);
      return;
    }
    let usage = null;
    let served = tier;
    for await (const ev of sse(r)) {
      const part = readEvent(api, ev);
      if (part.error) run.fail(part.error.message || JSON.stringify(part.error));
      run.text(part.text);
      if (part.tier) served = part.tier;
      if (part.usage) usage = part.usage;
    }
    run.finish(usage, served);
  } catch (e) {
    run.fail(String(e));
  }
}

async function send() {
  const prompt = $("#prompt").value.trim();
  if (!prompt) return;
  const api = $("#api").value;
  $("#send").disabled = true;
  $("#status").textContent = "streaming…";
  const panes = [...document.querySelectorAll(".pane")];
  await Promise.all(panes.map((pane) => runPane(pane, api, prompt)));
  $("#send").disabled = false;
  $("#status").textContent = "done";
}

// -- the lanes panel -------------------------------------------------------------------------

function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const m = line.match(/^([^\s{#]+)(?:\{([^}]*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const pair of (m[2] || "").matchAll(/(\w+)="([^"]*)"/g)) labels[pair[1]] = pair[2];
    samples.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return samples;
}

const lanePoll = { at: null, tokens: {} };

async function pollLanes() {
  let samples;
  try {
    const r = await fetch("/metrics");
    samples = parseMetrics(await r.text());
  } catch (e) {
    return;
  }
  const now = performance.now();
  const pick = (name, tier) => samples.filter((s) => s.name === name
    && (tier === undefined || s.labels.tier === tier)).reduce((a, s) => a + s.value, 0);
  const rows = [];
  for (const t of info.tiers.filter((x) => x.enabled)) {
    // streamed tokens after each request's first: counted as they are sent
    const tokens = pick("expresslane:inter_token_latency_seconds_count", t.name);
    const before = lanePoll.tokens[t.name];
    const rate = before === undefined || lanePoll.at === null ? 0
      : (tokens - before) / ((now - lanePoll.at) / 1000);
    lanePoll.tokens[t.name] = tokens;
    rows.push(`<tr data-tier="${t.name}"><td>${t.name}</td>`
      + `<td>${pick("expresslane:num_requests_running", t.name)}</td>`
      + `<td>${pick("expresslane:num_requests_waiting", t.name)}</td>`
      + `<td>${rate.toFixed(1)}</td><td>${t.price_multiplier}</td></tr>`);
  }
  lanePoll.at = now;
  $("#lane-rows").innerHTML = rows.join("");
  $("#kv").textContent = (100 * pick("expresslane:kv_cache_usage_perc")).toFixed(1) + "%";
}

async function main() {
  const examples = $("#examples");
  examples.add(new Option("examples…", ""));
  for (const text of EXAMPLES) examples.add(new Option(text, text));
  examples.addEventListener("change", () => {
    if (examples.value) $("#prompt").value = examples.value;
  });
  $("#prompt").value = EXAMPLES[0];
  $("#api-key").value = localStorage.getItem("expresslane-key") || "";
  $("#api-key").addEventListener("change", () => {
    localStorage.setItem("expresslane-key", $("#api-key").value.trim());
  });
  $("#send").addEventListener("click", send);
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send();
  });
  await loadInfo();
  await pollLanes();
  setInterval(pollLanes, 1000);
  document.body.dataset.ready = "1";
}

main();
