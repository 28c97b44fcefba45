"""The execution plan: which kernel each linear layer runs, and which steps run the C++ layer
stack instead of the Python layers. Chosen once when the model is laid out for its device
(`linear_path`, `fp4_path`, `int4_path`) and bound to its KV cache (`ExecutionPlan.of`),
logged in one line at load; the forward pass asks the plan (`uses_stack`) and nothing else."""

from __future__ import annotations

import enum
import functools
from collections import Counter
from dataclasses import dataclass

import torch

from expresslane import kernels
from expresslane.kernels.linear_choice import PromptLinears

# Up to this many rows the bf16 row kernel beats oneDNN where linears have no bf16 dot
# products, and decode-only steps of up to this many tokens run the layer stack: AVX2, 63
# against 92 ms for SmolLM2-135M's 120 layer linears at 16 rows (float32 matmul).
ROW_KERNEL_ROWS = 16

# Decode-only steps of up to this many tokens run the layer stack over 4-bit linears where not
# every step does (an output head without a row-invariant kernel): a batch-64 decode step of
# SmolLM2-135M took 264 ms there against 506 ms in the Python layers.
FP4_STACK_ROWS = 64


class LinearPath(enum.StrEnum):
    """The kernel a linear layer runs."""

    BF16_DOT = "bf16-dot"  # AVX-512 BF16 dot products on packed bf16 weights, every batch
    BF16_ROWS = "bf16-rows"  # the bf16 row kernel up to ROW_KERNEL_ROWS rows, then oneDNN
    F16_ROWS = "f16-rows"  # the same over float16 weights (packed, f16dot_cpu.cpp, with AVX-512)
    ONEDNN = "onednn"  # oneDNN on weights prepacked in the compute dtype
    TORCH = "torch"  # F.linear
    FP4_W4A8 = "fp4-w4a8"  # kernels/fp4_cpu.cpp: FP4 codes expanded in registers, every batch
    FP4_DEQUANTIZE = "fp4-dequantize"  # the PyTorch reference, or Triton on CUDA
    INT4_W4A8 = "int4-w4a8"  # kernels/int4_cpu.cpp: GGUF's 4-bit integer blocks, every batch
    INT4_DEQUANTIZE = "int4-dequantize"  # the PyTorch reference (CUDA too)


# Paths whose rows come out the same whatever the batch beside them
ROW_INVARIANT = frozenset({LinearPath.BF16_DOT, LinearPath.FP4_W4A8, LinearPath.INT4_W4A8})
# The row kernel over 16-bit weights (gemv_cpu.cpp) up to ROW_KERNEL_ROWS rows, then oneDNN
ROW_PATHS = frozenset({LinearPath.BF16_ROWS, LinearPath.F16_ROWS})
# Paths the C++ layer stack runs (it is built when every layer linear takes one)
STACK_PATHS = ROW_INVARIANT | ROW_PATHS
# 4-bit weights (FP4 or integer blocks), in a kernel or expanded by the reference
FOUR_BIT_PATHS = frozenset(
    {
        LinearPath.FP4_W4A8,
        LinearPath.FP4_DEQUANTIZE,
        LinearPath.INT4_W4A8,
        LinearPath.INT4_DEQUANTIZE,
    }
)


@functools.cache
def onednn_prepack_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a linear weight of this dtype on this CPU."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 1)
        x = torch.ones(1, 8, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
        return bool(torch.allclose(y.float(), torch.full((1, 8), 8.0)))
    except (RuntimeError, AttributeError):
        return False


def compute_dtypes(
    dtype: torch.dtype, auto: bool, device: torch.device
) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, linear weight storage dtype) for a checkpoint in `dtype`, or asked for
    it (`auto` False).

    On CPU, bf16 or float16 (the checkpoint's, or asked for) computes in float32 and keeps its
    16-bit linear weights where the CPU kernels build: decode batches run the layer stack,
    which reads the 16-bit bytes and sums in float32 (with AVX-512 BF16, products of
    bf16-rounded activations for bf16 weights): 141 against 69 tok/s for bf16 compute at batch
    1 on an AVX-512 BF16 CPU (SmolLM2-135M). Without the kernels a half dtype computes in
    float32 only where its matmuls are slow (no oneDNN prepacking for it) and it was not asked
    for."""
    cpu = device.type == "cpu"
    half = dtype in (torch.bfloat16, torch.float16)
    if cpu and half and kernels.cpu_kernels() is not None:
        return torch.float32, dtype
    if auto and cpu and dtype != torch.float32 and not onednn_prepack_supported(dtype):
        return torch.float32, torch.float32
    return dtype, dtype


def dense_path(compute_dtype: torch.dtype) -> LinearPath:
    """oneDNN's prepacked layout where it takes this dtype on this CPU (about 1.3-1.5x faster
    per matmul at small batch than `F.linear`), else F.linear."""
    return LinearPath.ONEDNN if onednn_prepack_supported(compute_dtype) else LinearPath.TORCH


def linear_path(weight: torch.Tensor, compute_dtype: torch.dtype) -> LinearPath:
    """The path of a dense linear on this CPU.

    A bf16 checkpoint computed in float32 on a CPU with AVX-512 BF16 runs every batch in the
    dot-product kernel (kernels/bf16dot_cpu.cpp), which rounds the activations to bf16 as
    oneDNN's bf16 matmul does and is faster than it at every batch size measured (0.2-0.97x
    its time from 1 to 512 rows, benchmarks/native_steps.py). Without AVX-512 BF16 the row
    kernel takes small batches (it moves half the bytes of a float32 matmul); float16 weights
    take it too (widened exactly, F16C), larger batches oneDNN on a float32 copy."""
    half = weight.dtype in (torch.bfloat16, torch.float16)
    built = kernels.cpu_kernels() if half and compute_dtype == torch.float32 else None
    if built is not None and weight.dtype == torch.bfloat16:
        if built.bf16_dot_available() and _dot_packable(weight):
            return LinearPath.BF16_DOT
        return LinearPath.BF16_ROWS  # the row kernel takes any shape
    if built is not None and weight.dtype == torch.float16:
        return LinearPath.F16_ROWS
    return dense_path(compute_dtype)


def fp4_path(compute_dtype: torch.dtype) -> LinearPath:
    """The FP4 kernel (AVX2) in float32 compute: as fast as expanding the whole weight for a
    float32 GEMM even at 512 rows (SmolLM2's gate/up at 512 rows: 6.9 against 8.3 ms)."""
    if compute_dtype == torch.float32 and kernels.cpu_kernels() is not None:
        return LinearPath.FP4_W4A8
    return LinearPath.FP4_DEQUANTIZE


def int4_path(compute_dtype: torch.dtype) -> LinearPath:
    """The 4-bit integer kernel (GGUF blocks kept 4-bit) in float32 compute, as `fp4_path`."""
    if compute_dtype == torch.float32 and kernels.cpu_kernels() is not None:
        return LinearPath.INT4_W4A8
    return LinearPath.INT4_DEQUANTIZE


def _prompt_linears_text(choice: PromptLinears | None, matrix_rows: int | None) -> str:
    if choice is None:
        return ""
    if choice.matrix_rows is not None and matrix_rows is None:
        return "prompt linears row kernel (batch invariant)"
    return choice.describe()


def _dot_packable(w: torch.Tensor) -> bool:
    """Whether the bf16 dot-product kernel takes this weight: 16-column blocks, k pairs."""
    return w.shape[0] % 16 == 0 and w.shape[1] % 2 == 0


@dataclass(frozen=True)
class ExecutionPlan:
    """What runs where, for one loaded model."""

    compute: str  # the activations' dtype
    kv_cache: str  # the KV store (models/kv_store.py)
    linears: dict[LinearPath, int]  # how many linear layers (the output head too) take each path
    stack: bool  # the C++ layer stack is built (every layer linear runs a CPU kernel)
    stack_rows: int  # decode-only steps of up to this many tokens run the stack
    every_step: bool  # every step runs the stack: all linears row-invariant
    native_head: bool  # the stack also runs the final norm and the head (logits, greedy)
    tiled_prompts: bool = False  # prompt rows attend in the tiled kernel (prompt_attention.h)
    bf16_prompts: bool = False  # ... with bf16 products (the layers round activations to bf16)
    # A step's prompt rows take oneDNN's bf16 matmul from this many on (linear_choice.py)
    matrix_prompt_rows: int | None = None
    prompt_linears: str = ""  # how that was chosen, for the log line

    @classmethod
    def of(
        cls,
        compute: torch.dtype,
        kv_cache: str,
        head: LinearPath,
        layers: list[LinearPath],
        stack: bool,
        tiled_prompts: bool = False,
        batch_invariant: bool = False,
        prompt_linears: PromptLinears | None = None,
    ) -> ExecutionPlan:
        """The plan of a model whose output head and layer linears take these paths, with or
        without the C++ layer stack built, its prompt rows in the tiled attention or not, and
        in oneDNN's matmul where `prompt_linears` measured it faster. `batch_invariant` runs
        every step in the stack even where its linears are slower than oneDNN's for large
        batches (the bf16 row kernel), and keeps prompt rows in the row kernels."""
        paths = [head, *layers]
        four_bit = any(p in FOUR_BIT_PATHS for p in paths)
        # With linears that are fast and row-invariant at any batch every step runs the
        # stack: then a sequence's greedy tokens do not depend on what it was batched with
        # (speculation, other requests, prompt chunking, cached prefixes). In the stack every
        # layer linear runs a row kernel at any batch, so asking for it makes that true too.
        asked = batch_invariant and head in STACK_PATHS
        invariant = asked or all(p in ROW_INVARIANT for p in paths)
        matrix_rows = None
        if stack and not batch_invariant and prompt_linears is not None:
            matrix_rows = prompt_linears.matrix_rows
        return cls(
            compute=str(compute).removeprefix("torch."),
            kv_cache=kv_cache,
            linears=dict(Counter(paths)),
            stack=stack,
            stack_rows=(FP4_STACK_ROWS if four_bit else ROW_KERNEL_ROWS) if stack else 0,
            every_step=stack and invariant,
            native_head=stack and head in STACK_PATHS,
            tiled_prompts=tiled_prompts,
            # the bf16 dot-product linears already round every activation to bf16: the
            # attention's products of prompt rows may too (~2x the float32 ones)
            bf16_prompts=tiled_prompts and LinearPath.BF16_DOT in layers,
            matrix_prompt_rows=matrix_rows,
            prompt_linears=_prompt_linears_text(prompt_linears, matrix_rows),
        )

    def uses_stack(self, num_tokens: int, decode_only: bool) -> bool:
        """Whether a step of `num_tokens` tokens runs the C++ layer stack."""
        return self.stack and (self.every_step or (decode_only and num_tokens <= self.stack_rows))

    @property
    def batch_invariant(self) -> bool:
        """Greedy tokens do not depend on the batch (every step takes the same kernels, and
        prompt rows do not take oneDNN's, whose rows may depend on the rows beside them)."""
        return self.every_step and self.matrix_prompt_rows is None

    def describe(self) -> str:
        linears = ", ".join(f"{n} {path}" for path, n in self.linears.items())
        if not self.stack:
            steps = "every step in the Python layers"
        elif self.every_step:
            steps = "every step in the C++ layer stack"
        else:
            steps = f"decode steps of <= {self.stack_rows} tokens in the C++ layer stack"
        head = ", head in the stack" if self.native_head else ""
        prompts = "tiled" if self.tiled_prompts else "row by row" if self.stack else "SDPA"
        prompts += " (bf16 products)" if self.bf16_prompts else ""
        matrix = f"; {self.prompt_linears}" if self.prompt_linears else ""
        return (
            f"{self.compute} compute, {self.kv_cache}; linears: {linears}; {steps}{head}; "
            f"prompt attention {prompts}{matrix}"
        )
