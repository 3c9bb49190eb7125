"""The incremental detokenizer on the real tokenizers (SmolLM2's byte-level BPE, Gemma 3's
SentencePiece with byte fallback): after every token its text is the decode of all tokens so far,
and a token costs the same to detokenize at the 4,000th as at the 10th."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvmemo.engine.detokenizer import IncrementalDetokenizer
from kvmemo.model.loading.loader import checkpoint_fingerprint
from kvmemo.model.loading.tokenizer import load_gguf_tokenizer

TEXT = (
    "Grüße aus Köln! Ça coûte 12,50 € — naïve café. 東京の天気は晴れです。 Привет, мир. "
    "Emoji: 🦙🚀👩‍💻 and a flag 🇫🇷. Code: def f(x):\n\treturn x ** 2  # ok\n\n"
    "Numbers 3.14159, 2^10 = 1024; URLs https://example.org/a?b=c&d=e.  Double  spaces.\n"
)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request, smollm_gguf):
    if request.param == "smollm2":
        path = smollm_gguf
    else:
        path = Path(request.getfixturevalue("gemma3_gguf"))
    return load_gguf_tokenizer(path, checkpoint_fingerprint(path))


def mixed_ids(tokenizer, count: int, seed: int) -> list[int]:
    """Real text (multi-byte characters split over tokens), special tokens, random ids."""
    rng = random.Random(seed)
    text_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    specials = list(tokenizer.all_special_ids)
    ids: list[int] = []
    while len(ids) < count:
        roll = rng.random()
        if roll < 0.7:
            start = rng.randrange(len(text_ids))
            ids += text_ids[start : start + rng.randrange(1, 40)]
        elif roll < 0.8:
            ids.append(rng.choice(specials))
        else:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 5))]
    return ids[:count]


@pytest.mark.model
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_text_is_the_decode_of_every_token_so_far(tokenizer, skip_special_tokens):
    ids = mixed_ids(tokenizer, 1500, seed=7)
    detok = IncrementalDetokenizer(tokenizer, (), skip_special_tokens=skip_special_tokens)
    for n, token in enumerate(ids, start=1):
        detok.add_token(token, is_last=n == len(ids))
        full = tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens)
        if n == len(ids) or not full.endswith("\ufffd"):
            assert detok.text == full, n
        else:  # a character still incomplete: the text waits, a prefix of what comes
            assert full.startswith(detok.text), n


@pytest.mark.model
def test_stop_strings_cut_the_text_as_a_full_decode_would(tokenizer):
    ids = tokenizer(TEXT * 3, add_special_tokens=False).input_ids
    for stop, include in (("мир", False), ("café", True), ("\n\n", False)):
        detok = IncrementalDetokenizer(tokenizer, (stop,), include_stop_str=include)
        for n, token in enumerate(ids, start=1):
            if detok.add_token(token, is_last=n == len(ids)):
                break
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        end = full.index(stop) + (len(stop) if include else 0)
        assert (detok.text, detok.stop_reason) == (full[:end], stop)


@pytest.mark.model
def test_a_token_costs_the_same_at_the_4000th_as_at_the_10th(tokenizer):
    """Counted in token ids handed to decode: the last 100 of 4,000 within 1.5x the first 100
    (a whole-output decode per token would be ~40x)."""
    ids = mixed_ids(tokenizer, 4000, seed=11)
    detok = IncrementalDetokenizer(tokenizer, ("never appears: \u2603\u2603",))
    costs = []
    for n, token in enumerate(ids, start=1):
        before = detok.num_decoded_tokens
        detok.add_token(token, is_last=n == len(ids))
        costs.append(detok.num_decoded_tokens - before)
    first, last = sum(costs[:100]), sum(costs[-100:])
    assert last <= 1.5 * first, (first, last)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def _llama_style_tokenizer():
    """A tokenizer whose decoder strips a decode's leading space, as Llama's and Mistral's do."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁Hello": 2, ".": 3, "▁The": 4, "▁world": 5, "<0xC3>": 6,
             "<0xA9>": 7}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_skipped_special_token_keeps_the_next_words_space(skip_special_tokens):
    """The window must not start at a token that decoded to nothing: Strip would eat the space
    of the word after it ("Hello.The world")."""
    tokenizer = _llama_style_tokenizer()
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.choice([1, 2, 3, 4, 5, 6, 7, 1, 1]) for _ in range(rng.randrange(1, 12))]
        detok = IncrementalDetokenizer(tokenizer, (), skip_special_tokens=skip_special_tokens)
        for n, token in enumerate(ids, start=1):
            detok.add_token(token, is_last=n == len(ids))
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids
    detok = IncrementalDetokenizer(tokenizer, ("Hello world",))
    stopped = [detok.add_token(t, is_last=False) for t in (2, 1, 5)]
    assert stopped == [False, False, True] and detok.text == ""
