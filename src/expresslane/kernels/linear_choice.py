"""Which kernel the prompt rows' linears take, chosen by measurement on this machine.

Decode and verification rows always take the row-invariant kernel (`LinearPath.BF16_DOT`, or
`FP4_W4A8` for FP4 weights): that is what keeps greedy outputs identical with and without
speculation. Prompt rows may instead take oneDNN's bf16 matmul (on AMX tiles where the CPU has
them; FP4 weights dequantized to bf16 for it) in steps with at least `matrix_rows` of them.
At load, one layer's four linears are timed in both kernels at `MEASURE_ROWS` rows; the matrix
path is taken from the smallest row count from which it is at least `MIN_GAIN` times faster at
every count measured. The choice is cached per CPU, torch build, row kernel and layer shapes
(`$XDG_CACHE_HOME/expresslane/linear_choice.json`), and `EXPRESSLANE_PROMPT_LINEARS` overrides
it: `rows` (never), `matrix:N` (from N prompt rows), `measure` (the default).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from expresslane import kernels

MEASURE_ROWS = (32, 128, 512)
MIN_GAIN = 1.2
REPEATS = 5  # timings per kernel and row count, in turns; the fastest is kept
ENV = "EXPRESSLANE_PROMPT_LINEARS"

log = logging.getLogger("expresslane.engine")


@dataclass(frozen=True)
class PromptLinears:
    matrix_rows: int | None  # prompt rows in a step from which they take the matrix path
    source: str  # "measured", "cached", "set by EXPRESSLANE_PROMPT_LINEARS"
    gains: dict[int, float] = field(default_factory=dict)  # row-kernel / matrix time, by rows

    def describe(self) -> str:
        gains = ", ".join(f"{g:.2f}x at {m}" for m, g in sorted(self.gains.items()))
        where = "row kernel" if self.matrix_rows is None else f">= {self.matrix_rows}: oneDNN bf16"
        return f"prompt linears {where} ({self.source}{'; oneDNN ' + gains if gains else ''})"


ROW_KERNEL = PromptLinears(None, "not measured: no row kernel with a matrix path beside it")


def choose(
    kind: str, matrices: list[torch.Tensor], row_kernels: list[Callable] | None = None
) -> PromptLinears:
    """The prompt rows' path for a model whose every layer has linears like these: `kind`
    names their row kernel (it keys the cache), `matrices` are their plain bf16 weights ([N,
    K] each: qkv, o, gate_up, down), `row_kernels` compute them (x -> y) as decode rows do
    (default: the bf16 dot product on `matrices`)."""
    forced = os.environ.get(ENV, "measure")
    if forced == "rows":
        return PromptLinears(None, f"set by {ENV}")
    if forced.startswith("matrix:"):
        return PromptLinears(int(forced.removeprefix("matrix:")), f"set by {ENV}")
    if forced != "measure":
        raise ValueError(f"{ENV}={forced!r}: use rows, matrix:N or measure")
    key = _key(kind, matrices)
    cache = _read_cache()
    if key in cache:
        gains = {int(m): g for m, g in cache[key].items()}
        return PromptLinears(_crossover(gains), "cached", gains)
    log.info("timing the prompt rows' linear kernels (once per machine and layer shapes)")
    gains = measure(matrices, row_kernels)
    _write_cache({**cache, key: {str(m): g for m, g in gains.items()}})
    return PromptLinears(_crossover(gains), "measured", gains)


def measure(
    matrices: list[torch.Tensor], row_kernels: list[Callable] | None = None
) -> dict[int, float]:
    """Row-kernel time / matrix time over the four linears, at each of MEASURE_ROWS rows
    (row kernels: the bf16 dot product on `matrices` unless given)."""
    if row_kernels is None:
        built = kernels.cpu_kernels()
        packed = [built.pack_bf16_dot(w) for w in matrices]
        row_kernels = [lambda x, p=p: built.bf16_dot_linear(x, p, None) for p in packed]
    gains = {}
    for m in MEASURE_ROWS:
        xs = [torch.randn(m, w.shape[1]) for w in matrices]

        def rows(xs=xs):
            for x, kernel in zip(xs, row_kernels, strict=True):
                kernel(x)

        def matrix(xs=xs):
            for x, w in zip(xs, matrices, strict=True):
                F.linear(x.to(torch.bfloat16), w).float()

        times = _fastest([rows, matrix])
        gains[m] = times[0] / times[1]
    return gains


def _crossover(gains: dict[int, float]) -> int | None:
    """The smallest row count from which every measured gain is at least MIN_GAIN."""
    best = None
    for m in sorted(gains, reverse=True):
        if gains[m] < MIN_GAIN:
            break
        best = m
    return best


def _fastest(fns) -> list[float]:
    """Each function's fastest time, timed in turns (a burst of load slows them alike)."""
    for fn in fns:
        fn()  # warm-up: oneDNN creates its primitives on the first call
    times = [float("inf")] * len(fns)
    for _ in range(REPEATS):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i] = min(times[i], time.perf_counter() - start)
    return times


def _key(kind: str, matrices: list[torch.Tensor]) -> str:
    flags = sorted(kernels.cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    shapes = ",".join("x".join(map(str, w.shape)) for w in matrices)
    return f"{_cpu_name()}|{' '.join(flags)}|torch {torch.__version__}|{kind} {shapes}"


def _cpu_name() -> str:
    """Vendor, family, model and name of the first CPU (a VM's name alone can be generic)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown cpu"
    first = text.split("\n\n")[0].splitlines()
    fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in first)}
    return " ".join(fields.get(n, "") for n in ("vendor_id", "cpu family", "model", "model name"))


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "expresslane" / "linear_choice.json"


def _read_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(data: dict) -> None:
    """Atomically: two servers starting at once each write a whole file."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measured again at the next start
