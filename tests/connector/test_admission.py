"""Store admission (kvmemo/connector/admission.py): "all" writes every committed block; "reused"
only a block committed twice or hit on the device, with a bounded doorkeeper."""

from __future__ import annotations

import pytest

from kvmemo.connector.admission import StoreAdmission
from tests.connector.conftest import block_hash


def test_all_writes_every_committed_block() -> None:
    admission = StoreAdmission("all")
    assert all(admission.admit_committed(block_hash(i)) for i in range(5))
    admission.note_device_hits([block_hash(9)])
    assert admission.take_reused() == []


def test_reused_writes_a_block_seen_twice_and_device_hits() -> None:
    admission = StoreAdmission("reused", doorkeeper_blocks=3)
    assert not admission.admit_committed(block_hash(0))  # first sighting
    assert admission.admit_committed(block_hash(0))  # committed again: it came back
    assert not admission.admit_committed(block_hash(0))  # forgotten once admitted
    admission.note_device_hits([block_hash(1), block_hash(2), block_hash(1)])
    assert admission.take_reused() == [block_hash(1), block_hash(2)]
    assert admission.take_reused() == []
    for i in range(10, 14):  # four new blocks push the oldest out of a 3-block doorkeeper
        admission.admit_committed(block_hash(i))
    assert not admission.admit_committed(block_hash(10))
    assert admission.admit_committed(block_hash(13))
    assert admission.num_declined == 7


def test_an_unknown_admission_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kv_store_admission must be one of \['all', 'reused'\]"):
        StoreAdmission("lfu")
