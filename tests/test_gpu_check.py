"""The GPU check's dry run (benchmarks/gpu_check.sh --dry-run): every part the GPU run has,
end to end on this CPU with a tiny model, so the script is ready when a GPU is."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)
LIMITS = gpu_check.LIMITS


def test_dry_run_writes_every_part_the_gpu_run_writes(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("EXPRESSLANE_RESULTS_DIR", None)
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry-run", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    parts = report["parts"]
    assert set(parts) == set(LIMITS)
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(LIMITS, "ok")
    tests = parts["tests"]["result"]
    assert tests["tests"] >= 30 and tests["skipped"] == tests["tests"]  # collected, skipped
    assert any("no CUDA device" in reason for reason in tests["skip_reasons"])
    result = {name: p["result"] for name, p in parts.items()}
    assert result["roofline"]["decode_tok_s"] > 0 and result["roofline"]["roofline_tok_s"] > 0
    assert {"1", "4"} <= set(result["decode"]["expresslane"])
    assert result["decode"]["ratio_vs_hf_bf16"] > 0
    assert result["nvfp4"]["model"]["nvfp4"]["decode_tok_s"] > 0
    assert {"batch_1", "batch_4"} <= set(result["step_profile"])
    run = result["tiers"]["runs"][0]
    assert run["solo"]["ultrafast_tokens_per_s_median"] > 0
    assert "with_ultrafast" in run and "default_alone" in run
    assert "tests: 0 passed" in proc.stdout  # the headline, printed last
