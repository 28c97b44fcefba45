"""A sliding-window layer's KV store in the window pool (engine/window_blocks.py).

Attention addresses every layer by logical slot (block id * block_size + offset, the request's
block table); a window layer's store holds only the window pool's blocks, so it maps each
slot's block through `remap` (logical block -> window block, refreshed by the runner before
each step) and passes the rest to the store it wraps. The C++ kernels, which would read the
wrapped store by logical slot, are not offered it (window layers run in PyTorch anyway).
"""

from __future__ import annotations

import torch


class WindowKV:
    tensor = None  # no plain tensor addressed by logical slot

    def __init__(self, inner, remap: torch.Tensor, block_size: int):
        self.inner = inner
        self.remap = remap  # [logical blocks + 1] window block of each logical block
        self.block_size = block_size
        self.NATIVE_KIND = inner.NATIVE_KIND

    def _slots(self, slots: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return self.remap[slots // bs] * bs + slots % bs

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.inner.write(k, v, self._slots(slots))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self.inner.read(self._slots(slots))

    def native(self) -> list[torch.Tensor] | None:
        return None
