# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv on first use
# (torch first, pinned through constraints.txt so the CPU wheel is used) and reuse it afterwards.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lingctl-installed

.PHONY: demo test bench-deps

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt torch
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest

# The peers that bench/ measures against (transformers for flood); not needed to run or test lingctl.
bench-deps: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,bench]'
