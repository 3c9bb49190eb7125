#!/usr/bin/env bash
# lm-evaluation-harness in its own virtualenv, as a user would run it: its `local-completions`
# client against `kvmemo serve`, and its `hf` backend on the same GGUF as the reference
# (benchmarks.runners.lm_eval_compare runs both).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv-lmeval
.venv-lmeval/bin/pip install -q --upgrade pip
# The CPU build of torch lies on disk; an unpinned torch would pull a multi-GB CUDA build.
.venv-lmeval/bin/pip install -q torch==2.13.0
.venv-lmeval/bin/pip install -q "lm-eval[hf,api]==0.4.13" "gguf>=0.10"
.venv-lmeval/bin/python -c "import lm_eval; print('lm_eval', lm_eval.__version__)"
