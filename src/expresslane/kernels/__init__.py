"""Native CPU kernels, compiled on first use with the local C++ compiler (cached by torch in
~/.cache/torch_extensions), and the Triton FP4 linear for CUDA. Every kernel has a plain
PyTorch reference it is tested against; the loaders return None where a kernel cannot be
built or run (no compiler, a CPU without the instructions, no Triton)."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("expresslane.kernels")
_SRC = Path(__file__).parent


# torch's "AVX512" capability means AVX-512 F, BW, VL and DQ (kernels use them under #ifdef);
# AVX512_BF16 adds the bf16 dot product (bf16dot_cpu.cpp), which torch does not report
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
ISA_FLAGS = {"AVX512": _AVX512, "AVX512_BF16": [*_AVX512, "-mavx512bf16"]}

STALE_LOCK_SECONDS = 600  # a build takes 1-2 minutes here


def clear_stale_build_lock(build_dir: Path) -> None:
    """Remove the build lock a killed build left behind (e.g. Ctrl-C during the first
    `expresslane serve`): torch waits for it to vanish, silently and forever."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing a stale CPU-kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_isa() -> str:
    """The instruction set the kernels are built for: torch's capability, refined."""
    isa = torch.backends.cpu.get_cpu_capability()
    if isa == "AVX512" and "avx512_bf16" in cpu_flags():
        return "AVX512_BF16"
    return isa


@functools.cache
def cpu_kernels():
    """The compiled module (AVX2, plus AVX-512 and AVX-512 BF16 paths where the CPU has
    them), or None."""
    isa = cpu_isa()  # one build per instruction set
    if isa not in ISA_FLAGS and isa != "AVX2":
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        # torch rebuilds when a listed source changes, not a header: name the build by all files
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(_SRC.glob("*.[ch]*"))))
        name = f"expresslane_cpu_kernels_{isa.lower()}_{digest.hexdigest()[:12]}"
        build_dir = Path(get_default_build_root()) / name
        build_dir.mkdir(parents=True, exist_ok=True)
        clear_stale_build_lock(build_dir)
        if not (build_dir / f"{name}.so").exists():
            log.info("compiling the %s CPU kernels (once, about a minute) in %s", isa, build_dir)
        return load(
            name=name,
            sources=[
                str(_SRC / n)
                for n in ("gemv_cpu.cpp", "bf16dot_cpu.cpp", "decode_cpu.cpp", "fp4_cpu.cpp")
            ],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", *ISA_FLAGS.get(isa, [])],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers: fall back to PyTorch ops
        log.warning("CPU kernels unavailable (%s); using PyTorch matmuls", e)
        return None


@functools.cache
def triton_fp4_linear():
    """The Triton FP4 linear for CUDA (fp4_triton.py), or None where Triton is not installed."""
    try:
        from expresslane.kernels.fp4_triton import fp4_linear_triton
    except ImportError:
        return None
    return fp4_linear_triton
