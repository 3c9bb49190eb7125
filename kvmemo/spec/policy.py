"""How many drafted tokens a step verifies: the length whose expected kept tokens per unit of
step cost is highest, from the request's acceptance so far and what k + 1 rows cost here.

A draft of k tokens, each kept with probability a once the ones before it were, yields
1 + a + ... + a^k tokens for a step that costs C(k) plain decode steps. On a CPU every extra
row costs its share of the products (the int8 kernel is compute-bound past a few rows), so C(k)
climbs about 0.15 a row and long drafts pay only when they are likely kept.

In a batch the same table prices the step's rows: with `rows` sequences decoding, a draft of k
is worth its place when the step's tokens per unit of cost, (rows - 1 + 1 + a + ... + a^k) /
C(rows - 1 + k), beat the plain step's rows / C(rows - 1). One sequence alone is the rule above;
at 16 rows a CPU's extra rows cost as much as the plain ones, so drafts stop there (served, at
concurrency 16, verifying every draft ran at 0.91x the plain server, docs/benchmarks.md), while a
GPU's flat table keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence

# One step verifying k drafted tokens, in plain decode steps (k = 0, 1, ...), SmolLM2-135M at a
# 512-token context, 2 cores, Sapphire Rapids, native ISA: the mean of two sittings of
# benchmarks/micro/bench_spec_verify.py (docs/benchmarks.md), made non-decreasing; native
# measured with the repacked int8 kernel (1ffc761). Past the table: its last slope.
CPU_NATIVE_COST = (1.00, 1.25, 1.41, 1.52, 1.67, 1.79, 1.93, 2.15, 2.33, 2.41, 2.57, 2.73,
                   2.95, 3.13, 3.27, 3.44, 3.75)
CPU_DENSE_COST = (1.00, 1.12, 1.22, 1.56, 1.56, 1.59, 1.76, 1.80, 1.86, 1.99, 2.04, 2.17,
                  2.24, 2.37, 2.40, 2.55, 2.75)
# A GPU's decode step reads the weights once for any few rows.
GPU_COST = tuple(1.0 + 0.02 * k for k in range(17))

# What a request's acceptance is taken to be before its drafts are judged, and how many
# drafted tokens' worth of weight that guess carries.
PRIOR_ACCEPTANCE = 0.7
PRIOR_WEIGHT = 4.0


def cost_table(device_type: str, weights: str) -> tuple[float, ...]:
    if device_type != "cpu":
        return GPU_COST
    return CPU_NATIVE_COST if weights == "native" else CPU_DENSE_COST


def relative_cost(k: int, table: Sequence[float]) -> float:
    if k < len(table):
        return table[k]
    slope = table[-1] - table[-2]
    return table[-1] + slope * (k - len(table) + 1)


def acceptance(num_accepted: int, num_rejected_drafts: int) -> float:
    """Per-token acceptance: kept tokens over kept tokens plus the drafts cut short (each
    rejection ends one run of kept tokens), with the prior's weight."""
    return (num_accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (
        num_accepted + num_rejected_drafts + PRIOR_WEIGHT
    )


def best_length(limit: int, rate: float, table: Sequence[float], rows: int = 1) -> int:
    """The k in [0, limit] with the most expected tokens per unit of cost of a step that decodes
    `rows` sequences, this one included (0: no draft)."""
    others = max(rows, 1) - 1
    best, best_value = 0, (others + 1.0) / relative_cost(others, table)
    expected, term = 1.0, 1.0
    for k in range(1, limit + 1):
        term *= rate
        expected += term
        value = (others + expected) / relative_cost(others + k, table)
        if value > best_value:
            best, best_value = k, value
    return best
