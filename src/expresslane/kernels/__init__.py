"""Native CPU kernels, compiled on first use with the local C++ compiler (cached by torch in
~/.cache/torch_extensions), and the Triton FP4 linear for CUDA. Every kernel has a plain
PyTorch reference it is tested against; the loaders return None where a kernel cannot be
built or run (no compiler, a CPU without the instructions, no Triton)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import shutil
import threading
import time
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

log = logging.getLogger("expresslane.kernels")
_SRC = Path(__file__).parent
SOURCES = (
    "bindings.cpp",
    "gemv_cpu.cpp",
    "bf16dot_cpu.cpp",
    "f16dot_cpu.cpp",
    "layer_stack_cpu.cpp",
    "experts_cpu.cpp",
    "fp4_cpu.cpp",
    "int4_cpu.cpp",
    "mask_cpu.cpp",
    "sample_cpu.cpp",
)


# torch's "AVX512" capability means AVX-512 F, BW, VL and DQ (kernels use them under #ifdef);
# AVX512_BF16 adds the bf16 dot product (bf16dot_cpu.cpp) and VNNI's byte dot product (the FP4
# kernel), which torch does not report (every CPU with AVX-512 BF16 so far has VNNI too)
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
ISA_FLAGS = {"AVX512": _AVX512, "AVX512_BF16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"]}


@contextlib.contextmanager
def exclusive_build(build_dir: Path):
    """Hold an OS lock on `build_dir` while torch builds or loads the kernels there. The OS
    drops it when its process dies, so a torch lock file found while holding it was left by
    a killed build (Ctrl-C during the first `expresslane serve`): it is removed, since torch
    would wait for it to vanish, silently and forever. Other starts wait for a live build."""
    if fcntl is None:  # not POSIX: torch's own lock only
        yield
        return
    with open(build_dir / "expresslane.lock", "w") as holder:
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the CPU kernels: waiting for it")
            fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing the build lock a killed build left: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)


@contextlib.contextmanager
def _progress(what: str, active: bool, every: float = 20.0):
    """Log `what` with an honest estimate, a line every `every` seconds while it runs, and
    one when it is done: a first start is never silent."""
    if not active:
        yield
        return
    log.info("%s: once per machine and torch install, 2-4 min on 2 cores", what)
    start, done = time.monotonic(), threading.Event()

    def beat() -> None:
        while not done.wait(every):
            log.info("still compiling the CPU kernels (%.0f s)", time.monotonic() - start)

    threading.Thread(target=beat, name="kernel-build-progress", daemon=True).start()
    try:
        yield
    finally:
        done.set()
        log.info("CPU kernels compiled in %.0f s", time.monotonic() - start)


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
    if isa == "AVX512" and {"avx512_bf16", "avx512_vnni"} <= cpu_flags():
        return "AVX512_BF16"
    return isa


def _copy_sources(files: list[Path], dst: Path) -> Path:
    """The sources copied beside the build: torch's build file names source paths, so builds
    from two checkouts of the same code would otherwise keep rebuilding each other's."""
    dst.mkdir(exist_ok=True)
    for f in files:
        target = dst / f.name
        if not target.exists() or target.read_bytes() != f.read_bytes():
            shutil.copyfile(f, target)
    return dst


@functools.cache
def cpu_kernels():
    """The compiled module (AVX2, plus AVX-512 and AVX-512 BF16 paths where the CPU has
    them), or None."""
    isa = cpu_isa()  # one build per instruction set
    if isa not in ISA_FLAGS and isa != "AVX2":
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        # no contraction of a * b + c into an FMA: the compiler would fuse it in some
        # inlined copies and not others, and a row's result must not depend on which kernel
        # variant (row count) computed it
        cflags = [
            "-O3",
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-ffp-contract=off",
            "-fopenmp",
            *ISA_FLAGS.get(isa, []),
        ]
        # torch rebuilds when a listed source changes, not a header or a flag: name the build
        # by all of them
        files = sorted(_SRC.glob("*.[ch]*"))
        # the build also names torch's headers by path: one build folder per torch install
        torch_id = f"{torch.__version__} {Path(torch.__file__).parent}"
        digest = hashlib.sha256(
            b"".join(p.read_bytes() for p in files) + " ".join([*cflags, torch_id]).encode()
        )
        name = f"expresslane_cpu_kernels_{isa.lower()}_{digest.hexdigest()[:12]}"
        build_dir = Path(get_default_build_root()) / name
        build_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_build(build_dir):
            building = not (build_dir / f"{name}.so").exists()
            src = _copy_sources(files, build_dir / "src")
            with _progress(f"compiling the {isa} CPU kernels in {build_dir}", building):
                return load(
                    name=name,
                    sources=[str(src / n) for n in SOURCES],
                    extra_cflags=cflags,
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
