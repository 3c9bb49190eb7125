#!/usr/bin/env bash
# HF transformers in its own virtualenv: the same GGUF, dequantized to fp32, one request at a time.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv-hf
.venv-hf/bin/pip install -q --upgrade pip
# The CPU build of torch lies on disk; an unpinned torch would pull a multi-GB CUDA build.
.venv-hf/bin/pip install -q torch==2.13.0
.venv-hf/bin/pip install -q numpy "transformers>=4.46" "gguf>=0.10" accelerate
.venv-hf/bin/python -c "import transformers; print('transformers', transformers.__version__)"
