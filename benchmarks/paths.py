"""Where the benchmarks' inputs and outputs live (stdlib only: the peers' virtualenvs import it)."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent  # the repository root: the cwd every benchmark module is run from
RESULTS = BENCHMARKS / "results"  # result JSON, tracked in git
PEER_RESULTS = RESULTS / "peers"  # one JSON per (engine, workload, mode) run of runners.run_suite
DATA = BENCHMARKS / "data"  # fixed inputs (the perplexity text)
NOTES = BENCHMARKS / "notes.md"  # hand-written analysis, appended to docs/benchmarks.md
PEERS = BENCHMARKS / "peers"  # setup scripts; the peers' venvs and checkpoint land here (ignored)
GENERATED_WORKLOADS = BENCHMARKS / "generated_workloads"  # workloads as JSON token ids (ignored)
DOCS = ROOT / "docs"
