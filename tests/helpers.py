"""Assertions shared by engine tests."""

from __future__ import annotations


def assert_all_blocks_free(llm) -> None:
    manager = llm.engine.kv_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked after all requests finished"
