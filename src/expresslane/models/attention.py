"""Attention over the paged KV cache, in plain PyTorch (runs on CPU and CUDA).

A step's tokens are flattened into one [T, ...] batch. The first `num_decode_tokens` belong to
"uniform" sequences that each bring `decode_q_len` new tokens (1 for plain decode, k+1 for
speculative verification). Where the native CPU kernels run, a C++ loop attends them over
the paged cache in place (at batch 64, 2.4 against 6.3 ms per layer); elsewhere they are
gathered into one padded batch for a grouped `bmm`, which on CPU is 8-15x faster than SDPA
for a single query. The remaining tokens are prefill chunks, attended one sequence at a time:
their prompt rows by the C++ tiled kernel (kernels/prompt_attention.h) where it is built,
else with SDPA.

The KV cache of one layer is a store (models/kv_store.py: plain, FP8 or FP4) addressed by slot =
block id * block_size + offset. Every sequence's slots are precomputed once per step by the
runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # index of the chunk's first token in the flattened batch
    length: int  # tokens in this chunk
    context_len: int  # tokens in the sequence after this chunk (cached prefix included)
    slots: (
        torch.Tensor | None
    )  # [context_len] slots to read, None if the chunk is the whole context
    prompt_end: int = 0  # positions before it are the sequence's prompt (tiled attention)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    num_decode_tokens: int = 0
    decode_q_len: int = 1
    decode_batch: int = 0
    decode_slots: torch.Tensor | None = None  # [decode_batch * decode_ctx] flat, padded
    decode_ctx: int = 0  # padded context length of the decode batch
    decode_starts: torch.Tensor | None = None  # [decode_batch] cached tokens before this step
    decode_prompt_ends: torch.Tensor | None = None  # [decode_batch] prompt lengths (None: 0)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # the decode masks built this step, by sliding window (None: the whole context), and
    # what `per_step` keeps
    _decode_masks: dict = field(default_factory=dict, repr=False)

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """Every sequence of the step in row order, the uniform group and the prompt chunks
        alike (the layer stack's view): (new tokens [B], tokens cached before [B], padded
        slots of positions 0..ctx-1 [B * ctx], ctx, prompt ends [B])."""
        B, Q = self.decode_batch, self.decode_q_len
        decode_ends = self.decode_prompt_ends
        if decode_ends is None:
            decode_ends = torch.zeros(B, dtype=torch.long)
        if not self.prefills:
            q_lens = torch.full((B,), Q, dtype=torch.long)
            return q_lens, self.decode_starts, self.decode_slots, self.decode_ctx, decode_ends
        q_lens, starts, tables, ends = [Q] * B, [], [], [decode_ends.cpu()]
        if B:
            starts.append(self.decode_starts.cpu())
            tables += list(self.decode_slots.view(B, self.decode_ctx))
        for c in self.prefills:
            own = self.slot_mapping[c.start : c.start + c.length]
            tables.append(own if c.slots is None else c.slots)
            q_lens.append(c.length)
            starts.append(torch.tensor([c.context_len - c.length]))
            ends.append(torch.tensor([c.prompt_end]))
        ctx = max(len(t) for t in tables)
        slots = self.slot_mapping.new_zeros(len(tables), ctx)  # slot 0 past the end: masked
        for row, table in zip(slots, tables, strict=True):
            row[: len(table)] = table
        return torch.tensor(q_lens), torch.cat(starts), slots.view(-1), ctx, torch.cat(ends)

    def clear_mask(self) -> None:
        """Build the decode mask again on next use (metadata reused across steps, as a
        decode graph's static inputs are)."""
        self._decode_masks.clear()

    def per_step(self, key, build):
        """`build()`, called once per step for `key` and kept beside the decode masks (a
        layer kind's own view of the decode batch)."""
        if key not in self._decode_masks:
            self._decode_masks[key] = build()
        return self._decode_masks[key]

    def decode_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """[decode_batch, q_len, 1, decode_ctx] additive mask: query j of sequence b sits at
        position starts[b] + j and sees the positions up to there (within a sliding `window`:
        the last `window` of them). Built on first use, once per step and window (the C++
        layer stack never needs it)."""
        if window not in self._decode_masks:
            starts = self.decode_starts
            dev = starts.device
            last = starts[:, None] + torch.arange(self.decode_q_len, device=dev)[None, :]
            kv = torch.arange(self.decode_ctx, device=dev)[None, None, :]
            hidden = kv > last[..., None]
            if window is not None:
                hidden |= kv <= last[..., None] - window
            mask = torch.zeros(*hidden.shape, dtype=dtype, device=dev)
            self._decode_masks[window] = mask.masked_fill_(hidden, float("-inf")).unsqueeze(2)
        return self._decode_masks[window]


def native_decode_attention(q: torch.Tensor, kv_tensors: list[torch.Tensor] | None):
    """The C++ decode attention (kernels/layer_stack_cpu.cpp) where it can serve this call: CPU,
    float32, and a KV store it reads (`kv_tensors`: the store's native(), None if it has
    none); else None."""
    if q.is_cuda or q.dtype != torch.float32 or q.shape[-1] % 8 or kv_tensors is None:
        return None
    from expresslane.kernels import cpu_kernels

    kernels = cpu_kernels()
    return None if kernels is None else kernels.decode_attention


def native_prompt_attention(q: torch.Tensor, kv_tensors: list[torch.Tensor] | None):
    """The C++ tiled prompt attention (kernels/prompt_attention.h) where it can serve this
    call: CPU, float32, head_dim a multiple of 16, a KV store it reads; else None."""
    if q.is_cuda or q.dtype != torch.float32 or q.shape[-1] % 16 or kv_tensors is None:
        return None
    from expresslane.kernels import cpu_kernels

    kernels = cpu_kernels()
    return kernels


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None = None):
        """`window`: a sliding-window layer's, each query sees the last `window` positions up
        to its own (the C++ kernels attend to the whole context: such layers run in PyTorch)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.window = window
        self.kv = None  # a store from models/kv_store.py, bound by the runner
        self.bf16_prompts = False  # the tiled kernel's products in bf16 (the model's plan)

    def tiled_prompts(self, dtype: torch.dtype) -> bool:
        """Whether prompt rows take the tiled kernel with this KV store and compute dtype."""
        kv = self.kv.native()
        if kv is None or self.window is not None:
            return False
        probe = torch.empty(1, self.num_heads, self.head_dim, dtype=dtype, device=kv[0].device)
        return native_prompt_attention(probe, kv) is not None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        """q: [T, H, D]; k, v: [T, Hkv, D]. Returns [T, H * D]."""
        self.kv.write(k, v, meta.slot_mapping)
        n_dec = meta.num_decode_tokens
        if not meta.prefills:
            return self._decode(q, meta)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if n_dec:
            out[:n_dec] = self._decode(q[:n_dec], meta)
        kernels = self._prompt_kernels(q)
        for chunk in meta.prefills:
            s, e = chunk.start, chunk.start + chunk.length
            if kernels is not None:
                slots = meta.slot_mapping[s:e] if chunk.slots is None else chunk.slots
                out[s:e] = self._prefill_native(kernels, q[s:e], slots, chunk)
            else:
                out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], chunk)
        return out

    def _prompt_kernels(self, q: torch.Tensor):
        """The C++ kernels prompt rows take, or None: PyTorch (`_prefill`)."""
        return None if self.window else native_prompt_attention(q, self.kv.native())

    def _prefill_native(self, kernels, q, slots: torch.Tensor, chunk: PrefillChunk):
        """A chunk's prompt rows in the tiled kernel, its other rows (generated tokens
        recomputed after a preemption, guesses) in the decode kernel: each row takes the
        kernel its position calls for, as in the C++ layer stack (kernels/step_attention.h)."""
        n, ctx = chunk.length, chunk.context_len
        start = ctx - n
        split = min(max(chunk.prompt_end - start, 0), n)
        kv, kind = self.kv.native(), self.kv.NATIVE_KIND
        if split == n:
            lens, starts = torch.tensor([n]), torch.tensor([start])
            return kernels.prompt_attention(
                q, kv, kind, slots, ctx, lens, starts, self.bf16_prompts
            )
        rest = kernels.decode_attention(
            q[split:], kv, kind, slots, ctx, n - split, torch.tensor([start + split])
        )
        if split == 0:
            return rest
        lens, starts = torch.tensor([split]), torch.tensor([start])
        head = kernels.prompt_attention(
            q[:split], kv, kind, slots, ctx, lens, starts, self.bf16_prompts
        )
        return torch.cat([head, rest])

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kv = self.kv.native()
        native = None if self.window else native_decode_attention(q, kv)
        if native is not None:  # reads the paged cache in place, no padded gather
            L, Q, kind = meta.decode_ctx, meta.decode_q_len, self.kv.NATIVE_KIND
            return native(q, kv, kind, meta.decode_slots, L, Q, meta.decode_starts)
        return self._decode_torch(q, meta)

    def _decode_torch(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B, Q, L = meta.decode_batch, meta.decode_q_len, meta.decode_ctx
        Hkv, G, D = self.num_kv_heads, self.group, self.head_dim
        kv = self.kv.read(meta.decode_slots).view(2, Hkv, B, L, D)
        # [B*Q, H, D] -> [Hkv, B, Q*G, D]: one matmul batch entry per (kv head, sequence)
        qg = q.view(B, Q, Hkv, G, D).permute(2, 0, 1, 3, 4).reshape(Hkv, B, Q * G, D)
        scores = torch.matmul(qg, kv[0].transpose(-1, -2))
        mask = meta.decode_mask(scores.dtype, self.window)
        scores = scores.view(Hkv, B, Q, G, L).add_(mask).view(Hkv, B, Q * G, L)
        probs = torch.softmax(scores * self.scale, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, kv[1])  # [Hkv, B, Q*G, D]
        return out.view(Hkv, B, Q, G, D).permute(1, 2, 0, 3, 4).reshape(B * Q, Hkv * G * D)

    def _prefill(self, q, k, v, chunk: PrefillChunk) -> torch.Tensor:
        n = chunk.length
        if chunk.slots is None:
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            kv = self.kv.read(chunk.slots)
            keys, values, causal = kv[0], kv[1], False
        if not causal or self.window is not None:
            offset = chunk.context_len - n
            q_pos = torch.arange(n, device=q.device).unsqueeze(1) + offset
            kv_pos = torch.arange(chunk.context_len, device=q.device).unsqueeze(0)
            mask = kv_pos <= q_pos
            if self.window is not None:
                mask &= kv_pos > q_pos - self.window
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
