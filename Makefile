# The two commands of the quick start: `make train` and `make test`. Both prepare .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# DeepSpeed compiles its C++ ops on first use; keep them with the environment so they are built once.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
# torch.compile's generated code (config `compile`), kept the same way: a second `make test`
# reuses it instead of compiling again.
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/$(VENV)/inductor_cache
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup train test test-fast docs docs-check bench bench-collectives bench-runner bench-memory bench-checkpoint bench-compile bench-heartbeat bench-guard lint

setup:
	@bash tools/bootstrap.sh

train: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node 2 tools/train.py configs/digits_ddp.yaml --launcher pytorch

# Two pytest workers: most tests wait on processes they started (6:35 instead of 9:05 on 2 cores
# when the suite was smaller; a third worker gained 2 % on 2026-11-28). On 2 AMD EPYC cores
# (2026-11-28): `make test` about 30 minutes, `make test-fast` 7:40 (9 tests in 10).
# --dist loadgroup: the tests sharing a trained run (tests/runs.py) go to one worker, which
# trains it once
PYTEST := $(PY) -m pytest -q -ra -n 2 --dist loadgroup --durations=25

# Where PYTHONDONTWRITEBYTECODE is set (some CI images set it) Python compiles trainrun again in
# each of the suite's 900 or so processes (0.2 s of CPU each): compile it once, first
COMPILE := $(PY) -m compileall -q trainrun tests tools > /dev/null

test: setup
	@$(COMPILE)
	$(PYTEST)

test-fast: setup
	@$(COMPILE)
	$(PYTEST) -m "not slow"

# The documentation site, into site/ (open site/index.html); warnings are errors, as in the tests
docs: setup
	$(VENV)/bin/sphinx-build -W --keep-going -n -q -b html docs site
	@echo "site/index.html"

# The built site in headless Chromium: screenshots of the home page and the tutorial in
# site/_screenshots/, and a check that they show navigation, search and content
docs-check: docs
	$(PY) tools/docs_check.py site

bench: bench-collectives bench-runner bench-memory bench-checkpoint bench-compile bench-heartbeat bench-guard

bench-collectives: setup
	@bash bench/run_collectives.sh

bench-runner: setup
	@bash bench/run_runner_overhead.sh

bench-memory: setup
	OMP_NUM_THREADS=1 $(PY) bench/memory.py

bench-checkpoint: setup
	OMP_NUM_THREADS=1 $(PY) bench/checkpoint.py

bench-compile: setup
	@bash bench/run_compile.sh

bench-heartbeat: setup
	OMP_NUM_THREADS=1 $(PY) bench/heartbeat_scale.py

bench-guard: setup
	OMP_NUM_THREADS=1 $(PY) bench/guard.py

lint: setup
	$(VENV)/bin/ruff check trainrun tests tools bench
