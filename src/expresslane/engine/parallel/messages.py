"""What rank 0 tells the other ranks, over each worker's pipe: small typed messages, their
tensors as NumPy arrays (pickled as plain bytes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from expresslane.models.attention import AttentionMetadata, PrefillChunk


def _array(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().cpu().numpy()


def _tensor(a: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a).to(device)


@dataclass
class Bind:
    """Allocate the KV cache (the runner's `CacheConfig`) and bind the model to it."""

    cache: object


@dataclass
class Ready:
    """A worker's answer to `Bind`: its model's execution plan, described."""

    plan: str


@dataclass
class Failed:
    """A worker's last words: what it raised (then it exits)."""

    error: str


@dataclass
class Stop:
    """Exit."""


_DECODE_TENSORS = ("decode_slots", "decode_starts", "decode_prompt_ends")
_DECODE_INTS = ("num_decode_tokens", "decode_q_len", "decode_batch", "decode_ctx")


@dataclass
class Forward:
    """One forward pass: the arguments of `LlamaModel.forward`."""

    input_ids: np.ndarray
    positions: np.ndarray
    logits_indices: np.ndarray | None
    slot_mapping: np.ndarray
    decode: dict  # the decode fields of AttentionMetadata (arrays and ints)
    prefills: list[tuple]  # (start, length, context_len, slots, prompt_end) per chunk

    @classmethod
    def of(cls, input_ids, positions, meta: AttentionMetadata, logits_indices=None) -> Forward:
        decode = {name: _array(getattr(meta, name)) for name in _DECODE_TENSORS}
        decode.update({name: getattr(meta, name) for name in _DECODE_INTS})
        prefills = [
            (c.start, c.length, c.context_len, _array(c.slots), c.prompt_end) for c in meta.prefills
        ]
        return cls(
            _array(input_ids),
            _array(positions),
            _array(logits_indices),
            _array(meta.slot_mapping),
            decode,
            prefills,
        )

    def arguments(self, device: torch.device) -> tuple:
        """(input_ids, positions, meta, logits_indices) on `device`."""
        decode = {
            name: _tensor(v, device) if name in _DECODE_TENSORS else v
            for name, v in self.decode.items()
        }
        prefills = [
            PrefillChunk(s, n, ctx, _tensor(slots, device), end)
            for s, n, ctx, slots, end in self.prefills
        ]
        meta = AttentionMetadata(
            slot_mapping=_tensor(self.slot_mapping, device), prefills=prefills, **decode
        )
        return (
            _tensor(self.input_ids, device),
            _tensor(self.positions, device),
            meta,
            _tensor(self.logits_indices, device),
        )
