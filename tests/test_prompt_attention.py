"""The tiled prompt attention (kernels/prompt_attention.h) against SDPA over the gathered
cache, for every KV store, and row for row the same however a prompt is cut into chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expresslane.kernels import cpu_kernels
from expresslane.models import kv_store

kernels = cpu_kernels()
needs_tiles = pytest.mark.skipif(kernels is None, reason="no CPU kernels here")


def _reference(q, store, slots, start):
    """SDPA (float64) of one chunk of q [n, H, D] at positions start.. over slots[: start + n]."""
    n, heads, d = q.shape
    kv = store.read(slots[: start + n]).double()
    group = heads // kv.shape[1]
    keys, values = (t.repeat_interleave(group, dim=0) for t in kv)
    seen = torch.arange(start + n)[None, :] <= (torch.arange(n)[:, None] + start)
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), keys, values, attn_mask=seen, scale=d**-0.5
    )
    return out.transpose(0, 1).reshape(n, heads * d).float()


def _store(name, kv_heads, d, n, g):
    store = getattr(kv_store, name)(kv_heads, n, d, torch.float32, "cpu")
    store.write(*(torch.randn(n, kv_heads, d, generator=g) for _ in range(2)), torch.arange(n))
    return store


BF16 = kernels is not None and kernels.bf16_dot_available()
PRODUCTS = [False, pytest.param(True, marks=pytest.mark.skipif(not BF16, reason="no AVX-512 BF16"))]


def _attend(q, store, chunks, slots, bf16=False):
    """Chunks [(start, length)] of sequences over the same slots, in one call."""
    L = max(s + n for s, n in chunks)
    table = torch.cat([slots[:L]] * len(chunks))
    return kernels.prompt_attention(
        q,
        store.native(),
        store.NATIVE_KIND,
        table,
        L,
        torch.tensor([n for _, n in chunks]),
        torch.tensor([s for s, _ in chunks]),
        bf16,
    )


@needs_tiles
@pytest.mark.parametrize("bf16", PRODUCTS, ids=["float32", "bf16"])
@pytest.mark.parametrize("store_name", ["PlainKV", "Bf16KV", "Fp8KV", "Fp4KV"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"), [(8, 2, 64), (4, 1, 128), (3, 3, 32), (6, 2, 16)]
)
def test_prompt_attention_matches_sdpa(store_name, heads, kv_heads, d, bf16):
    """Chunks of 1 to 150 rows after 0 to 300 cached positions, over scattered slots: within
    1e-5 of SDPA in float64 on the same (dequantized) cache; with bf16 products (queries, keys,
    probabilities and values rounded to bf16, sums in float32) within 1.5e-2."""
    g = torch.Generator().manual_seed(d + heads)
    n_slots = 1024
    store = _store(store_name, kv_heads, d, n_slots, g)
    slots = torch.randperm(n_slots, generator=g)
    chunks = [(0, 1), (0, 37), (5, 1), (31, 33), (64, 150), (300, 17)]
    q = torch.randn(sum(n for _, n in chunks), heads, d, generator=g)
    mine = _attend(q, store, chunks, slots, bf16)
    tol = dict(atol=1.5e-2, rtol=1e-2) if bf16 else dict(atol=1e-5, rtol=1e-4)
    row = 0
    for start, n in chunks:
        ref = _reference(q[row : row + n], store, slots, start)
        torch.testing.assert_close(mine[row : row + n], ref, **tol)
        row += n


@needs_tiles
@pytest.mark.parametrize("bf16", PRODUCTS, ids=["float32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(8, 2, 64), (5, 5, 32)])
def test_a_rows_result_does_not_depend_on_the_chunking(heads, kv_heads, d, bf16):
    """A 200-token prompt attended whole, in chunks of 1, 7 and 64, and row by row beside
    other sequences: every row bit for bit the same."""
    g = torch.Generator().manual_seed(heads)
    store = _store("PlainKV", kv_heads, d, 512, g)
    slots = torch.randperm(512, generator=g)
    n = 200
    q = torch.randn(n, heads, d, generator=g)
    whole = _attend(q, store, [(0, n)], slots, bf16)
    for size in (1, 7, 64):
        parts = [
            _attend(q[s : s + size], store, [(s, min(size, n - s))], slots, bf16)
            for s in range(0, n, size)
        ]
        assert torch.equal(torch.cat(parts), whole), size
    other = torch.randn(30, heads, d, generator=g)
    mixed = _attend(torch.cat([other, q[150:170]]), store, [(3, 30), (150, 20)], slots, bf16)
    assert torch.equal(mixed[30:], whole[150:170])
