"""The GPU check's parts, run one after another (benchmarks/gpu_check.sh prepares the Python
environment, then runs this): the CUDA tests, then the GPU figures on random weights of a ~1B
Llama-architecture model. Every part runs in its own process with a time limit, and
OUT/gpu_check.json is rewritten as each part ends, so a run cut short keeps what it finished.
docs/gpu.md says how to read it.

    python benchmarks/gpu_check.py OUT [--dry-run]

`--dry-run` runs the same parts on the CPU with a tiny model of the same family and small
sizes (the CUDA tests are collected and skipped with their reason): the default test run does
this, so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_fp4_triton.py"]


@dataclass(frozen=True)
class Sizes:
    """What the figures run: the GPU's, or the dry run's."""

    device: str
    model: str  # the checkpoint's name in common.py
    rounds: int
    batches: str  # decode.py's
    prefill: str
    kv_cache_gb: float
    profile: list[str]  # step_profile.py's flags
    tiers: list[str]  # tiers.py's flags


GPU = Sizes(
    device="cuda",
    model="LLAMA_1B",
    rounds=3,
    batches="1,16,64,256",
    prefill="1x2048",
    kv_cache_gb=16.0,
    profile=["--batches", "1,64", "--steps", "40"],
    tiers=["--starts", "1", "--streams", "64", "--ultrafast", "6", "--warmup", "5"]
    + ["--window", "15", "--default-tokens", "256", "--ultrafast-tokens", "96"],
)
DRY = Sizes(
    device="cpu",
    model="TINY_LLAMA",
    rounds=1,
    batches="1,4",
    prefill="1x64",
    kv_cache_gb=0.25,
    profile=["--batches", "1,4", "--steps", "8"],
    tiers=["--starts", "1", "--streams", "2", "--ultrafast", "1", "--warmup", "1"]
    + ["--window", "2", "--default-tokens", "16", "--ultrafast-tokens", "8"],
)
# Seconds each part may take on the GPU (the dry run's are the same: a CPU runs its tiny
# sizes well inside them). All together stay under the 8 minutes the check is given.
LIMITS = {
    "environment": 30,
    "tests": 150,
    "model": 60,
    "roofline": 40,
    "roofline_graphs": 40,
    "decode": 90,
    "nvfp4": 40,
    "step_profile": 30,
    "tiers": 120,
}


class Report:
    """OUT/gpu_check.json: every part's status, seconds and result, rewritten after each."""

    def __init__(self, out: Path, dry_run: bool):
        self.path = out / "gpu_check.json"
        self.parts_dir = out / "parts"
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        self.data: dict = {"dry_run": dry_run, "started": time.time(), "parts": {}}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def run(self, name: str, cmd: list[str], result=None, env: dict | None = None) -> None:
        """Run one part's command; `result` reads what it produced (default: the JSON the
        benchmark saved under the parts folder by the part's name)."""
        start = time.perf_counter()
        entry: dict = {"command": " ".join(cmd)}
        log = self.parts_dir / f"{name}.log"
        env = {**os.environ, "EXPRESSLANE_RESULTS_DIR": str(self.parts_dir), **(env or {})}
        try:
            with log.open("w") as f:
                proc = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=LIMITS[name],
                )
            entry["returncode"] = proc.returncode
            entry["result"] = (result or self._saved(name))()
            entry["status"] = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            entry["status"] = "timed_out"
        except Exception as e:  # a part that produced nothing readable
            entry["status"] = "failed"
            entry["error"] = repr(e)
        entry["seconds"] = round(time.perf_counter() - start, 1)
        if entry["status"] != "ok":
            entry["log_tail"] = log.read_text()[-3000:] if log.exists() else ""
        self.data["parts"][name] = entry
        self.write()
        print(f"[gpu_check] {name}: {entry['status']} in {entry['seconds']} s", flush=True)

    def _saved(self, name: str):
        return lambda: json.loads((self.parts_dir / f"{name}.json").read_text())


def junit_summary(path: Path) -> dict:
    """Counts, the failures with their messages, and the skip reasons of a junit XML file."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failures, skips = [], {}
    for case in suite.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                failures.append({"test": name, "message": (node.get("message") or "")[:500]})
        node = case.find("skipped")
        if node is not None:
            reason = node.get("message") or ""
            skips[reason] = skips.get(reason, 0) + 1
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failures, "skip_reasons": skips}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict:
    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
    try:
        smi = ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem", "--format=csv"]
        info["nvidia_smi"] = subprocess.run(smi, capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        info["nvidia_smi"] = None
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    sizes = DRY if args.dry_run else GPU
    report = Report(args.out, args.dry_run)
    py = sys.executable
    report.data["parts"]["environment"] = {"status": "ok", "result": environment()}
    report.write()

    xml = report.parts_dir / "tests.xml"
    pytest = [py, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q"]
    report.run(
        "tests",
        [*pytest, f"--junitxml={xml}", *CUDA_TESTS],
        result=lambda: junit_summary(xml),
        env={"EXPRESSLANE_CUDA_TESTS": "1"},
    )
    make = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import common; "
        f"p = common.random_checkpoint({sizes.model.lower()!r}, common.{sizes.model}, "
        f"demo_tokenizer=True, device={sizes.device!r}); import json; "
        f"json.dump({{'path': str(p), 'config': common.{sizes.model}}}, "
        f"open({str(report.parts_dir / 'model.json')!r}, 'w'))"
    )
    report.run("model", [py, "-c", make])
    if report.data["parts"]["model"]["status"] != "ok":
        return  # the figures need the model
    model = json.loads((report.parts_dir / "model.json").read_text())["path"]
    bench = [py, "-u"]
    dev = ["--device", sizes.device]
    rounds = ["--rounds", str(sizes.rounds)]
    roofline = [*bench, "benchmarks/roofline.py", "--model", model, *dev, *rounds]
    report.run("roofline", roofline)
    report.run("roofline_graphs", [*roofline, "--cuda-graphs", "--name", "roofline_graphs"])
    report.run(
        "decode",
        [*bench, "benchmarks/decode.py", "--model", model, *dev, *rounds]
        + ["--batches", sizes.batches, "--prefill", sizes.prefill]
        + ["--kv-cache-gb", str(sizes.kv_cache_gb), "--hf-dtypes", "bfloat16"],
    )
    report.run(
        "nvfp4",
        [*bench, "benchmarks/quant.py", "--model", model, *dev, *rounds]
        + ["--formats", "nvfp4", "--ppl-tokens", "0"],
        result=report._saved("quant"),
    )
    report.run(
        "step_profile",
        [*bench, "benchmarks/step_profile.py", "--model", model, *dev, *sizes.profile],
    )
    port = ["--port", str(free_port())]
    report.run("tiers", [*bench, "benchmarks/tiers.py", "--model", model, *port, *sizes.tiers])
    report.data["seconds"] = round(time.time() - report.data["started"], 1)
    report.write()
    headline(report.data["parts"])
    failed = [n for n, p in report.data["parts"].items() if p["status"] != "ok"]
    print(f"[gpu_check] wrote {report.path}; parts not ok: {failed or 'none'}")


def headline(parts: dict) -> None:
    """The figures that matter, one line each (a device call's reply shows the output's end)."""

    def get(part: str, *keys):
        value = parts.get(part, {}).get("result")
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    t = get("tests") or {}
    failed = (t.get("failures") or 0) + (t.get("errors") or 0)
    print(f"tests: {t.get('passed')} passed, {failed} failed, {t.get('skipped')} skipped")
    for f in t.get("failed", [])[:8]:
        print(f"  FAILED {f['test']}: {f['message'][:160]}")
    print(
        f"roofline: {get('roofline', 'decode_tok_s')} tok/s = "
        f"{get('roofline', 'fraction_of_roofline')} of {get('roofline', 'roofline_tok_s')} "
        f"({get('roofline', 'bandwidth_gb_s')} GB/s)"
    )
    print(
        f"with cuda_graphs: {get('roofline_graphs', 'decode_tok_s')} tok/s = "
        f"{get('roofline_graphs', 'fraction_of_roofline')} of the roofline"
    )
    ours, hf = get("decode", "expresslane") or {}, get("decode", "hf_bf16") or {}
    for b in ("1", "16", "64", "256", "4"):
        if b in ours:
            theirs = (hf.get(b) or {}).get("throughput")
            print(f"decode batch {b}: {ours[b]['throughput']:.0f} tok/s, transformers {theirs}")
    print(f"batch-1 ratio vs transformers bf16: {get('decode', 'ratio_vs_hf_bf16')}")
    print(f"nvfp4 vs bf16 batch-1: {get('nvfp4', 'model', 'nvfp4', 'speedup_vs_bf16')}x")
    for key, row in (get("step_profile") or {}).items():
        if key.startswith("batch_"):
            print(f"step {key}: {row['step_ms']:.2f} ms, host share {row['host_share']:.0%}")
    run = (get("tiers", "runs") or [{}])[0].get("with_ultrafast", {})
    print(
        f"tiers: ultrafast {run.get('ultrafast_tokens_per_s_median')} tok/s vs default stream "
        f"{run.get('default_stream_tokens_per_s_median')} ({run.get('fraction_of_solo')} of solo)"
    )


if __name__ == "__main__":
    main()
