"""Small host tensors onto the engine's device in one asynchronous copy.

Why: each step sends a handful of small integer tensors (token ids, positions, slots, block
tables, lengths) to the device. `torch.tensor(values, device="cuda")` copies from pageable
memory, which blocks the host until the GPU has drained its queue, once per tensor; on an H100
those copies were the largest host cost of a decode step replayed from a CUDA graph. Packed into
one pinned buffer they cost one asynchronous copy (torch's pinned-memory allocator keeps the
buffer until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """CPU int64 tensors (any shapes) on `device`, in order; on the CPU, the tensors themselves.

    Raises:
        ValueError: a tensor that is not int64 or not on the CPU.
    """
    device = torch.device(device)
    for t in tensors:
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise ValueError(f"to_device packs CPU int64 tensors; got {t.dtype} on {t.device}")
    if device.type == "cpu":
        return list(tensors)
    sizes = [t.numel() for t in tensors]
    staging = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    if sizes:
        torch.cat([t.reshape(-1) for t in tensors], out=staging)
    packed = staging.to(device, non_blocking=True)
    return [piece.view(t.shape) for piece, t in zip(packed.split(sizes), tensors)]
