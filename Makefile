# attnx: `make test` and `make bench` each set everything up on a fresh machine (.venv, torch, build tools,
# an editable build of attnx), then test or benchmark.
#
#   make test                       build, then run the test suite
#   make bench                      build, then run every benchmark (BENCH_ARGS=--quick for a short run)
#   make test TORCH=torch==2.13.0   the same against a CPU-only torch (in a fresh VENV, or after make clean)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Plain `torch` resolves to the CUDA build where one is available, so the CUDA kernels compile too.
TORCH ?= torch
BENCH_ARGS ?=

SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: test bench build clean

test: build
	$(PY) -m pytest

bench: build
	$(PY) -m benchmarks $(BENCH_ARGS)

build: $(VENV)/.built

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)" ninja setuptools wheel pytest numpy expecttest
	touch $@

# No build isolation: an isolated build would fetch a second torch and break the ABI match with this one.
$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	@echo "building attnx (log: $(VENV)/build.log)"
	@$(PY) -m pip install -v --no-build-isolation --no-deps -e . > $(VENV)/build.log 2>&1 \
		|| (tail -n 60 $(VENV)/build.log; exit 1)
	@grep -m1 -E "^ *attnx: building" $(VENV)/build.log | sed "s/^ *//"
	touch $@

clean:
	rm -rf $(VENV) build python/attnx/_C*.so python/attnx/_build_info.py
