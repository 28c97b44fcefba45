"""Evaluate the bundled demo models on held-out standard-library files (never seen in training).

Uses Hugging Face ``transformers`` for the forward passes and greedy generation, so the numbers
are independent of expresslane's own engine. For each model directory (``target``, ``draft``):

1. Perplexity: the held-out files (sorted, each followed by ``<|endoftext|>``) are tokenized and
   the first ``--ppl-tokens`` tokens are scored in windows of 1024 tokens (each window predicts
   its 1024 next tokens, as in training). Reports mean loss (nats/token), perplexity and bits/byte.
2. Function completion: ``--n-functions`` held-out functions with a docstring and a short body
   (1-15 lines after the docstring). The prompt is the header (decorators, signature, docstring,
   dedented), ending at the docstring's closing quotes (no newline: see `eval_completion`); greedy
   decoding of up to 200 new tokens, cut at the first non-empty line indented at
   or left of the ``def`` (or at EOS). Success: ``ast.parse(header + completion)`` passes and the
   completion has at least one statement line. When the 200 tokens run out first, the unfinished
   last line is dropped before parsing (counted as ``truncated``).
3. Tool calls: ``--n-chats`` chat requests, with the four agent tools in the system turn, asking to
   read or to run the tests of a held-out file (half with phrasings used in training, half with
   new phrasings). The greedy reply must contain ``<tool_call>{json}</tool_call>`` naming the right
   function (``read_file`` / ``run_tests``); the path argument is checked separately.
4. Code in chat: the signature lines of ``--n-code-chats`` of those held-out functions, sent as
   the user message with no tools (as ``input="def add(a, b):"``); the greedy reply counts when
   it is a ```python block whose code parses and defines the function (a reply cut by the
   token limit drops its last line). Replies that open with ``{`` (JSON) are counted apart.
5. JSON mode (target only, expresslane's engine, the grammar of ``json_object``): requests for
   objects (JSON_ASKS); the output must be a JSON object with the keys the request names.

Writes ``eval.json`` next to the models and prints sample outputs.

    python -m scripts.eval_demo_model [--model-dir src/expresslane/assets/demo] [--smoke]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import re
import sys
import time
from pathlib import Path

from scripts import train_demo_model as T

NEW_READ_ASKS = [
    "I'd like to see the source of {p}.",
    "Print the contents of {p}.",
    "Could you fetch {p} for me?",
    "Please show the code in {p}.",
]
NEW_TEST_ASKS = [
    "Are the tests for {p} green?",
    "Please execute the tests of {p}.",
    "Could you check whether {p} passes its tests?",
    "Run the unit tests covering {p}.",
]
JSON_ASKS = [  # (request, keys the object should have)
    ("Give me a person as JSON.", ["name", "age"]),
    ("Return a book as a JSON object.", ["title", "author"]),
    ("Describe a city as JSON with the keys name, country and population.", ["name", "country"]),
    ("Make up a user. Answer with JSON that has username and email.", ["username", "email"]),
    ("Reply with a JSON object describing a color.", ["name"]),
    ("Give me a point as JSON with the keys x and y.", ["x", "y"]),
    ("Summarize Lib/json/decoder.py as a JSON object: path and lines.", ["path", "lines"]),
    ("Invent a project. Output JSON only.", ["name"]),
]
FENCE_RE = re.compile(r"```python\n(.*?)(?:```|$)", re.DOTALL)
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def heldout_sources() -> dict[str, str]:
    root = T.stdlib_root()
    _, held, _ = T.split_files(T.list_corpus(root))
    return T.read_sources(root, held)


def perplexity(model, tok, sources: dict[str, str], max_tokens: int) -> dict:
    import torch
    import torch.nn.functional as F

    eot = tok.convert_tokens_to_ids(T.EOT)
    ids: list[int] = []
    for f in sorted(sources):
        ids += tok(sources[f], add_special_tokens=False)["input_ids"] + [eot]
        if len(ids) > max_tokens:
            break
    ids = ids[: max_tokens + 1]
    total_nll, scored, n_bytes = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - 1, T.SEQ_LEN):
            chunk = torch.tensor([ids[i : i + T.SEQ_LEN + 1]])
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            nll = F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
            total_nll += nll.item()
            scored += chunk.size(1) - 1
            n_bytes += len(tok.decode(chunk[0, 1:].tolist()).encode("utf-8"))
    loss = total_nll / scored
    return dict(
        tokens=scored,
        windows=math.ceil(scored / T.SEQ_LEN),
        loss=round(loss, 4),
        perplexity=round(math.exp(loss), 3),
        bits_per_byte=round(total_nll / math.log(2) / n_bytes, 4),
    )


def pick_functions(sources: dict[str, str], n: int, seed: int) -> list[dict]:
    found = []
    for f in sorted(sources):
        for fn in T.extract_functions(sources[f]):
            if 1 <= fn["body_lines"] <= 15 and len(fn["header"]) <= 1500:
                found.append(dict(fn, file=f))
    random.Random(f"{seed}-functions").shuffle(found)
    return found[:n]


def edit_pairs(functions: list[dict], n: int) -> list[tuple[str, str]]:
    """(source, the same source with its function renamed `name_v2`) for the first n functions
    of at least 7 lines: an agent rewriting code it just read (benchmarks/spec.py's edit
    workload, scripts/copy_probe.py)."""
    long_enough = [fn for fn in functions if fn["source"].count("\n") >= 6][:n]
    return [
        (fn["source"], fn["source"].replace(f"def {fn['name']}(", f"def {fn['name']}_v2(", 1))
        for fn in long_enough
    ]


def edit_prompts(functions: list[dict], n: int) -> list[str]:
    """benchmarks/spec.py's edit prompts: a function's source, then the first line of its
    renamed version (no bare newline after it: see BENCHMARKS.md), for edit_pairs' functions."""
    pairs = edit_pairs(functions, n)
    return [f"{src}\n\n\n{renamed.split(chr(10), 1)[0]}" for src, renamed in pairs]


def spec_workloads(n: int, seed: int = 0) -> dict[str, list[str]]:
    """benchmarks/spec.py's held-out workloads (also distill_draft's agreement check): `edit`
    (edit_prompts) and `complete` (the headers of the first n functions picked)."""
    functions = pick_functions(heldout_sources(), 4 * n, seed)
    complete = [fn["header"] for fn in functions[:n]]
    return {"edit": edit_prompts(functions, n), "complete": complete}


def dedent_cut(text: str) -> tuple[str, bool]:
    """Cut ``text`` (which starts a new line) at the first non-empty line with no indentation."""
    m = re.search(r"\n(?=[^\s])", "\n" + text)
    if m:
        return text[: max(0, m.start() - 1)], True
    return text, False


def make_stopper(tok, prompt_len: int):
    import torch
    from transformers import StoppingCriteria

    class FunctionEnd(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = [
                dedent_cut(tok.decode(row[prompt_len:], skip_special_tokens=True))[1]
                for row in input_ids
            ]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return FunctionEnd()


def generate(model, tok, prompt: str, max_new: int, stopper=None) -> tuple[str, bool]:
    import torch
    from transformers import StoppingCriteriaList

    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    eos = [tok.convert_tokens_to_ids(T.IM_END), tok.convert_tokens_to_ids(T.EOT)]
    kwargs = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[1])
    if stopper is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([stopper(tok, ids.size(1))])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    new = out[0, ids.size(1) :].tolist()
    hit_eos = bool(new) and new[-1] in eos
    return tok.decode(new, skip_special_tokens=False), hit_eos


def strip_eos(text: str) -> str:
    for t in (T.IM_END, T.EOT):
        text = text.split(t)[0]
    return text


def eval_completion(model, tok, functions: list[dict], max_new: int) -> dict:
    ok = empty = truncated = 0
    samples = []
    for fn in functions:
        # The prompt ends at the docstring's closing quotes, not after a newline: the tokenizer
        # merges a newline with the next line's indentation ("\n    "), so a prompt ending in
        # a bare newline token is off the training distribution (the model then emits blank
        # lines). The model writes that newline-and-indent token itself.
        prompt = fn["header"]
        raw, hit_eos = generate(model, tok, prompt, max_new, make_stopper)
        body, cut = dedent_cut(strip_eos(raw))
        if not cut and not hit_eos:
            truncated += 1
            body = body[: body.rfind("\n") + 1]
        statements = [
            line for line in body.splitlines() if line.strip() and not line.strip().startswith("#")
        ]
        try:
            ast.parse(prompt + body)
            parsed = True
        except SyntaxError:
            parsed = False
        success = parsed and bool(statements)
        ok += success
        empty += not statements
        if len(samples) < 5:
            samples.append(dict(file=fn["file"], prompt=prompt, completion=body, ok=success))
    n = len(functions)
    return dict(
        n=n,
        ast_ok_fraction=round(ok / max(n, 1), 3),
        ast_ok=ok,
        empty=empty,
        truncated=truncated,
        max_new_tokens=max_new,
        samples=samples,
    )


def chat_requests(sources: dict[str, str], n: int, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}-chats")
    files = sorted(sources)
    out = []
    for i in range(n):
        rel = files[i % len(files)]
        path = ("Lib/" + rel) if i % 3 else rel
        is_test = i % 2 == 1
        seen = (i // 2) % 2 == 0
        asks = (
            (T.TEST_ASKS if seen else NEW_TEST_ASKS)
            if is_test
            else (T.READ_ASKS if seen else NEW_READ_ASKS)
        )
        p = f"`{path}`" if rng.random() < 0.5 else path
        out.append(
            dict(
                ask=rng.choice(asks).format(p=p),
                expect="run_tests" if is_test else "read_file",
                path=path,
                seen_phrasing=seen,
            )
        )
    return out


def parse_tool_call(text: str) -> dict | None:
    m = TOOL_CALL_RE.search(text)
    if not m:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) else None


def eval_tool_calls(model, tok, requests: list[dict], max_new: int) -> dict:
    parsed = name_ok = path_ok = 0
    by_group = {True: [0, 0], False: [0, 0]}
    samples, failures = [], []
    for r in requests:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": r["ask"]}],
            tools=T.TOOLS,
            tokenize=False,
            add_generation_prompt=True,
        )
        reply, _ = generate(model, tok, prompt, max_new)
        reply = strip_eos(reply)
        call = parse_tool_call(reply)
        good = call is not None and call.get("name") == r["expect"]
        args = call.get("arguments") if call else None
        parsed += call is not None
        name_ok += good
        path_ok += good and isinstance(args, dict) and args.get("path") == r["path"]
        by_group[r["seen_phrasing"]][0] += good
        by_group[r["seen_phrasing"]][1] += 1
        if len(samples) < 4:
            samples.append(dict(request=r["ask"], reply=reply, ok=good))
        if not good and len(failures) < 5:
            failures.append(dict(request=r["ask"], reply=reply))
    n = len(requests)

    def frac(a, b):
        return round(a / max(b, 1), 3)

    return dict(
        n=n,
        name_correct_fraction=frac(name_ok, n),
        parsed_fraction=frac(parsed, n),
        path_exact_fraction=frac(path_ok, n),
        seen_phrasing_fraction=frac(*by_group[True]),
        unseen_phrasing_fraction=frac(*by_group[False]),
        samples=samples,
        failures=failures,
    )


def signature(fn: dict) -> str:
    """The function's decorators and signature lines, up to the docstring."""
    first = ast.parse(fn["source"]).body[0].body[0].lineno - 1
    return "\n".join(fn["source"].split("\n")[:first])


def eval_code_chats(model, tok, functions: list[dict], max_new: int) -> dict:
    ok = json_like = 0
    samples = []
    picked = []
    for fn in functions:
        try:
            picked.append((fn, signature(fn)))
        except SyntaxError:
            continue
    for _fn, sig in picked:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": sig}], tokenize=False, add_generation_prompt=True
        )
        raw, hit_eos = generate(model, tok, prompt, max_new)
        reply = strip_eos(raw)
        m = FENCE_RE.match(reply.lstrip())
        code = m.group(1) if m else ""
        if m and "```" not in reply.lstrip()[9:] and not hit_eos:
            code = code[: code.rfind("\n") + 1]  # cut by the token limit: drop the last line
        try:
            tree = ast.parse(code) if code.strip() else None
        except SyntaxError:
            tree = None
        good = tree is not None and any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree)
        )
        ok += good
        json_like += reply.lstrip().startswith("{")
        if len(samples) < 3:
            samples.append(dict(request=sig, reply=reply, ok=good))
    n = len(picked)
    return dict(
        n=n,
        code_fraction=round(ok / max(n, 1), 3),
        code_ok=ok,
        json_replies=json_like,
        max_new_tokens=max_new,
        samples=samples,
    )


def eval_json_mode(model_dir: Path, max_new: int) -> dict:
    """JSON_ASKS through expresslane's engine with the json_object grammar, greedy."""
    from expresslane import LLM, SamplingParams
    from expresslane.server.grammars import json_schema

    llm = LLM(str(model_dir), max_model_len=512)
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": a}]) for a, _ in JSON_ASKS
    ]
    params = SamplingParams(
        max_tokens=max_new, temperature=0, grammar=json_schema({"type": "object"}, "text.format")
    )
    valid = keys_ok = 0
    samples = []
    for (ask, keys), out in zip(JSON_ASKS, llm.generate(prompts, params), strict=True):
        try:
            obj = json.loads(out.text)
        except json.JSONDecodeError:
            obj = None
        valid += isinstance(obj, dict)
        keys_ok += isinstance(obj, dict) and all(k in obj for k in keys)
        samples.append(dict(request=ask, reply=out.text))
    n = len(JSON_ASKS)
    return dict(n=n, valid=valid, keys_ok=keys_ok, max_new_tokens=max_new, samples=samples)


def chat_samples(model, tok, functions: list[dict], sources: dict[str, str]) -> list[dict]:
    """A code request and a full agent turn (tool call -> tool result -> answer)."""
    out = []
    fn = next((f for f in functions if not f["cls"]), functions[0])
    ask = f"Write a Python function `{fn['sig']}` that {T.third_person(fn['doc']) or fn['doc']}."
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
    )
    out.append(dict(request=ask, reply=strip_eos(generate(model, tok, prompt, 160)[0])))
    rel = sorted(sources)[1]
    path = "Lib/" + rel
    excerpt = "\n".join(sources[rel].splitlines()[:14])
    messages = [
        {"role": "user", "content": f"Read {path}."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "read_file", "arguments": {"path": path}}}
            ],
        },
        {"role": "tool", "content": excerpt},
    ]
    prompt = tok.apply_chat_template(
        messages, tools=T.TOOLS, tokenize=False, add_generation_prompt=True
    )
    out.append(
        dict(
            request=f"Read {path}. (after the read_file result)",
            reply=strip_eos(generate(model, tok, prompt, 80)[0]),
        )
    )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=T.DEFAULT_OUT)
    ap.add_argument("--models", default="target,draft")
    ap.add_argument("--ppl-tokens", type=int, default=200_000)
    ap.add_argument("--n-functions", type=int, default=60)
    ap.add_argument("--n-chats", type=int, default=60)
    ap.add_argument("--n-code-chats", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--dtype", default="float32", help="compute dtype (weights are stored bf16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny counts, for testing the script")
    ap.add_argument("--out", type=Path, default=None, help="default MODEL_DIR/eval.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.ppl_tokens, args.n_functions, args.n_chats, args.max_new_tokens = 3000, 3, 4, 40
        args.n_code_chats = 3

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    sources = heldout_sources()
    functions = pick_functions(sources, args.n_functions, args.seed)
    requests = chat_requests(sources, args.n_chats, args.seed)
    results = dict(
        settings=dict(
            heldout_files=len(sources),
            ppl_tokens=args.ppl_tokens,
            n_functions=len(functions),
            n_chats=len(requests),
            n_code_chats=args.n_code_chats,
            max_new_tokens=args.max_new_tokens,
            dtype=args.dtype,
            decoding="greedy",
            torch=torch.__version__,
            transformers=__import__("transformers").__version__,
        )
    )
    for name in args.models.split(","):
        path = args.model_dir / name
        t0 = time.time()
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype))
        model.eval()
        res = dict(params=sum(p.numel() for p in model.parameters()))
        res["perplexity"] = perplexity(model, tok, sources, args.ppl_tokens)
        print(f"[{name}] held-out perplexity: {res['perplexity']}", flush=True)
        res["completion"] = eval_completion(model, tok, functions, args.max_new_tokens)
        c = res["completion"]
        print(f"[{name}] completion ast ok: {c['ast_ok']}/{c['n']} = {c['ast_ok_fraction']}")
        res["tool_calls"] = eval_tool_calls(model, tok, requests, 64)
        tc = res["tool_calls"]
        print(
            f"[{name}] tool calls: right name {tc['name_correct_fraction']}, parsed "
            f"{tc['parsed_fraction']}, exact path {tc['path_exact_fraction']} (seen phrasings "
            f"{tc['seen_phrasing_fraction']}, new phrasings {tc['unseen_phrasing_fraction']})"
        )
        res["code_chats"] = eval_code_chats(
            model, tok, functions[: args.n_code_chats], args.max_new_tokens
        )
        cc = res["code_chats"]
        print(
            f"[{name}] code chats answered with code: {cc['code_ok']}/{cc['n']} "
            f"(JSON replies: {cc['json_replies']})"
        )
        if name == "target":
            res["json_mode"] = eval_json_mode(path, 128)
            jm = res["json_mode"]
            print(
                f"[{name}] JSON mode: {jm['valid']}/{jm['n']} objects, "
                f"{jm['keys_ok']} with the keys"
            )
        res["chat_samples"] = chat_samples(model, tok, functions, sources)
        res["eval_seconds"] = round(time.time() - t0, 1)
        results[name] = res
        for s in c["samples"][:2]:
            print(f"--- [{name}] completion ({'ok' if s['ok'] else 'FAIL'}) {s['file']}")
            print(s["prompt"] + s["completion"])
        for s in tc["samples"][:2]:
            print(f"--- [{name}] tool request: {s['request']}\n{s['reply']}")
        for s in res["chat_samples"]:
            print(f"--- [{name}] chat: {s['request']}\n{s['reply']}")
        sys.stdout.flush()
    out = args.out or args.model_dir / "eval.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
