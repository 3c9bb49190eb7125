"""The KV pool is kv_cache_memory's worth of blocks, but no more than max_num_seqs sequences of
the whole context can hold; an explicit num_blocks is taken as given."""

from __future__ import annotations

from kvmemo import LLM, SamplingParams


def test_pool_capped_by_sequences_times_context() -> None:
    llm = LLM(max_model_len=64, max_num_seqs=3, kv_cache_memory="1GiB")
    assert llm.engine.layout.num_blocks == 3 * 64 // 16
    outs = llm.generate(["The capital of France is"] * 3, SamplingParams(max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)


def test_explicit_num_blocks_and_small_budgets_are_kept() -> None:
    assert LLM(max_model_len=64, max_num_seqs=3, num_blocks=50).engine.layout.num_blocks == 50
    small = LLM(max_num_seqs=64, kv_cache_memory="8MiB").engine.layout
    assert small.num_blocks == 8 * 2**20 // (small.bytes_per_token * small.block_size)
