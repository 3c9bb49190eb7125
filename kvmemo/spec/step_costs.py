"""StepCosts: what a decode step of n rows costs on this machine, learned from the steps the
engine runs, for the policy that prices drafts (policy.py).

Why: the policy's built-in tables were measured on one CPU (Sapphire Rapids), and CPUs differ:
on Zen 4 a step verifying 8 drafted tokens costs 3.19 plain steps against the table's 2.33, so
the policy verified longer drafts than that machine repays (docs/benchmarks.md). Every decode
step the engine runs is a measurement of its own row count; the table here starts as the
built-in one and follows what this machine's steps take.

How: each row count n keeps a moving average of its steps' seconds. A count seen at least
MIN_SAMPLES times is priced by its own average; one not yet seen, by the prior's cost scaled to
the observed counts (the median of their average / prior ratios), so the policy's first
choices follow the prior and each draft length it tries corrects its price. Costs relative to one
row, made non-decreasing (a step never costs less for more rows). Only speed depends on it:
drafts are verified losslessly whatever their length.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from kvmemo.spec.policy import relative_cost

MIN_SAMPLES = 3  # steps of a row count before its own average prices it
SMOOTHING = 0.1  # weight of the newest step in a row count's moving average (steps are noisy)
REFRESH_EVERY = 32  # observed steps between recomputations of the table


@dataclass
class StepCosts:
    """The relative cost of a step by its rows; `table[k]` prices k + 1 rows (policy.py)."""

    prior: tuple[float, ...]
    seconds: dict[int, float] = field(default_factory=dict)  # rows -> moving average
    samples: dict[int, int] = field(default_factory=dict)
    _since_refresh: int = field(default=0, init=False, repr=False)
    _table: tuple[float, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.prior) < 2 or self.prior[0] != 1.0:
            raise ValueError(f"a cost table starts at 1.0 and has two entries at least, "
                             f"got {self.prior!r}")
        self._table = tuple(self.prior)

    @property
    def table(self) -> tuple[float, ...]:
        return self._table

    def observe(self, rows: int, seconds: float) -> bool:
        """A decode step of `rows` rows took `seconds`; True when the table was recomputed."""
        if rows < 1 or not seconds > 0.0:
            return False
        count = self.samples.get(rows, 0)
        previous = self.seconds.get(rows, seconds)
        self.seconds[rows] = previous + SMOOTHING * (seconds - previous) if count else seconds
        self.samples[rows] = count + 1
        self._since_refresh += 1
        if self._since_refresh < REFRESH_EVERY:
            return False
        self._since_refresh = 0
        self._table = self._estimate()
        return True

    def _estimate(self) -> tuple[float, ...]:
        known = {n: s for n, s in self.seconds.items() if self.samples[n] >= MIN_SAMPLES}
        if not known:
            return tuple(self.prior)
        scale = statistics.median(s / relative_cost(n - 1, self.prior) for n, s in known.items())
        longest = max(len(self.prior), max(known))
        seconds = [known.get(n, scale * relative_cost(n - 1, self.prior))
                   for n in range(1, longest + 1)]
        table, highest = [], 0.0
        for s in seconds:  # relative to one row, never cheaper for more rows
            highest = max(highest, s / seconds[0])
            table.append(highest)
        return tuple(table)
