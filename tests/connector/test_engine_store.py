"""The disk KV store inside the engine: reuse across processes, corrupt files, failing writes.

Every case checks the rule that matters: a store hit or miss never changes the greedy tokens.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmemo.connector.disk import DiskStore
from kvmemo.kv.hashing import BlockHash

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16


def _run_worker(store_dir: Path, *extra: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.connector.store_worker",
            str(store_dir),
            "--max-tokens",
            "6",
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_second_process_reuses_blocks_from_disk(tmp_path):
    first = _run_worker(tmp_path)
    n = first["num_prompt_tokens"]
    assert n >= 1000 and first["num_cached_tokens"] == 0
    assert first["metrics"]["store_bytes_written"] > 0
    files = list(tmp_path.rglob("*.kvb"))
    # Committed: the prompt plus the generated tokens whose KV was computed (the last was not).
    assert len(files) == (n + 6 - 1) // BLOCK

    second = _run_worker(tmp_path)
    expected_hit = (n - 1) // BLOCK * BLOCK  # whole blocks, the last token always computed
    assert second["num_cached_tokens"] == expected_hit
    assert second["metrics"]["store_hit_tokens"] == expected_hit
    assert second["metrics"]["store_bytes_written"] == 0  # every block was already stored
    assert second["token_ids"] == first["token_ids"]


PROMPT = " ".join(f"line {i}: the quick brown fox number {i * 7} jumps." for i in range(18))


@pytest.fixture(scope="module")
def store_llm(tmp_path_factory):
    from kvmemo import LLM

    store_dir = tmp_path_factory.mktemp("kvstore")
    llm = LLM(num_blocks=128, device="cpu", kv_store=f"disk:{store_dir}")
    return llm


def _generate(llm, prompt=PROMPT, max_tokens=4):
    from kvmemo import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.engine.flush_kv_store()
    return out


def _fresh_device_cache(llm) -> None:
    ok, reason = llm.reset_prefix_cache()
    assert ok, reason


@pytest.fixture(scope="module")
def reference(store_llm):
    """Tokens with nothing cached anywhere (the store directory starts empty): no-store output."""
    out = _generate(store_llm)
    assert out.metrics.num_cached_tokens == 0
    return out


def _store(llm) -> DiskStore:
    return llm.engine.kv_connector.store


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0x10  # inside the payload: only the checksum can tell
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _foreign(path: Path) -> None:
    data = bytearray(path.read_bytes())
    root_len = data[8]  # magic(4) version(2) header_len(2), then the u8-prefixed root hash
    data[9 : 9 + root_len] = bytes(root_len)  # another namespace's root, checksum still valid
    path.write_bytes(bytes(data))


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("corrupt", [_truncate, _flip, _empty, _foreign, _directory])
def test_bad_file_is_a_logged_miss_and_output_stays_correct(store_llm, reference, caplog, corrupt):
    llm = store_llm
    request_hashes = _block_hashes(llm, PROMPT)
    bad_index = 3
    path = _store(llm).path_of(request_hashes[bad_index])
    if path.is_dir():
        path.rmdir()  # left by a previous case; the next save rewrites it
    _fresh_device_cache(llm)
    _generate(llm)  # make sure every block is stored (the previous case may have removed one)
    assert path.is_file()
    corrupt(path)
    _fresh_device_cache(llm)
    before = llm.get_metrics().store_hit_tokens
    with caplog.at_level(logging.WARNING, logger="kvmemo.connector.disk"):
        out = _generate(llm)
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert "treat" in caplog.text or "miss" in caplog.text
    hit = llm.get_metrics().store_hit_tokens - before
    assert hit == bad_index * BLOCK  # only the blocks before the bad one are loaded
    assert out.metrics.num_cached_tokens == bad_index * BLOCK


def test_full_hit_and_generated_blocks_are_stored(store_llm, reference):
    llm = store_llm
    _fresh_device_cache(llm)
    out = _generate(llm)
    n = out.metrics.num_prompt_tokens
    assert out.metrics.num_cached_tokens == (n - 1) // BLOCK * BLOCK
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    # A longer generation fills blocks with generated tokens; they are stored too.
    _fresh_device_cache(llm)
    long_out = _generate(llm, max_tokens=40)
    hashes = _block_hashes(llm, long_out.prompt_token_ids + long_out.outputs[0].token_ids[:-1])
    assert len(hashes) > n // BLOCK
    assert all(_store(llm).path_of(h).is_file() for h in hashes)


def test_read_only_store_warns_once_and_serves(store_llm, reference, tmp_path, caplog, monkeypatch):
    """Root ignores chmod 0o555, so a denied rename stands in for a read-only directory."""
    from kvmemo.connector import disk as disk_module

    llm = store_llm
    connector = llm.engine.kv_connector
    original = connector.store
    connector.store = DiskStore(tmp_path, 2**30, connector.namespace)

    def deny(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(disk_module.os, "replace", deny)
    try:
        with caplog.at_level(logging.WARNING, logger="kvmemo.connector.disk"):
            for _ in range(2):
                _fresh_device_cache(llm)
                out = _generate(llm)
                assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        assert sum("saving paused" in r.getMessage() for r in caplog.records) == 1
        assert llm.get_metrics().store_saves_dropped > 0
        assert not list(tmp_path.rglob("*.kvb"))
    finally:
        connector.store = original


def test_chunked_prefill_after_store_hit_and_event_fan_out(tmp_path, store_llm, reference):
    """The store hit covers the prefix; the rest is computed in small chunks: same tokens. With
    KV events on, subscribers and the store both see every BlockStored."""
    from kvmemo import LLM
    from kvmemo.kv.events import BlockStored

    del store_llm  # only for ordering: the store directory below is new
    llm = LLM(
        num_blocks=128,
        device="cpu",
        kv_store=f"disk:{tmp_path}",
        max_num_batched_tokens=48,
        enable_kv_events=True,
    )
    stored: list[bytes] = []
    llm.subscribe_kv_events(
        lambda events: stored.extend(
            h for e in events if isinstance(e, BlockStored) for h in e.block_hashes
        )
    )
    out = _generate(llm)
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert stored and all(_store(llm).path_of(h).is_file() for h in stored)
    assert len(list(tmp_path.rglob("*.kvb"))) == len(stored)
    _fresh_device_cache(llm)
    again = _generate(llm, PROMPT + " And then the fox rested.")
    n = out.metrics.num_prompt_tokens
    # The new text may retokenize the prompt's last block; every block before it is a hit.
    assert again.metrics.num_cached_tokens >= (n - 1) // BLOCK * BLOCK - BLOCK
    assert llm.get_metrics().store_hit_tokens == again.metrics.num_cached_tokens
    llm.engine.kv_manager.check_invariants()


def _block_hashes(llm, prompt) -> list[BlockHash]:
    ids = llm.engine.processor.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
    return llm.engine.hasher.hash_prompt(ids)


def test_concurrent_requests_read_a_stored_prefix_once(store_llm, reference):
    """Four requests sharing a stored prefix arrive together on an empty device cache: the first
    loads the prefix from the store, the others wait one step and hit it on the device (a
    restart with many users used to read it from disk once per request)."""
    from kvmemo import SamplingParams

    _generate(store_llm)  # the prompt's blocks are in the store
    _fresh_device_cache(store_llm)
    before = store_llm.get_metrics()
    prompts = [PROMPT + f" Question {i}: what happened next?" for i in range(4)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = store_llm.generate(prompts, params, use_tqdm=False)
    after = store_llm.get_metrics()
    prefix_blocks = (reference.metrics.num_prompt_tokens - 1) // BLOCK
    read_blocks = (after.store_hit_tokens - before.store_hit_tokens) // BLOCK
    assert prefix_blocks - 1 <= read_blocks <= prefix_blocks  # once, not once per request
    assert all(o.metrics.num_cached_tokens >= (prefix_blocks - 1) * BLOCK for o in outs)
    alone = [store_llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    store_llm.engine.kv_manager.check_invariants()


def test_reused_admission_writes_a_prompt_only_once_it_is_seen_twice(tmp_path, reference):
    """kv_store_admission="reused": a prompt computed once is not written; hit again on the
    device, its blocks are; computed again after the device forgot them, too. A fresh engine on
    the store then loads them and answers as the uncached reference."""
    from kvmemo import LLM

    store_dir = tmp_path / "kv"
    llm = LLM(num_blocks=128, device="cpu", kv_store=f"disk:{store_dir}",
              kv_store_admission="reused")
    first = _generate(llm)
    # The blocks a second request can hit (its last token is always computed).
    n = first.metrics.num_prompt_tokens
    hashes = _block_hashes(llm, first.prompt_token_ids)[: (n - 1) // BLOCK]
    assert hashes and not any(_store(llm).path_of(h).is_file() for h in hashes)
    assert llm.get_metrics().store_bytes_written == 0
    _generate(llm)  # a device hit proves the reuse
    assert all(_store(llm).path_of(h).is_file() for h in hashes)

    other = "A different prompt, long enough to fill a few blocks of sixteen tokens each. " * 4
    llm2 = LLM(num_blocks=128, device="cpu", kv_store=f"disk:{tmp_path / 'kv2'}",
               kv_store_admission="reused")
    out = _generate(llm2, other)
    other_hashes = _block_hashes(llm2, out.prompt_token_ids)
    _fresh_device_cache(llm2)
    assert not any(_store(llm2).path_of(h).is_file() for h in other_hashes)
    _generate(llm2, other)  # computed a second time: the doorkeeper remembers the first
    assert all(_store(llm2).path_of(h).is_file() for h in other_hashes)

    fresh = LLM(num_blocks=128, device="cpu", kv_store=f"disk:{store_dir}")
    loaded = _generate(fresh)
    assert fresh.get_metrics().store_hit_tokens == len(hashes) * BLOCK
    assert loaded.outputs[0].token_ids == reference.outputs[0].token_ids
