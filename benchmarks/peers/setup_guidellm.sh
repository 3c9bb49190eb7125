#!/usr/bin/env bash
# GuideLLM (vLLM project's load generator) in its own virtualenv: its synthetic-data benchmark
# runs against `kvmemo serve` (benchmarks.runners.guidellm_bench), as a user would run it.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv-guidellm
.venv-guidellm/bin/pip install -q --upgrade pip
# The CPU build of torch lies on disk, should anything pull torch in (an unpinned one is CUDA).
.venv-guidellm/bin/pip install -q torch==2.13.0
.venv-guidellm/bin/pip install -q "guidellm==0.8.1"
.venv-guidellm/bin/guidellm --help | head -5
