"""Paged attention with sinks (gpt-oss): a learned logit per head that joins every query's
softmax denominator and attends to no position, so a query may give little weight to all of
them: p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)).

SDPA and the C++ attention kernels have no such term, so these layers attend in PyTorch:
grouped matmuls (one per KV head and sequence) and a float32 softmax over the scores and the
sink, for decodes (the padded batch the plain decode path gathers) and for prompt chunks (a
batch of one whose query rows are the chunk's tokens, in tiles of `QUERY_TILE` rows so that
the scores of a long prompt stay bounded). A sliding-window layer reads only the positions
its queries' windows cover, not the whole context.
"""

from __future__ import annotations

import torch

from expresslane.models.attention import AttentionMetadata, PagedAttention, PrefillChunk

QUERY_TILE = 256


class SinkAttention(PagedAttention):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        window: int | None,
        sinks: torch.Tensor,
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, window)
        self.register_buffer("sinks", sinks, persistent=False)  # [num_heads]

    def tiled_prompts(self, dtype: torch.dtype) -> bool:
        return False

    def _prompt_kernels(self, q: torch.Tensor):
        return None

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B, Q, L = meta.decode_batch, meta.decode_q_len, meta.decode_ctx
        if self.window is None:
            slots, mask = meta.decode_slots, meta.decode_mask(q.dtype)  # mask [B, Q, 1, L]
        else:
            slots, mask = _window_decode(meta, self.window, q.dtype)
            L = mask.shape[-1]
        kv = self.kv.read(slots).view(2, self.num_kv_heads, B, L, self.head_dim)
        return self._attend(q.view(B, Q, self.num_heads, self.head_dim), kv[0], kv[1], mask)

    def _prefill(self, q, k, v, chunk: PrefillChunk) -> torch.Tensor:
        n, ctx = chunk.length, chunk.context_len
        first = 0  # keys before it are outside every query's window
        if self.window is not None:
            first = max(0, ctx - n - self.window + 1)
        if chunk.slots is None:  # the chunk is the whole context
            keys, values = k[first:].transpose(0, 1), v[first:].transpose(0, 1)
        else:
            keys, values = self.kv.read(chunk.slots[first:])
        q_pos = torch.arange(n, device=q.device)[:, None] + (ctx - n)
        kv_pos = torch.arange(first, ctx, device=q.device)[None, :]
        mask = _additive(_hidden(kv_pos, q_pos, self.window), q.dtype)
        H, D = self.num_heads, self.head_dim
        return self._attend(
            q.view(1, n, H, D), keys.unsqueeze(1), values.unsqueeze(1), mask[None, :, None]
        )

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        """q [B, Q, H, D]; keys, values [Hkv, B, L, D]; mask [B, Q, 1, L] (additive).
        Returns [B * Q, H * D]."""
        B, Q, H, D = q.shape
        out = q.new_empty(B, Q, H * D)
        for s in range(0, Q, QUERY_TILE):
            e = min(s + QUERY_TILE, Q)
            out[:, s:e] = self._attend_tile(q[:, s:e], keys, values, mask[:, s:e])
        return out.view(B * Q, H * D)

    def _attend_tile(self, q, keys, values, mask) -> torch.Tensor:
        B, Q, H, D = q.shape
        Hkv, G, L = self.num_kv_heads, self.group, keys.shape[2]
        # one matmul batch entry per (kv head, sequence), its rows (query, head in group)
        qg = q.reshape(B, Q, Hkv, G, D).permute(2, 0, 1, 3, 4).reshape(Hkv, B, Q * G, D)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(self.scale)
        scores = scores.view(Hkv, B, Q, G, L).add_(mask)
        sinks = self.sinks.to(scores.dtype).view(Hkv, 1, 1, G, 1).expand(Hkv, B, Q, G, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1, dtype=torch.float32)[..., :L]
        out = torch.matmul(probs.to(q.dtype).reshape(Hkv, B, Q * G, L), values)
        return out.view(Hkv, B, Q, G, D).permute(1, 2, 0, 3, 4).reshape(B, Q, H * D)


def _hidden(kv_pos: torch.Tensor, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query does not see: later ones, and those past its window."""
    hidden = kv_pos > q_pos
    if window is not None:
        hidden |= kv_pos <= q_pos - window
    return hidden


def _additive(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
        hidden, -torch.inf
    )


def _window_decode(meta: AttentionMetadata, window: int, dtype: torch.dtype):
    """(slots [B * S], additive mask [B, Q, 1, S]) of the S = window + Q - 1 positions the
    step's queries of a sliding-window layer can see (fewer where the padded context is
    shorter), so that such a layer reads its window, not the whole context. Built once per
    step and window."""
    return meta.per_step(("window_span", window), lambda: _window_span(meta, window, dtype))


def _window_span(meta: AttentionMetadata, window: int, dtype: torch.dtype):
    B, Q, L = meta.decode_batch, meta.decode_q_len, meta.decode_ctx
    starts = meta.decode_starts
    span = min(window + Q - 1, L)
    first = (starts - window + 1).clamp(min=0).clamp(max=L - span)
    pos = first[:, None] + torch.arange(span, device=starts.device)  # [B, S]
    slots = meta.decode_slots.view(B, L).gather(1, pos).reshape(-1)
    q_pos = starts[:, None] + torch.arange(Q, device=starts.device)  # [B, Q]
    hidden = _hidden(pos[:, None, :], q_pos[..., None], window)
    return slots, _additive(hidden, dtype).unsqueeze(2)
