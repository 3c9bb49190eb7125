"""Draft sources (kvmemo/spec): what ngram and suffix propose, the suffix index's tenant scope
and memory bound, and the verification rule's distribution."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from kvmemo.engine.draft_verify import accepted, draft_rows
from kvmemo.engine.sampler import Sampler
from kvmemo.engine.scheduler_output import ScheduledSequence
from kvmemo.sampling import SamplingParams
from kvmemo.spec.ngram import ngram_draft
from kvmemo.spec.suffix import SuffixIndex


def test_ngram_takes_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 0, 7, 2, 3]
    # Tail (7, 2, 3) occurs once before, at 5..7: the draft is what followed it.
    assert ngram_draft(tokens, 3, 2, 4) == [4, 5, 6]
    # min_n 1 with max_n 1: the latest earlier 3 (at index 7) wins over the first.
    assert ngram_draft(tokens, 2, 1, 1) == [4, 5]
    assert ngram_draft([5, 6, 7, 8], 4, 2, 3) == []  # no repeat
    assert ngram_draft(tokens, 0, 2, 3) == []


def _index(**overrides) -> SuffixIndex:
    settings = dict(max_depth=24, max_spec_factor=1.0, min_token_prob=0.1, max_sequences=100,
                    max_tokens=10_000)
    settings.update(overrides)
    return SuffixIndex(**settings)


def test_suffix_follows_the_majority_and_stays_in_its_salt():
    index = _index()
    for tail in ([50, 51, 52, 53], [50, 51, 52, 53], [50, 51, 60, 61]):
        index.add([1, 2, 3, 4, 10, 11, *tail], "a")
    context = [7, 3, 4, 10, 11]
    # Three matches of (3, 4, 10, 11); two of three go on 50, 51, 52, 53.
    assert index.draft(context, "a", 8)[:4] == [50, 51, 52, 53]
    assert index.draft(context, "b", 8) == []  # another tenant's corpus is never read
    assert index.draft(context, None, 8) == []
    # The draft is at most max_spec_factor x the match length (4 tokens matched here).
    assert len(_index(max_spec_factor=0.5).draft(context, "a", 8)) == 0
    capped = _index(max_spec_factor=0.5)
    capped.add([1, 2, 3, 4, 10, 11, 50, 51, 52, 53], "a")
    assert capped.draft(context, "a", 8) == [50, 51]


def test_suffix_stops_where_the_matches_disagree():
    index = _index(min_token_prob=0.6)
    index.add([1, 2, 3, 4, 5, 6], "s")
    index.add([1, 2, 3, 4, 5, 7], "s")
    index.add([1, 2, 3, 8, 9, 9], "s")
    # After (1, 2, 3): 4 in 2 of 3 (0.67 >= 0.6), then 5 in 2 of 2, then 6 or 7 (0.5): stop.
    assert index.draft([1, 2, 3], "s", 8) == [4, 5]


def test_suffix_index_memory_stays_within_its_bounds():
    rng = random.Random(0)
    index = _index(max_tokens=5_000, max_sequences=40)
    for n in range(300):
        salt = f"tenant-{n % 3}"
        index.add([rng.randrange(1000) for _ in range(rng.randrange(20, 200))], salt)
        assert index.num_tokens <= 5_000 and index.num_sequences <= 40
    # The bigram lists hold only live positions (dropped sequences leave nothing behind).
    live = sum(len(c.sequences) for c in index._corpora.values())
    assert live == index.num_sequences
    entries = sum(len(v) for c in index._corpora.values() for v in c.bigram_ends.values())
    assert entries <= index.num_tokens


def _seq(draft: tuple[int, ...], params: SamplingParams) -> ScheduledSequence:
    return ScheduledSequence(
        request_id="r", token_ids=[0, *draft], num_computed_tokens=10, block_table=[0],
        needs_sample=True, sampling_params=params, num_output_tokens=0, draft_token_ids=draft,
    )


def test_verification_keeps_the_target_distribution():
    """Unseeded: the kept tokens of a drafted step are distributed as sequential sampling from
    each row's distribution (the rejection rule), checked by chi-square over the outcomes."""
    torch.manual_seed(0)
    vocab, draft = 5, (1, 3)
    logits = torch.randn(3, vocab) * 1.5  # rows: before d0, after d0, after d0 d1
    probs = torch.softmax(logits, dim=-1)
    params = SamplingParams(temperature=1.0)
    rows = draft_rows(_seq(draft, params), vocab)
    sampler = Sampler(seed=1, device="cpu")
    trials = 6000
    seen = Counter()
    for _ in range(trials):
        tokens = sampler.sample(logits, [r.sampling_params for r in rows],
                                [r.num_output_tokens for r in rows])
        seen[tuple(accepted(draft, [t.token_id for t in tokens]))] += 1
    expected = {}
    for t0 in range(vocab):
        if t0 != draft[0]:
            expected[(t0,)] = float(probs[0, t0])
            continue
        for t1 in range(vocab):
            if t1 != draft[1]:
                expected[(t0, t1)] = float(probs[0, t0] * probs[1, t1])
                continue
            for t2 in range(vocab):
                expected[(t0, t1, t2)] = float(probs[0, t0] * probs[1, t1] * probs[2, t2])
    outcomes = sorted(expected)
    assert set(seen) <= set(outcomes)
    assert _chi_square_p_above_001(
        [seen[o] for o in outcomes], [expected[o] * trials for o in outcomes]
    ), (seen, expected)


def _chi_square_p_above_001(observed: list[int], expected: list[float]) -> bool:
    """Pearson's test: True unless p < 0.001. Outcomes expected fewer than 5 times are pooled;
    the critical value is Wilson and Hilferty's approximation (z = 3.09 for p = 0.001)."""
    small = [i for i, e in enumerate(expected) if e < 5]
    obs = [o for i, o in enumerate(observed) if i not in small] + [sum(observed[i] for i in small)]
    exp = [e for i, e in enumerate(expected) if i not in small] + [sum(expected[i] for i in small)]
    if not small:
        obs, exp = obs[:-1], exp[:-1]
    statistic = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3
    return statistic < critical


@pytest.mark.parametrize("drafted", [(), (4,), (4, 4, 2)])
def test_a_drafts_rows_are_its_plain_steps(drafted):
    params = SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.1)
    seq = _seq(drafted, params)
    seq = ScheduledSequence(**{**{f: getattr(seq, f) for f in seq.__slots__},
                               "token_history": ([1, 2], [7])})
    rows = draft_rows(seq, 8)
    assert [r.num_output_tokens for r in rows] == list(range(len(drafted) + 1))
    assert [list(r.token_history[1]) for r in rows] == [
        [7, *drafted[:j]] for j in range(len(drafted) + 1)
    ]
    assert accepted(drafted, [*drafted, 6]) == [*drafted, 6]
    if drafted:
        assert accepted(drafted, [drafted[0] + 1, *drafted]) == [drafted[0] + 1]


def test_the_policy_verifies_long_drafts_only_when_they_are_likely_kept():
    from kvmemo.spec.policy import CPU_NATIVE_COST, GPU_COST, acceptance, best_length

    # A cost that jumps at the fifth row (a second pass of 4-row tiles): at 0.8 a fifth row's
    # expected gain (0.8^4 = 0.41 tokens) does not pay a 0.8-step jump; near-certain drafts do.
    stepped = (1.0, 1.2, 1.35, 1.5, 2.3, 2.45, 2.6, 2.75, 2.9)
    assert best_length(8, 0.8, stepped) == 3
    assert best_length(8, 0.99, stepped) == 8
    # The measured table: longer drafts as acceptance grows, none for unlikely ones.
    lengths = [best_length(16, a, CPU_NATIVE_COST) for a in (0.1, 0.5, 0.8, 0.95, 0.99)]
    assert lengths[0] == 0 and lengths == sorted(lengths) and lengths[-1] >= 8
    assert best_length(16, 0.8, GPU_COST) > lengths[2]  # a GPU reads the weights once
    assert best_length(2, 0.99, CPU_NATIVE_COST) == 2  # never past the draft
    # In a batch a draft's rows are priced against the step's: by hand, 16 rows at 0.95 on the
    # CPU table, plain 16 / 3.44 = 4.65 tokens per unit, one drafted token (15 + 1.95) / 3.75 =
    # 4.52 and longer ones less: no draft. Two rows: (1 + 1.95) / 1.41 = 2.09 > 2 / 1.25.
    assert best_length(16, 0.95, CPU_NATIVE_COST, rows=16) == 0
    assert best_length(16, 0.95, CPU_NATIVE_COST, rows=2) > 0
    assert best_length(16, 0.95, GPU_COST, rows=16) > 0  # flat: (15 + 1.95) / 1.32 > 16 / 1.30
    assert all(best_length(16, a, CPU_NATIVE_COST, rows=1) == best_length(16, a, CPU_NATIVE_COST)
               for a in (0.1, 0.5, 0.8, 0.95, 0.99))
    assert acceptance(0, 0) == pytest.approx(0.7)  # the prior
    assert acceptance(90, 2) > 0.9 > acceptance(5, 10)


def test_a_replay_is_the_earlier_greedy_run_of_the_same_prompt():
    from kvmemo.request import Request, RequestStatus
    from kvmemo.spec.replay import ReplayIndex

    greedy = SamplingParams(temperature=0.0, max_tokens=50)

    def request(prompt, output=(), salt="a", params=greedy):
        r = Request("r", list(prompt), params, cache_salt=salt)
        for t in output:
            r.append_output_token(t)
        r.status = RequestStatus.FINISHED_STOPPED
        return r

    index = ReplayIndex(max_tokens=12)
    index.add(request([1, 2, 3], [7, 8, 9, 10]))
    assert index.draft(request([1, 2, 3], [7]), 10) == [8, 9, 10]
    assert index.draft(request([1, 2, 3], [7, 8]), 1) == [9]
    assert index.draft(request([1, 2, 3], [6]), 10) == []  # the run went another way
    assert index.draft(request([1, 2, 3], [7], salt="b"), 10) == []  # another tenant
    assert index.draft(request([1, 2, 4], [7]), 10) == []
    sampled = SamplingParams(temperature=0.8, max_tokens=50)
    assert index.draft(request([1, 2, 3], [7], params=sampled), 10) == []
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=50)
    index.add(request([5, 5], [1, 1], params=penalized))
    assert len(index) == 1  # a penalised run is not the greedy path
    index.add(request([4], list(range(10))))  # 14 tokens > 12: the oldest goes
    assert len(index) == 1 and index.num_tokens == 10
    assert index.draft(request([1, 2, 3], [7]), 10) == []


def test_the_corpus_log_survives_a_restart_and_damage(tmp_path):
    from kvmemo.spec.corpus_log import CorpusLog, CorpusRecord

    log = CorpusLog(tmp_path, max_bytes=10_000)
    first = CorpusRecord("a", [1, 2, 3], [4, 5], [b"\x01" * 4], True)
    second = CorpusRecord(None, [9], [8, 7], [], False)
    log.append(first)
    log.append(second)
    with open(log.path, "ab") as f:
        f.write(b"0000beef {\"torn\": \n")  # a torn write: skipped, not fatal
    assert list(CorpusLog(tmp_path, 10_000).read()) == [first, second]
    for i in range(300):  # past max_bytes: the newest half stays
        log.append(CorpusRecord("a", [i], [i], [], True))
    assert log.path.stat().st_size <= 10_000
    kept = list(log.read())
    assert kept[-1].prompt == [299] and len(kept) < 300
    blocked = CorpusLog(tmp_path / "missing" / "dir", 10_000)
    blocked.append(first)  # cannot write: saving stops, nothing raises
    assert blocked.paused_reason is not None
