"""Chunk KV blending (kv_reuse="blend") on the bundled model: exact where it must be (ratio 1.0,
one chunk first, a cold prompt), isolated like any cache entry, persistent across processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kvmemo import LLM, SamplingParams
from kvmemo.attention.blend import rerotate
from kvmemo.kv.hashing import RequestHasher, namespace_root_hash
from tests.helpers import assert_all_blocks_free

pytestmark = pytest.mark.model

CONTEXT = (
    "<|im_start|>system\nYou answer questions about the harbor towns below, using only the "
    "documents. Keep answers short.\n"
)
TOWNS = ["Alder", "Brook", "Cedar", "Dunmore"]


def document(i: int) -> str:
    town = TOWNS[i]
    return (
        f"Document about {town}. The river town of {town} keeps a ledger of every boat that "
        f"docks there. Fishing boats arrive at dawn and leave at dusk. The market of {town} sells "
        f"salt, rope and dried fish, and the old lighthouse of {town} was rebuilt in {1850 + 7 * i}. "
        f"The harbor master of {town} is named Captain {['Ines', 'Oskar', 'Marta', 'Tomas'][i]}. "
        "Visitors should register at the harbor office before mooring.\n\n"
    )


def question(town: str) -> str:
    return (
        f"<|im_end|>\n<|im_start|>user\nWho is the harbor master of {town}?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def segments(order: list[int], town: str = "Cedar") -> list[str]:
    return [CONTEXT, *(document(i) for i in order), question(town)]


def run(llm: LLM, segs: list[str], **kwargs):
    prompt = {"segments": segs, **kwargs}
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def blend_llm():
    return LLM(num_blocks=600)


def test_moved_keys_equal_keys_computed_at_the_new_position(blend_llm):
    """A chunk's keys computed at position p and moved to q equal the keys computed at q
    (within 1e-5 in fp32): layer 0 of the real model, positions up to 7,000."""
    model = blend_llm.engine.runner.model
    ids = torch.tensor(blend_llm.tokenizer(document(0))["input_ids"])
    layer = model.layers[0]
    captured: dict[int, torch.Tensor] = {}

    def keys_at(start: int) -> torch.Tensor:
        positions = torch.arange(start, start + ids.numel())
        cos, sin = model.rope_tables(positions, torch.float32)[0]

        def attention(index, q, k, v):
            captured[start] = k.clone()
            return q

        layer.attention_block(0, layer.input_layernorm(model.embed(ids)), cos, sin, attention)
        return captured[start]

    for p, q in ((17, 305), (1000, 40), (3, 7001)):
        moved = rerotate(
            keys_at(p).transpose(0, 1),  # [Hkv, N, D], as pages hold them
            model.rope_tables(torch.arange(p, p + ids.numel()), torch.float32)[0],
            model.rope_tables(torch.arange(q, q + ids.numel()), torch.float32)[0],
        )
        assert (moved - keys_at(q).transpose(0, 1)).abs().max().item() < 1e-5


def test_cold_prompt_runs_exact_then_chunks_are_reused(blend_llm):
    blend_llm.reset_prefix_cache()
    order = [2, 0, 3, 1]
    plain = run(blend_llm, segments(order))
    blend_llm.reset_prefix_cache()
    cold = run(blend_llm, segments(order), kv_reuse="blend")
    # Nothing was cached: an exact prefill, and its chunks computed after its first token.
    assert cold.outputs[0].token_ids == plain.outputs[0].token_ids
    assert cold.metrics.num_blended_tokens == 0
    warm = run(blend_llm, segments([1, 3, 0, 2]), kv_reuse="blend", recompute_ratio=0.3)
    chunk_tokens = sum(len(blend_llm.tokenizer(document(i))["input_ids"]) for i in range(4))
    # Most chunk tokens reused (the rest: 30% recomputed, plus each chunk's uncached tail).
    assert warm.metrics.num_blended_tokens > 0.5 * chunk_tokens
    assert (
        warm.metrics.num_blended_tokens + warm.metrics.num_recomputed_tokens
        + warm.metrics.num_cached_tokens == warm.metrics.num_prompt_tokens
    )
    assert_all_blocks_free(blend_llm)


def test_ratio_one_gives_the_tokens_of_a_full_prefill(blend_llm):
    order = [3, 1, 2, 0]
    run(blend_llm, segments([0, 1, 2, 3], "Brook"), kv_reuse="blend")  # chunks cached
    plain = run(blend_llm, segments(order, "Brook"))
    full = run(blend_llm, segments(order, "Brook"), kv_reuse="blend", recompute_ratio=1.0)
    assert full.metrics.num_blended_tokens == 0
    assert full.outputs[0].token_ids == plain.outputs[0].token_ids
    partial = run(blend_llm, segments(order, "Brook"), kv_reuse="blend", recompute_ratio=0.2)
    assert partial.metrics.num_blended_tokens > 0  # the blend path ran: chunks were warm


def test_one_chunk_first_equals_prefix_caching(blend_llm):
    """[context, chunk, question]: the chunk's KV was computed after this very context at these
    positions, so blending changes nothing."""
    segs = [CONTEXT, document(1), question("Brook")]
    run(blend_llm, [CONTEXT, document(1), question("Alder")], kv_reuse="blend")  # cache it
    plain = run(blend_llm, segs)
    blended = run(blend_llm, segs, kv_reuse="blend", recompute_ratio=0.0)
    assert blended.metrics.num_blended_tokens > 0
    assert blended.outputs[0].token_ids == plain.outputs[0].token_ids


def test_chunks_never_serve_exact_prefixes_or_other_salts(blend_llm):
    blend_llm.reset_prefix_cache()
    run(blend_llm, segments([0, 1]), kv_reuse="blend")  # cold: exact prompt + chunks after
    # The exact prompt [context, doc 1, ...] was never computed (doc 1 came second); its chunk
    # was, under the chunk marker. An exact request gets only what it shares with the cold
    # prompt [context, doc 0, ...] (its last block by partial copy), not doc 1's chunk.
    probe = blend_llm.processor.process_segments([CONTEXT, document(1), "Tell me more."])
    cold = blend_llm.processor.process_segments(segments([0, 1])).token_ids
    shared = next(i for i, (a, b) in enumerate(zip(probe.token_ids, cold)) if a != b)
    exact = blend_llm.generate(probe, GREEDY, use_tqdm=False)[0]
    assert 0 < exact.metrics.num_cached_tokens <= shared < 40
    # Another tenant's salt sees none of the chunks: its first blend prompt is cold.
    other = blend_llm.generate(
        {"segments": segments([1, 0]), "kv_reuse": "blend"}, GREEDY, use_tqdm=False,
        cache_salt="tenant-b",
    )[0]
    assert other.metrics.num_blended_tokens == 0 and other.metrics.num_cached_tokens == 0
    same = run(blend_llm, segments([1, 0]), kv_reuse="blend")
    assert same.metrics.num_blended_tokens > 0


def test_chunk_hashes_differ_by_model_and_marker():
    """The chain root is the model's namespace; the marker splits chunk chains from exact ones
    at the block holding the chunk's first token, and not before."""
    tokens = list(range(100, 180))
    hashers = [
        RequestHasher(namespace_root_hash(weights_fingerprint=fp, kv_cache_dtype="float32",
                                          block_size=16), 16)
        for fp in ("model-a", "model-b")
    ]
    chunk_a = hashers[0].hash_prompt(tokens, kv_marker=(40, "chunk"))
    chunk_b = hashers[1].hash_prompt(tokens, kv_marker=(40, "chunk"))
    exact_a = hashers[0].hash_prompt(tokens)
    assert not set(chunk_a) & set(chunk_b)
    assert chunk_a[:2] == exact_a[:2]  # blocks 0 and 1 end before token 40
    assert not set(chunk_a[2:]) & set(exact_a)


def test_blend_and_exact_outputs_differ_only_through_reuse_counts(blend_llm):
    """Every prompt token is accounted for: prefix hit, reused chunk token, or computed."""
    out = run(blend_llm, segments([2, 3, 1]), kv_reuse="blend")
    m = out.metrics
    assert m.num_cached_tokens + m.num_blended_tokens + m.num_recomputed_tokens == (
        m.num_prompt_tokens
    )
    plain = run(blend_llm, segments([2, 3, 1]))
    assert plain.metrics.num_blended_tokens is None


@pytest.mark.parametrize(
    "segs, fragment",
    [
        ([CONTEXT], "at least 2 segments"),
        ("one string", "at least 2 segments"),
        ([CONTEXT, "", question("Alder")], "segments[1] is empty"),
        ([CONTEXT, 42, question("Alder")], "segments[1] must be a string or a list of token ids"),
        ([CONTEXT, [1, -5], question("Alder")], "segments[1]"),
        ([CONTEXT, "word " * 9000, question("Alder")], "segments are"),
    ],
)
def test_bad_segments_are_named(blend_llm, segs, fragment):
    with pytest.raises(ValueError) as info:
        blend_llm.generate({"segments": segs, "kv_reuse": "blend"}, GREEDY, use_tqdm=False)
    assert fragment in str(info.value)


def test_bad_reuse_options_are_named(blend_llm):
    with pytest.raises(ValueError, match="kv_reuse must be one of"):
        run(blend_llm, segments([0]), kv_reuse="fuzzy")
    with pytest.raises(ValueError, match=r"recompute_ratio must be a number in \[0, 1\]"):
        run(blend_llm, segments([0]), kv_reuse="blend", recompute_ratio=1.5)
    with pytest.raises(ValueError, match="documents\\[1\\] must be a non-empty string"):
        blend_llm.chat([{"role": "user", "content": "hi"}], GREEDY, documents=["a", ""],
                       use_tqdm=False)


def test_chat_documents_become_segments(blend_llm):
    messages = [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": "Who is the harbor master of Alder?"},
    ]
    docs = [document(0).strip(), document(2).strip()]
    prompt = blend_llm.processor.process_chat(messages, documents=docs, kv_reuse="blend")
    assert prompt.segments is not None and len(prompt.segments.starts) == 4
    text = blend_llm.tokenizer.decode(prompt.token_ids)
    assert text.index(docs[0]) < text.index(docs[1]) < text.index("Who is the harbor master")
    first = blend_llm.chat(messages, GREEDY, documents=docs, kv_reuse="blend", use_tqdm=False)[0]
    plain = blend_llm.chat(messages, GREEDY, documents=docs, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == plain.outputs[0].token_ids  # cold: exact


def test_separator_splits_prompts_into_segments():
    llm = LLM(num_blocks=128, blend_separator=" # # ", kv_reuse="blend")
    prompt = llm.processor.process_any(CONTEXT + " # # " + document(0) + " # # " + question("A"))
    assert prompt.segments is not None and len(prompt.segments.starts) == 3
    assert "# #" not in llm.tokenizer.decode(prompt.token_ids)


_SECOND_PROCESS = textwrap.dedent(
    """
    import json, sys
    from kvmemo import LLM, SamplingParams
    from tests.engine.test_blend import segments, GREEDY
    llm = LLM(num_blocks=600, kv_store=sys.argv[1])
    if sys.argv[2] == "first":
        llm.generate({"segments": segments([0, 1, 2, 3]), "kv_reuse": "blend"}, GREEDY,
                     use_tqdm=False)
    out = llm.generate({"segments": segments([3, 0, 2, 1]), "kv_reuse": "blend"}, GREEDY,
                       use_tqdm=False)[0]
    llm.engine.flush_kv_store()
    print(json.dumps({"tokens": out.outputs[0].token_ids,
                      "blended": out.metrics.num_blended_tokens,
                      "loaded": llm.get_metrics().store_hit_tokens}))
    """
)


def test_second_process_reuses_chunks_from_the_disk_store(tmp_path):
    store = f"disk:{tmp_path / 'kv'}"

    def process(role: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _SECOND_PROCESS, store, role],
            capture_output=True, text=True, timeout=600, check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = process("first")
    assert first["blended"] > 0  # the chunks came from the first prompt
    second = process("second")
    assert second["loaded"] > 0  # its chunks' blocks were read from the store
    assert second["tokens"] == first["tokens"]


def test_layers_before_the_check_layer_run_in_pieces(blend_llm, monkeypatch):
    """A prompt longer than a piece runs the layers before the check layer as a chunked prefill:
    at ratio 1.0 the tokens still equal a full prefill's."""
    from kvmemo.engine import blend_forward

    monkeypatch.setattr(blend_forward, "_PIECE_ROWS", 64)
    order = [2, 3, 0]
    run(blend_llm, segments(order, "Dunmore"), kv_reuse="blend")  # chunks cached
    plain = run(blend_llm, segments(order, "Dunmore"))
    pieces = run(blend_llm, segments(order, "Dunmore"), kv_reuse="blend", recompute_ratio=1.0)
    assert pieces.metrics.num_recomputed_tokens > 3 * 64
    assert pieces.outputs[0].token_ids == plain.outputs[0].token_ids
    half = run(blend_llm, segments(order, "Dunmore"), kv_reuse="blend", recompute_ratio=0.5)
    assert half.metrics.num_blended_tokens > 64  # the blend path ran: chunks were warm
