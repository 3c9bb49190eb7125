"""host_copy.to_device: one packed copy of a step's small integer tensors, shapes and values
kept (on the CPU the tensors themselves; "meta" stands in for a device here)."""

from __future__ import annotations

import pytest
import torch

from kvmemo.host_copy import to_device


def test_tensors_keep_their_shapes_values_and_order() -> None:
    tensors = [torch.arange(5), torch.arange(12).view(3, 4) * 7, torch.zeros(0, dtype=torch.int64)]
    assert all(a is b for a, b in zip(to_device(tensors, "cpu"), tensors))
    moved = to_device(tensors, "meta")
    assert [m.shape for m in moved] == [t.shape for t in tensors]
    assert all(m.device.type == "meta" for m in moved)
    if torch.cuda.is_available():
        on_gpu = to_device(tensors, "cuda")
        assert all(torch.equal(g.cpu(), t) for g, t in zip(on_gpu, tensors))
    assert to_device([], "meta") == []


@pytest.mark.parametrize("bad", [torch.arange(3, dtype=torch.int32), torch.ones(2)])
def test_anything_but_cpu_int64_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="packs CPU int64 tensors"):
        to_device([torch.arange(2), bad], "meta")
