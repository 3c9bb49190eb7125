"""StepCosts: the draft policy's cost table starts as the prior and follows the decode steps
this machine runs (kvmemo/spec/step_costs.py)."""

from __future__ import annotations

import pytest

from kvmemo.spec.policy import best_length
from kvmemo.spec.step_costs import MIN_SAMPLES, REFRESH_EVERY, StepCosts

PRIOR = (1.0, 1.25, 1.41, 1.52, 1.67, 1.79, 1.93, 2.15, 2.33)


def _feed(costs: StepCosts, seconds_by_rows: dict[int, float]) -> None:
    """Each row count's steps, interleaved, until the table has been recomputed."""
    refreshed = False
    for _ in range(max(MIN_SAMPLES, REFRESH_EVERY)):
        for rows, seconds in seconds_by_rows.items():
            refreshed |= costs.observe(rows, seconds)
    assert refreshed


def test_the_table_is_the_prior_until_steps_are_seen():
    costs = StepCosts(PRIOR)
    assert costs.table == PRIOR
    assert not costs.observe(1, 0.01)  # one step does not recompute it
    assert costs.table == PRIOR


def test_measured_row_counts_price_themselves_and_the_rest_follow_the_prior_scaled():
    costs = StepCosts(PRIOR)
    # Plain steps 8 ms; steps of 9 rows (8 drafted tokens) 25.5 ms: 3.19x, not the prior's 2.33.
    _feed(costs, {1: 0.008, 9: 0.0255})
    table = costs.table
    assert table[0] == 1.0
    assert table[8] == pytest.approx(0.0255 / 0.008)
    # 5 rows were never seen: the prior's 1.67, scaled by the median of the measured counts'
    # seconds / prior (8 ms / 1.0 and 25.5 ms / 2.33), over the one row's 8 ms.
    scale = (0.008 / 1.0 + 0.0255 / 2.33) / 2
    assert table[4] == pytest.approx(scale * 1.67 / 0.008)
    assert all(a <= b for a, b in zip(table, table[1:]))


def test_the_table_never_falls_with_more_rows_and_grows_past_the_prior():
    costs = StepCosts(PRIOR)
    # 3 rows measured cheaper than 2 (noise): priced as 2's; 12 rows, past the prior's end.
    _feed(costs, {1: 0.010, 2: 0.014, 3: 0.012, 12: 0.040})
    table = costs.table
    assert table[1] == pytest.approx(1.4)
    assert table[2] == pytest.approx(1.4)
    assert len(table) == 12 and table[11] == pytest.approx(4.0)
    assert all(a <= b for a, b in zip(table, table[1:]))


def test_a_steeper_machine_gets_shorter_drafts():
    costs = StepCosts(PRIOR)
    before = best_length(8, 0.8, costs.table)
    # Each extra row costs 40% of a plain step here (the prior: about 17%).
    _feed(costs, {rows: 0.01 * (1 + 0.4 * (rows - 1)) for rows in range(1, 10)})
    after = best_length(8, 0.8, costs.table)
    assert after < before


@pytest.mark.parametrize("rows, seconds", [(0, 0.01), (3, 0.0), (3, float("nan"))])
def test_steps_that_measure_nothing_are_ignored(rows, seconds):
    costs = StepCosts(PRIOR)
    for _ in range(2 * REFRESH_EVERY):
        costs.observe(rows, seconds)
    assert costs.table == PRIOR and not costs.samples


@pytest.mark.parametrize("prior", [(1.0,), (2.0, 3.0), ()])
def test_a_malformed_prior_is_refused(prior):
    with pytest.raises(ValueError, match="starts at 1.0"):
        StepCosts(prior)
