#!/usr/bin/env bash
# llama-cpp-python in its own virtualenv (compiled from source here: about 10 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv-llamacpp
.venv-llamacpp/bin/pip install -q --upgrade pip
.venv-llamacpp/bin/pip install -q numpy "llama-cpp-python==0.3.36"
.venv-llamacpp/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
