# Two entry points: `make demo` and `make test`. Both create .venv on first use.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-kernels check lint typecheck format bench clean

# Other kernel paths for the bitwise tests (see docs/runtime.md, "What bitwise rests on"): ATen's
# scalar kernels instead of AVX2/AVX-512 (its matmuls round differently too) and oneDNN's SSE4.1
# convolutions. They change the bits of the ops measured (bench/bench_kernel_paths.py shows
# which), so a split that matches autograd only by a kernel's luck fails under them.
OTHER_KERNELS := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

# torch is installed first and pinned: it comes from the local CPU wheel.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/zerobubble demo

# The suite runs on WORKERS xdist processes (one per core of the 2-core CI machine); a test
# module stays on one worker (its module-scoped launches run once), and the workers share the
# schedules they generate (tests/generated.py). WORKERS=0 runs it in this process.
WORKERS ?= 2
XDIST   := -n $(WORKERS) --dist loadscope

test: $(STAMP)  ## the whole suite (slow tests included), the bitwise tests on other kernels, the checks
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(XDIST)
	$(MAKE) --no-print-directory test-kernels check

test-kernels: $(STAMP)  ## the kernel-resting bitwise claims again, on other kernel paths
	$(OTHER_KERNELS) OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(XDIST) -m kernels

check: lint typecheck  ## what CI enforces besides the tests

typecheck: $(STAMP)  ## mypy: strict on the torch-free layers (schedule, program, trace; see pyproject.toml)
	$(BIN)/mypy

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

format: $(STAMP)
	$(BIN)/ruff format src tests bench examples
	$(BIN)/ruff check --fix src tests bench examples

bench: $(STAMP)  ## schedule-level benchmarks (quick); see bench/ for the runtime ones
	OMP_NUM_THREADS=1 $(BIN)/python bench/bench_schedules.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/bench_paper.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/bench_search_speed.py

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info .pytest_cache
