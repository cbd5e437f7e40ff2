# Two entry points for a fresh machine:
#   make demo   sets everything up and runs the quickstart
#   make test   sets everything up and runs the test suite
# and, for a developer's loop, make test-fast: the suite less its `slow` tests (the whole
# searches, compiles and multi-process trials).
#
# PyTorch is installed first, on its own, so that pip never resolves `torch`
# to the multi-gigabyte CUDA build on a machine without a GPU. Override
# TORCH_SPEC (for example with a CUDA index) on a GPU machine.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint clean

$(BIN)/mbtune: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --upgrade pip
	$(BIN)/python -m pip install -qq $(TORCH_SPEC)
	$(BIN)/python -m pip install -qq -e ".[dev]"
	touch $(BIN)/mbtune

setup: $(BIN)/mbtune

demo: setup
	$(BIN)/mbtune run experiments/quickstart.yaml

# two pytest-xdist workers; tests/conftest.py puts the tests of the session's Ray in one
# group, on one worker. A worker that dies (a test past its timeout) is not replaced: under
# --dist loadgroup the replacement can wait forever for work (pytest-xdist issues 1323,
# 1327, 1378), where the run should end, naming the test.
# The suite keeps compiled bytecode (in __pycache__, which git ignores) even where the
# environment asks Python not to write it (PYTHONDONTWRITEBYTECODE): each pytest worker
# would rewrite every test module's asserts, and each of the suite's few hundred Python
# processes (Ray's workers, trial processes, mbtune commands) compile mbtune anew, 3-7% of
# the CPU of the tests measured (docs/benchmarks.md)
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n 2 --dist loadgroup --max-worker-restart=0

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
