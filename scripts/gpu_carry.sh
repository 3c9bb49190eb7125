#!/usr/bin/env bash
# Prepares, on a machine with the registry and the project's .venv, what scripts/gpu_check.sh
# needs on a GPU machine without one: wheels of the packages its image lacks (.whl/) and the
# bundled model cut into pieces under 50 MB (.gpu/), both ignored by git (.git/info/exclude).
#   scripts/gpu_carry.sh [python-version]      (default 3.12, the GPU image's)
set -eu
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
mkdir -p .whl .gpu
# gguf: transformers reads GGUF files with it (the HF oracle); the image lacks it.
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp --platform manylinux_2_28_x86_64 -d .whl gguf==0.19.0
MODEL=$(.venv/bin/python -c "from kvmemo.model.loading.loader import bundled_model_path as p; print(p())")
rm -f .gpu/model.part*
split -b 50000000 -d "$MODEL" .gpu/model.part
sha256sum "$MODEL" >.gpu/model.sha256
# A tiny random Llama with the bundled tokenizer (23 MB): the CUDA graph checks need no weights.
rm -rf .gpu/tiny_llama
.venv/bin/python -c "from pathlib import Path; from tests.gpu.tiny_llama import save_tiny_llama; \
save_tiny_llama(Path('.gpu/tiny_llama'))" >/dev/null
ls -l .whl .gpu
