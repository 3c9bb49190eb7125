"""Workspace: named scratch buffers for gathering KV pages, allocated on demand and reused.

Invariant: `get` always returns a tensor of exactly the asked shape, dtype and device; a buffer is
allocated on first use, grown when too small and otherwise reused. Nothing assumes one exists,
and a returned view is only valid until the next `get` of the same name.
"""

from __future__ import annotations

import math

import torch

_GROWTH = 1.25  # grow with headroom so a context that lengthens by a token does not reallocate


class Workspace:
    """Owns the scratch tensors of one attention backend (one per engine, one thread)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.num_allocations = 0  # how many times a buffer was (re)allocated, for tests and stats

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if (buffer is None or buffer.numel() < numel or buffer.dtype != dtype
                or buffer.device != device):
            # Large CPU allocations are fresh mmaps whose first touch page-faults: reusing them
            # saves about as much time as the copy into them costs (measured: 20 -> 15 ms at
            # 32 x 1,024 decode), so grow rarely and keep the buffer.
            buffer = torch.empty(max(1, int(numel * _GROWTH)), dtype=dtype, device=device)
            self._buffers[name] = buffer
            self.num_allocations += 1
        return buffer[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
