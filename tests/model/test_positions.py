"""The model honours explicit positions: a split run with cached K/V equals one full run."""

from __future__ import annotations

import torch

from kvmemo.model.config import ModelArchConfig
from kvmemo.model.layers.basic import RotaryEmbedding
from kvmemo.model.models.dense_attention import dense_causal_attention
from kvmemo.model.models.llama import LlamaForCausalLM
from tests.model.tiny import caching_attention, tiny_hf_model


def _tiny_model() -> LlamaForCausalLM:
    hf = tiny_hf_model("llama")
    config = ModelArchConfig.from_hf_config(hf.config.to_dict())
    return LlamaForCausalLM.from_state_dict(config, hf.state_dict())


def test_second_half_with_positions_matches_full_run() -> None:
    model = _tiny_model()
    config = model.config
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    full = model.compute_logits(
        model(ids, torch.arange(40), dense_causal_attention(4, 2))
    )  # [40, V]

    attention, cache = caching_attention()
    model(ids[:25], torch.arange(25), attention)
    assert cache[0][0].shape == (25, config.num_key_value_heads, config.head_dim)
    second = model.compute_logits(model(ids[25:], torch.arange(25, 40), attention))  # [15, V]
    diff = (second - full[25:]).abs().max().item()
    assert diff < 1e-4, f"max |logits diff| = {diff:.3g}"


def test_positions_change_the_output() -> None:
    model = _tiny_model()
    ids = torch.tensor([5, 6, 7])
    attention = dense_causal_attention(4, 2)
    a = model(ids, torch.arange(3), attention)
    b = model(ids, torch.arange(100, 103), attention)
    # Relative positions are equal, so RoPE attention is (numerically) invariant to a shift...
    assert torch.allclose(a, b, atol=1e-4)
    c = model(ids, torch.tensor([0, 5, 9]), attention)
    assert not torch.allclose(a, c, atol=1e-4)  # ...but not to a change of spacing


def test_rope_cache_grows_past_max_position() -> None:
    rope = RotaryEmbedding(16, 10000.0, None, max_position_embeddings=8)
    cos, sin = rope.cos_sin(torch.tensor([3, 1000]), torch.float32)
    assert cos.shape == (2, 1, 8) and rope.cos_cache.shape[0] >= 1001
    expected = torch.cos(1000 * rope.inv_freq)
    assert torch.allclose(cos[1, 0], expected, atol=1e-5)


def test_rope_tables_give_the_same_bits_whatever_their_length() -> None:
    """Tables start short on the CPU and are rebuilt longer as positions arrive: a position's
    cos and sin are the same bits from a short table, a grown one and one built long at once."""
    grown = RotaryEmbedding(256, 1_000_000.0, None, max_position_embeddings=32768)
    start = grown.cos_cache.shape[0]
    assert start < 8192  # a short start: that is the memory saved
    early = torch.arange(0, start, 7)
    cos_short, sin_short = grown.cos_sin(early, torch.float32)
    late = torch.tensor([start + 3, 5000, 8191])
    cos_late, sin_late = grown.cos_sin(late, torch.float32)
    assert grown.cos_cache.shape[0] > 8191
    built = RotaryEmbedding(256, 1_000_000.0, None, max_position_embeddings=32768)
    built.cos_cache, built.sin_cache = built._build_cache(16384)
    for positions, cos, sin in ((early, cos_short, sin_short), (late, cos_late, sin_late)):
        cos_ref, sin_ref = built.cos_sin(positions, torch.float32)
        assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    assert torch.equal(grown.cos_sin(early, torch.float32)[0], cos_short)
