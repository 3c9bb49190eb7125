"""Drivers and per-engine runners: `run` (one workload on one engine), `run_suite` (every planned
run, each in a fresh process, then charts and docs) and `run_core` (kvmemo's core figures).

Stdlib only at import, like runners/engines/: the peers' virtualenvs import this package."""
