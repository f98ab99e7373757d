# attnx: `make test` and `make bench` each set everything up on a fresh machine (.venv, torch, build tools,
# an editable build of attnx), then test or benchmark.
#
#   make test                       build, lint (ruff), then run the test suite
#   make bench                      build, then run every benchmark (BENCH_ARGS=--quick for a short run,
#                                   BENCH_ARGS="--only train" for one case; see benchmarks/README.md)
#   make test-cpu-torch             the test suite against the CPU-only torch 2.13.0 (in build/cpu-torch)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Plain `torch` resolves to the CUDA build where one is available, so the CUDA kernels compile too.
TORCH ?= torch
BENCH_ARGS ?=
# The model libraries that tests/test_transformers.py, test_convert_timm.py and test_convert_open_clip.py run
# against (the versions they were verified with). timm and open_clip need torchvision, whose build must match
# torch's: test-cpu-torch installs transformers alone and those tests skip there, saying why.
MODEL_LIBS ?= transformers==5.23.0 timm==1.0.31 open-clip-torch==3.3.0 torchvision==0.29.1

SOURCES := $(shell find csrc metal -type f) setup.py pyproject.toml

.PHONY: test test-cpu-torch bench bench-deps build clean tools lint models

test: build tools lint models
	$(PY) -m pytest

models: $(VENV)/.models

$(VENV)/.models: $(VENV)/.deps
	$(PY) -m pip install --quiet $(MODEL_LIBS)
	touch $@

# ruff with the config in pyproject.toml; a finding fails the test run.
lint: $(VENV)/.deps
	$(PY) -m ruff check python tests benchmarks upstream setup.py metal

# The Metal emulation tier (tests/test_metal_emulation.py) compiles metal/*.metal with clang++. Installed here
# when missing and this is a root shell with apt-get (CI's fresh machine); otherwise those tests skip, saying so.
tools:
	@command -v clang++ >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing clang (Metal emulation tests)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null; \
		else \
			echo "note: no clang++: the Metal emulation tests will be skipped (apt-get install clang)"; \
		fi; }

# The same suite against the CPU-only torch 2.13.0, built in a copy of the tree so the two builds share no file.
test-cpu-torch:
	rm -rf build/cpu-torch && mkdir -p build/cpu-torch
	cp -r csrc metal python tests benchmarks upstream setup.py pyproject.toml README.md Makefile build/cpu-torch/
	rm -f build/cpu-torch/python/attnx/_C*.so build/cpu-torch/python/attnx/_build_info.py
	$(MAKE) -C build/cpu-torch test TORCH=torch==2.13.0 MODEL_LIBS=transformers==5.23.0

bench: build bench-deps
	$(PY) -m benchmarks $(BENCH_ARGS)

# matplotlib draws the benchmark plots and the models case runs transformers' models (the version the tests
# use); the test suite does not need matplotlib, so `make test` does not install it. The recipe runs again when
# this file changes, so a .venv set up before a library was added here gets it too.
bench-deps: $(VENV)/.bench-deps

$(VENV)/.bench-deps: $(VENV)/.deps Makefile
	$(PY) -m pip install --quiet matplotlib $(filter transformers%,$(MODEL_LIBS))
	touch $@

build: $(VENV)/.built

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)" ninja setuptools wheel pytest numpy expecttest ruff
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
