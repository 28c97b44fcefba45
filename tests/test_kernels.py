"""Native kernels against their plain PyTorch references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from expresslane.kernels import cpu_kernels
from expresslane.kernels.plan import ROW_KERNEL_ROWS, LinearPath
from expresslane.models.layers import Linear

from .conftest import bf16_copy

kernels = cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no AVX2 CPU kernels here")


@needs_kernels
def test_the_modules_constants_are_the_python_enums():
    """The integers the module and Python share (kernels/constants.h) are kernels/constants.py's,
    and the stores and formats pass them."""
    from expresslane.kernels.constants import ExpertActivation, KVKind, ScaleKind
    from expresslane.models.kv_store import STORES
    from expresslane.quant.formats import MXFP4, NVFP4

    enums = (
        (KVKind, "KV_KIND_"),
        (ScaleKind, "SCALE_KIND_"),
        (ExpertActivation, "EXPERT_ACTIVATION_"),
    )
    for enum, prefix in enums:
        exported = {
            n.removeprefix(prefix): getattr(kernels, n)
            for n in dir(kernels)
            if n.startswith(prefix)
        }
        assert exported == {kind.name: kind.value for kind in enum}
    assert [store.NATIVE_KIND for store in STORES.values()] == list(KVKind)
    assert (MXFP4.kernel_scale_kind, NVFP4.kernel_scale_kind) == (ScaleKind.E8M0, ScaleKind.E4M3)


def _random_linear(m: int, n: int, k: int, bias: bool, dtype=torch.bfloat16):
    """x [m, k] float32, w [n, k] in `dtype` (bf16) and an optional bias, seeded by the shape."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(dtype)
    return x, w, torch.randn(n, generator=g) if bias else None


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13])
@pytest.mark.parametrize("n, k", [(64, 64), (131, 96), (37, 203)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_linear_matches_float32_reference(m, n, k, bias, dtype):
    """The row kernel over bf16 or float16 weights: the float32 matmul of the same values."""
    x, w, b = _random_linear(m, n, k, bias, dtype)
    ref = F.linear(x, w.float(), b)
    torch.testing.assert_close(kernels.half_linear(x, w, b), ref, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512", reason="batch invariance is AVX-512's"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_linear_rows_do_not_depend_on_the_batch(dtype):
    """Each output row is summed in the same order at any batch size: bit-identical alone and
    batched, so a speculative verification reproduces plain decoding exactly."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 229, generator=g)  # 229 = 3 * 64 + 2 * 16 + 5: every tail
    w = torch.randn(131, 229, generator=g).to(dtype)
    b = torch.randn(131, generator=g)
    alone = torch.cat([kernels.half_linear(x[i : i + 1], w, b) for i in range(16)])
    for m in (2, 3, 5, 8, 16):
        assert torch.equal(kernels.half_linear(x[:m], w, b), alone[:m])


def _dot_reference(x, w, b=None):
    """What the packed kernels compute: x rounded to bf16 against bf16 weights (the dot
    products) or as it is against float16 ones (widened exactly), exact products, float64 sums
    (the kernels sum in float32, hence the tolerances)."""
    xs = x.bfloat16() if w.dtype == torch.bfloat16 else x
    y = xs.double() @ w.double().T
    return (y if b is None else y + b.double()).float()


def _dot_kernel(dtype):
    """(pack, linear) of the packed kernel for bf16 (AVX-512 BF16 dot products) or float16
    (AVX-512 multiply-adds) weights; skips where this build lacks it."""
    if dtype == torch.bfloat16:
        if not kernels.bf16_dot_available():
            pytest.skip("no AVX-512 BF16 here")
        return kernels.pack_bf16_dot, kernels.bf16_dot_linear
    if not kernels.f16_dot_available():
        pytest.skip("no AVX-512 here")
    return kernels.pack_f16_dot, kernels.f16_dot_linear


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 17, 25])
@pytest.mark.parametrize("n, k", [(16, 1), (16, 2), (64, 64), (144, 96), (432, 202), (432, 203)])
@pytest.mark.parametrize("bias", [False, True])
def test_dot_linear_matches_reference(dtype, m, n, k, bias):
    """The packed kernels against what they compute (_dot_reference)."""
    pack, linear = _dot_kernel(dtype)
    if dtype == torch.bfloat16 and k % 2:
        pytest.skip("the bf16 layout holds pairs of k")
    x, w, b = _random_linear(m, n, k, bias, dtype)
    torch.testing.assert_close(linear(x, pack(w), b), _dot_reference(x, w, b), atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dot_linear_rows_do_not_depend_on_the_batch(dtype):
    """Every output of the packed kernels (bf16 dot products, float16 multiply-adds) is one
    chain over k in order, in whichever tile and row pass it falls: bit-identical alone and
    batched (speculative verification rows)."""
    pack, linear = _dot_kernel(dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(27, 202, generator=g)  # 202: a tail of 10 values after 6 * 32
    packed = pack(torch.randn(432, 202, generator=g).to(dtype))  # 27 blocks: partial tiles
    alone = torch.cat([linear(x[i : i + 1], packed, None) for i in range(27)])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 19, 25, 27):
        assert torch.equal(linear(x[:m], packed, None), alone[:m])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dot_linear_rejects_what_it_cannot_take(dtype):
    pack, linear = _dot_kernel(dtype)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        pack(torch.zeros(24, 8, dtype=dtype))
    packed = pack(torch.zeros(16, 8, dtype=dtype))
    with pytest.raises(RuntimeError, match="against W"):
        linear(torch.zeros(1, 6), packed, None)
    with pytest.raises(RuntimeError, match="aligned"):
        unaligned = torch.zeros(packed.numel() + 1, dtype=dtype)[1:].view(packed.shape)
        linear(torch.zeros(1, 8), unaligned, None)


@needs_kernels
def test_linear_runs_the_kernels_on_bf16_weights():
    """With AVX-512 BF16 every batch runs the dot-product kernel, and a row's result does
    not depend on the rows beside it; without, small batches run the row kernel."""
    w = torch.randn(96, 64).bfloat16()
    lin = Linear(w.clone(), torch.randn(96))
    bias = lin.bias.data.clone()
    lin.prepare_cpu(torch.float32)
    assert lin._half_kernel is not None
    dot = kernels.bf16_dot_available()  # then x is rounded to bf16
    assert lin.path is (LinearPath.BF16_DOT if dot else LinearPath.BF16_ROWS)
    assert lin.kernel_weights()[0].dim() == (3 if dot else 2)
    for m in (1, ROW_KERNEL_ROWS):
        x = torch.randn(m, 64)
        ref = _dot_reference(x, w, bias) if dot else F.linear(x, w.float(), bias)
        torch.testing.assert_close(lin(x), ref, atol=1e-4, rtol=1e-4)
    x = torch.randn(ROW_KERNEL_ROWS + 300, 64)
    if dot:
        torch.testing.assert_close(lin(x), _dot_reference(x, w, bias), atol=1e-4, rtol=1e-4)
        for rows in (slice(0, 1), slice(5, 22), slice(100, 316)):
            assert torch.equal(lin(x[rows]), lin(x)[rows])
    else:
        torch.testing.assert_close(lin(x), F.linear(x, w.float(), bias), atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("n", [1, 7, 16, 17, 100, 8192])
def test_argmax_rows_is_torch_argmax(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    x[1] = x[1].round()  # many ties: the first maximum wins
    x[2] = float("-inf")
    x[3, n // 2] = float("nan")  # a NaN counts as the maximum
    x[4, n - 1] = float("nan")
    x[5, n // 3] = x[5].max() + 1  # one clear winner
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(3, 2 * n, generator=g)[:, :n]  # rows strided
    assert torch.equal(kernels.argmax_rows(wide), wide.argmax(dim=-1))


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """What the integer path computes with: x rounded to int8 per 32 values (amax / 127)."""
    blocks = x.view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0))
    return (q * scale).view_as(x)


@needs_kernels
# K a multiple of 32: the integer path (K = 224: three pairs of 32-groups and one unpaired);
# NVFP4 with K = 80 (five 16-blocks): the float path
@pytest.mark.parametrize(
    ("fmt_name", "k"),
    [("nvfp4", 192), ("mxfp4", 192), ("nvfp4", 224), ("mxfp4", 224), ("nvfp4", 80)],
)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_fp4_linear_matches_dequantize_then_matmul(fmt_name, k, m, bias):
    from expresslane.quant.formats import FORMATS, quantize
    from expresslane.quant.linear import Fp4Linear, Fp4Weight

    fmt = FORMATS[fmt_name]
    g = torch.Generator().manual_seed(m)
    # per-row tensor scales; 131 rows: the kernel's passes of several rows leave a remainder
    parts = [quantize(torch.randn(n, k, generator=g) * 0.05, fmt) for n in (64, 32, 35)]
    weight = Fp4Weight.cat([Fp4Weight.from_tensor(p) for p in parts])
    b = torch.randn(131, generator=g) if bias else None
    layer = Fp4Linear(weight, b)
    layer.prepare_cpu(torch.float32)
    assert layer.kernel_weights() is not None
    x = torch.randn(m, k, generator=g)
    w = weight.dequantize()
    torch.testing.assert_close(layer.reference(x), F.linear(x, w, b))
    if k % 32 == 0:
        ref = F.linear(_int8_activations(x), w, b)
        torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-4)
        exact = F.linear(x, w, b)  # and the activation rounding costs little
        assert ((layer(x) - exact).norm() / exact.norm()) < 0.01
    else:
        torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("fmt_name", "k"), [("nvfp4", 192), ("mxfp4", 192), ("nvfp4", 80)])
def test_fp4_linear_runs_the_kernel_at_prompt_sizes_row_for_row(fmt_name, k):
    """Every batch runs the kernel (no expanded weight), and a row's output does not depend
    on the rows beside it: a prompt chunk's rows equal the same rows decoded."""
    from expresslane.quant.formats import FORMATS, quantize
    from expresslane.quant.linear import Fp4Linear, Fp4Weight

    fmt = FORMATS[fmt_name]
    g = torch.Generator().manual_seed(k)
    weight = Fp4Weight.from_tensor(quantize(torch.randn(96, k, generator=g) * 0.05, fmt))
    layer = Fp4Linear(weight, torch.randn(96, generator=g))
    layer.prepare_cpu(torch.float32)
    assert layer.path is LinearPath.FP4_W4A8
    x = torch.randn(300, k, generator=g)
    full = layer(x)
    for rows in (slice(0, 1), slice(3, 7), slice(5, 22), slice(100, 300)):
        assert torch.equal(layer(x[rows]), full[rows])
    ref = F.linear(_int8_activations(x) if k % 32 == 0 else x, weight.dequantize(), layer.bias)
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
def test_fp4_kernel_decodes_every_block_scale(fmt_name):
    """Rows and blocks spanning 2^-24..1 of the largest: NVFP4's E4M3 block scales reach the
    subnormal range (decoded separately in the kernel), MXFP4's E8M0 exponents spread wide.
    Each output feature is compared relative to its own magnitude."""
    from expresslane.quant.formats import FORMATS, quantize
    from expresslane.quant.linear import Fp4Linear, Fp4Weight

    fmt = FORMATS[fmt_name]
    g = torch.Generator().manual_seed(7)
    nb = 256 // fmt.block_size
    blocks = torch.randn(64, nb, fmt.block_size, generator=g)
    blocks *= 2.0 ** -torch.randint(0, 4, (64, nb, 1), generator=g).float()
    blocks *= 2.0 ** -torch.arange(64).float().view(64, 1, 1).remainder(25)  # whole rows
    weight = Fp4Weight.from_tensor(quantize(blocks.view(64, 256), fmt))
    s = weight.scales.int()
    assert ((s > 0) & (s < 8)).any() if fmt_name == "nvfp4" else s.max() - s.min() > 24
    layer = Fp4Linear(weight, None)
    layer.prepare_cpu(torch.float32)
    x = torch.randn(3, 256, generator=g)
    ref = F.linear(_int8_activations(x), weight.dequantize())
    out, size = layer(x), ref.abs().amax(0)
    assert (out[:, size == 0] == 0).all()  # rows whose every block scale underflowed
    assert ((out - ref).abs().amax(0)[size > 0] / size[size > 0]).max() < 1e-4


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, qkv bias, q/k norms
@pytest.mark.parametrize("q_len", [1, 3, 5])  # decode, speculative verifications
@pytest.mark.parametrize("kv_dtype", ["float32", "fp8", "fp4", "bfloat16"])
def test_native_decode_step_matches_the_python_layers(
    tmp_path, monkeypatch, checkpoints, arch, q_len, kv_dtype
):
    """The C++ decode step (fused norms, RoPE and paged attention, over a float32, bf16, FP8 or
    FP4 cache) against the Python layers, at the tensor level: sequences of different lengths in
    one padded batch. The Python layers attend in PyTorch (not the C++ decode attention)."""
    from types import SimpleNamespace

    from expresslane import LLM
    from expresslane.models import attention
    from expresslane.models.attention import AttentionMetadata

    monkeypatch.setattr(attention, "native_decode_attention", lambda q, kv: None)

    bf16_copy(checkpoints[arch], tmp_path)
    engine = LLM(str(tmp_path), kv_cache_dtype=kv_dtype).engine
    model, runner = engine.model, engine.runner
    assert model.layer_stack is not None
    assert engine.kv.num_blocks >= 30  # the three sequences below use blocks 0-29
    g = torch.Generator().manual_seed(q_len)
    hkv, d = model.cfg.num_kv_heads, model.cfg.head_dim
    for store in runner.kv_caches:  # a cache full of earlier tokens' keys and values
        n = runner.block_size * 30
        k, v = (torch.randn(n, hkv, d, generator=g) for _ in range(2))
        store.write(k, v, torch.arange(n))
    seqs = [
        SimpleNamespace(
            num_computed_tokens=n, num_prompt_tokens=1, block_ids=[10 * i + j for j in range(10)]
        )
        for i, n in enumerate([5, 37, 18])
    ]
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
    runner._decode_metadata(meta, seqs, q_len)
    positions = torch.tensor([s.num_computed_tokens + j for s in seqs for j in range(q_len)])
    new = [runner.slots(s, s.num_computed_tokens, s.num_computed_tokens + q_len) for s in seqs]
    meta.slot_mapping = torch.from_numpy(np.concatenate(new))
    x = torch.randn(len(seqs) * q_len, model.cfg.hidden_size, generator=g)
    cos, sin = model.rotary.tables(positions)
    ref = x
    with torch.inference_mode():
        for layer in model.layers:
            ref = layer(ref, cos, sin, meta)
        written = [
            [t[:, :, meta.slot_mapping].clone() for t in s.native()] for s in runner.kv_caches
        ]
        out = model.layer_stack.forward(
            x,
            cos,
            sin,
            meta.slot_mapping,
            meta.decode_slots,
            meta.decode_ctx,
            torch.full((len(seqs),), q_len),
            meta.decode_starts,
            torch.zeros(len(seqs), dtype=torch.long),  # no prompt rows
        )
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    # the final norm and output head, for some rows and for all
    assert model.plan.native_head
    rows = torch.tensor([0, len(seqs) * q_len - 1])
    with torch.inference_mode():
        expected = model.lm_head(model.norm(ref)).float()
        torch.testing.assert_close(
            model.layer_stack.logits(out.clone(), rows), expected[rows], atol=2e-4, rtol=2e-4
        )
        torch.testing.assert_close(
            model.layer_stack.logits(out.clone(), None), expected, atol=2e-4, rtol=2e-4
        )
    # the new tokens' K/V as the native step stored them: the store's own encoding (a rare
    # byte may differ where the two paths' float K/V straddle a rounding boundary; the same
    # floats encode byte for byte: tests/test_kv_store.py)
    for store, python_written in zip(runner.kv_caches, written, strict=True):
        for mine, theirs in zip(store.native(), python_written, strict=True):
            mine = mine[:, :, meta.slot_mapping]
            if mine.dtype in (torch.uint8, torch.bfloat16):
                assert (mine != theirs).float().mean() <= 0.01
            else:
                torch.testing.assert_close(mine.float(), theirs.float(), atol=1e-4, rtol=1e-3)


@needs_kernels
@pytest.mark.parametrize(
    ("arch", "quantization"), [("llama", None), ("qwen3", None), ("llama", "nvfp4")]
)
def test_native_step_runs_prompt_chunks_beside_decodes_as_the_python_layers(
    tmp_path, monkeypatch, checkpoints, arch, quantization
):
    """A ragged step through the C++ step: two decodes, a whole prompt of 20 tokens and a
    12-token chunk after 30 cached ones whose last 6 rows are past its prompt, against the
    Python layers (SDPA for the chunks), with bf16 or FP4 linears: the prompt rows run the
    tiled kernel (float32 products; bf16 ones, where built, within 5e-2), the rest the decode
    kernel."""
    from types import SimpleNamespace

    from expresslane import LLM
    from expresslane.models import attention
    from expresslane.models.attention import AttentionMetadata, PrefillChunk

    monkeypatch.setattr(attention, "native_decode_attention", lambda q, kv: None)
    bf16_copy(checkpoints[arch], tmp_path)
    engine = LLM(str(tmp_path), quantization=quantization, kv_cache_dtype="float32").engine
    monkeypatch.setattr(attention, "native_prompt_attention", lambda q, kv: None)  # SDPA
    model, runner = engine.model, engine.runner
    assert model.plan.tiled_prompts
    assert model.layer_stack is not None and engine.kv.num_blocks >= 40
    g = torch.Generator().manual_seed(5)
    hkv, d = model.cfg.num_kv_heads, model.cfg.head_dim
    for store in runner.kv_caches:  # earlier tokens' keys and values, the cached prefix too
        n = runner.block_size * 40
        store.write(*(torch.randn(n, hkv, d, generator=g) for _ in range(2)), torch.arange(n))
    seq = [
        SimpleNamespace(block_ids=[10 * i + j for j in range(10)], num_prompt_tokens=1)
        for i in range(4)
    ]
    decodes = [(seq[0], 5), (seq[1], 37)]  # (request, tokens cached)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
    for s_, cached in decodes:
        s_.num_computed_tokens = cached
    runner._decode_metadata(meta, [s_ for s_, _ in decodes], 1)
    spans = [(seq[0], 5, 6), (seq[1], 37, 38), (seq[2], 0, 20), (seq[3], 30, 42)]
    slots = [runner.slots(s_, a, b) for s_, a, b in spans]
    meta.slot_mapping = torch.from_numpy(np.concatenate(slots))
    meta.prefills = [
        PrefillChunk(2, 20, 20, None, prompt_end=20),
        PrefillChunk(22, 12, 42, torch.from_numpy(runner.slots(seq[3], 0, 42)), prompt_end=36),
    ]
    positions = torch.cat([torch.arange(a, b) for _, a, b in spans])
    x = torch.randn(len(positions), model.cfg.hidden_size, generator=g)
    cos, sin = model.rotary.tables(positions)
    with torch.inference_mode():
        ref = x
        for layer in model.layers:
            ref = layer(ref, cos, sin, meta)
        q_lens, starts, table, ctx, ends = meta.sequences()
        assert q_lens.tolist() == [1, 1, 20, 12] and starts.tolist() == [5, 37, 0, 30]
        assert ends.tolist() == [1, 1, 20, 36]
        products = [False] + [True] * bool(model.plan.bf16_prompts)
        for bf16 in products:  # float32 products, and bf16 ones where the plan takes them
            model.layer_stack.set_prompt_attention(True, bf16)
            out = model.layer_stack.forward(
                x, cos, sin, meta.slot_mapping, table, ctx, q_lens, starts, ends
            )
            tol = 5e-2 if bf16 else 2e-4
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("d", [32, 64, 128, 48])
def test_bf16_rows_attend_exactly_as_their_float32_values(d):
    """A bf16 cache is read where it lies (widened in registers; head sizes without such a
    kernel are widened into a buffer first): every output bit for bit what the float32 cache
    of the same values gives."""
    from expresslane.models.kv_store import Bf16KV

    g = torch.Generator().manual_seed(d)
    heads, kv_heads, n, q_len = 6, 2, 400, 3
    store = Bf16KV(kv_heads, n, d, torch.float32, "cpu")
    store.write(*(torch.randn(n, kv_heads, d, generator=g) for _ in range(2)), torch.arange(n))
    plain = store.tensor.float()
    slots = torch.randperm(n, generator=g)[:300]
    q = torch.randn(2 * q_len, heads, d, generator=g)
    starts = torch.tensor([120, 297])
    slots = torch.cat([slots, slots.flip(0)])
    args = (slots, 300, q_len, starts)
    widened = kernels.decode_attention(q, [plain], 0, *args)
    assert torch.equal(
        kernels.decode_attention(q, store.native(), store.NATIVE_KIND, *args), widened
    )


@needs_kernels
@pytest.mark.parametrize("store_name", ["PlainKV", "Bf16KV", "Fp8KV", "Fp4KV"])
@pytest.mark.parametrize("q_len", [1, 4, 13])
def test_decode_attention_matches_the_torch_path(store_name, q_len):
    """The C++ decode attention the Python layers use for batches past the native step's
    (kernels.decode_attention) against the padded gather + matmul path: 12 sequences of
    different lengths over scattered blocks, GQA 6/2, plain or compressed KV."""
    from types import SimpleNamespace

    from expresslane.engine.runner import ModelRunner
    from expresslane.models import kv_store
    from expresslane.models.attention import AttentionMetadata, PagedAttention

    g = torch.Generator().manual_seed(q_len)
    block, heads, kv_heads, d = 16, 6, 2, 64
    store = getattr(kv_store, store_name)(kv_heads, 64 * block, d, torch.float32, "cpu")
    n = 64 * block
    store.write(*(torch.randn(n, kv_heads, d, generator=g) for _ in range(2)), torch.arange(n))
    perm = torch.randperm(64, generator=g).tolist()
    lens = torch.randint(1, 60, (12,), generator=g).tolist()
    seqs = [
        SimpleNamespace(
            num_computed_tokens=c, num_prompt_tokens=1, block_ids=perm[5 * i : 5 * i + 5]
        )
        for i, c in enumerate(lens)
    ]
    runner = SimpleNamespace(block_size=block, device="cpu", dtype=torch.float32)
    runner.padded_slots = lambda reqs, length: ModelRunner.padded_slots(runner, reqs, length)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
    ModelRunner._decode_metadata(runner, meta, seqs, q_len)
    attn = PagedAttention(heads, kv_heads, d)
    attn.kv = store
    q = torch.randn(len(seqs) * q_len, heads, d, generator=g)
    mine = kernels.decode_attention(
        q,
        store.native(),
        store.NATIVE_KIND,
        meta.decode_slots,
        meta.decode_ctx,
        q_len,
        meta.decode_starts,
    )
    torch.testing.assert_close(mine, attn._decode_torch(q, meta), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(attn._decode(q, meta), mine, atol=0, rtol=0)  # it is used


@needs_kernels
@pytest.mark.parametrize("store_name", ["PlainKV", "Bf16KV", "Fp8KV", "Fp4KV"])
@pytest.mark.parametrize("q_len", [1, 5])
def test_long_rows_attend_in_segments_as_the_reference(store_name, q_len):
    """Rows seeing more than a key segment (1,024 positions of a float32 or bf16 cache, 256 of
    an FP8 or FP4 one) attend segment by segment and merge: against float64 softmax(q k /
    sqrt(D)) v over the store's own values, at contexts on both sides of segment boundaries
    (a verification's rows straddling one)."""
    from expresslane.models import kv_store

    g = torch.Generator().manual_seed(q_len)
    heads, kv_heads, d, n = 6, 2, 64, 3200
    store = getattr(kv_store, store_name)(kv_heads, n, d, torch.float32, "cpu")
    store.write(*(torch.randn(n, kv_heads, d, generator=g) for _ in range(2)), torch.arange(n))
    starts = torch.tensor([100, 254, 1020, 1023, 1024, 2046, 3100])
    length = int(starts.max()) + q_len
    slots = torch.stack([torch.randperm(n, generator=g)[:length] for _ in starts])
    q = torch.randn(len(starts) * q_len, heads, d, generator=g)
    mine = kernels.decode_attention(
        q, store.native(), store.NATIVE_KIND, slots.view(-1), length, q_len, starts
    )
    for b, start in enumerate(starts.tolist()):
        for j in range(q_len):
            kv = store.read(slots[b, : start + j + 1]).double()  # [2, Hkv, n, D]
            k, v = (x.repeat_interleave(heads // kv_heads, 0) for x in kv)
            row = q[b * q_len + j].double()  # [H, D]
            w = torch.softmax((k @ row.unsqueeze(-1)).squeeze(-1) / d**0.5, -1)
            want = (w.unsqueeze(1) @ v).squeeze(1).reshape(-1)
            torch.testing.assert_close(mine[b * q_len + j].double(), want, atol=1e-5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("store_name", ["Fp8KV", "Fp4KV"])
def test_compressed_rows_widen_exactly_as_the_store_reads_them(store_name):
    """Every FP8 byte (the NaN codes too) and every FP4 code with scales from subnormal to
    large, as the decode attention reads them in place (FP8) or widens them (FP4, and both in
    the prompt attention's tiles), is bit for bit the store's own read: a query that sees one
    key returns that key's value row as it is."""
    from expresslane.models import kv_store

    g = torch.Generator().manual_seed(0)
    d, n = 64, 8
    store = getattr(kv_store, store_name)(1, n, d, torch.float32, "cpu")
    if store_name == "Fp8KV":
        store.values[1] = torch.arange(256, dtype=torch.uint8).view(4, d).repeat(2, 1)
        scales = torch.tensor([2**-24, 1e-3, 0.37, 1.0, 3.5, 448.0, 6e4, 2**-14])
        store.scales[1] = scales[:, None].half()
    else:
        store.codes[1] = torch.randint(0, 256, (n, d // 2), generator=g, dtype=torch.uint8)
        store.codes[1, 0, 0, :16] = torch.arange(16, dtype=torch.uint8) * 17  # each code twice
        store.scales[1] = torch.randint(0, 127, (n, d // 16), generator=g, dtype=torch.uint8)
    want = store.read(torch.arange(n))[1, 0]  # [n, D]
    q = torch.randn(1, 1, d, generator=g)
    kv, kind, first = store.native(), store.NATIVE_KIND, torch.tensor([0])
    for slot in range(n):
        at = torch.tensor([slot])
        decoded = kernels.decode_attention(q, kv, kind, at, 1, 1, first)
        prompted = kernels.prompt_attention(q, kv, kind, at, 1, torch.tensor([1]), first, False)
        for row in (decoded, prompted):
            torch.testing.assert_close(row[0], want[slot], atol=0, rtol=0, equal_nan=True)


def test_a_killed_builds_lock_is_cleared_and_a_live_build_waited_for(tmp_path):
    """torch's extension build waits for its lock file to vanish; one left by a killed build
    would make every later start hang without a word. A live build holds the OS lock: a
    second start waits for it instead of taking its lock file away."""
    import subprocess
    import sys

    from expresslane.kernels import exclusive_build

    lock = tmp_path / "lock"
    lock.touch()  # left by a build that was killed
    with exclusive_build(tmp_path):
        assert not lock.exists()
    builder = f"""
import fcntl, pathlib, sys
d = pathlib.Path({str(tmp_path)!r})
with open(d / "expresslane.lock", "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    (d / "lock").touch()
    print("building", flush=True)
    sys.stdin.readline()  # until the test has tried to enter
    (d / "lock").unlink()
    (d / "built").touch()
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", builder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "building\n"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    with exclusive_build(tmp_path):  # waits for the live build, does not remove its lock
        assert (tmp_path / "built").exists()
    assert proc.wait() == 0


def test_a_kernel_build_reports_its_progress(caplog):
    """A first start is never silent: an estimate, lines while it runs, one when done."""
    import time

    from expresslane.kernels import _progress

    with caplog.at_level("INFO", logger="expresslane.kernels"):
        with _progress("compiling the test kernels", True, every=0.05):
            time.sleep(0.2)
        with _progress("compiling nothing", False):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("compiling the test kernels: once per machine")
    assert any(line.startswith("still compiling") for line in lines[1:-1])
    assert lines[-1].startswith("CPU kernels compiled in")
    assert not any("nothing" in line for line in lines)


@needs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 1, 128), (6, 2, 32)])
@pytest.mark.parametrize("kind", ["float32", "bf16"])
def test_a_decode_row_attends_the_same_alone_and_in_a_batch(heads, kv_heads, d, kind):
    """A sequence decoded alone attends exactly as inside a batch, whatever work items and
    threads its rows fall to (greedy tokens do not depend on the batch)."""
    from expresslane.kernels.constants import KVKind

    g = torch.Generator().manual_seed(heads * d)
    slots_total, length = 3000, 2500
    cache = torch.randn(2, kv_heads, slots_total, d, generator=g)
    native = [cache] if kind == "float32" else [cache.bfloat16()]
    kind_id = 0 if kind == "float32" else int(KVKind.BF16)
    batch = 4 * torch.get_num_threads() + 1
    slots = torch.stack([torch.randperm(slots_total, generator=g)[:length] for _ in range(batch)])
    starts = torch.randint(1000, length, (batch,), generator=g)
    q = torch.randn(batch, heads, d, generator=g)
    together = kernels.decode_attention(q, native, kind_id, slots.view(-1), length, 1, starts)
    for b in range(batch):
        alone = kernels.decode_attention(
            q[b : b + 1], native, kind_id, slots[b], length, 1, starts[b : b + 1]
        )
        assert torch.equal(together[b], alone[0]), b


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"), [(6, 2, 64), (4, 2, 32), (4, 1, 128), (3, 3, 64)]
)
@pytest.mark.parametrize("kind", ["float32", "bf16"])
def test_verification_rows_attend_bit_identically_to_decode_rows(heads, kv_heads, d, kind):
    """A verification's query rows (scored and weighed in groups that share key and value
    loads) give exactly what each gives decoded alone: greedy output with speculation
    depends on it."""
    from expresslane.kernels.constants import KVKind

    g = torch.Generator().manual_seed(d + heads)
    slots_total = 2100
    cache = torch.randn(2, kv_heads, slots_total, d, generator=g)
    kind_id = 0 if kind == "float32" else int(KVKind.BF16)
    native = [cache] if kind == "float32" else [cache.bfloat16()]
    for start in (0, 7, 8, 15, 16, 200, 333, 1019, 1024, 2046):  # and past key segments
        for q_len in (1, 2, 3, 5, 9, 13):
            slots = torch.randperm(slots_total, generator=g)[: start + q_len]
            q = torch.randn(q_len, heads, d, generator=g)
            length = start + q_len
            together = kernels.decode_attention(
                q, native, kind_id, slots, length, q_len, torch.tensor([start])
            )
            for j in range(q_len):
                alone = kernels.decode_attention(
                    q[j : j + 1], native, kind_id, slots, length, 1, torch.tensor([start + j])
                )
                assert torch.equal(together[j], alone[0]), (start, q_len, j)
