# `make test` sets up everything from a fresh machine: the virtual environment .venv/, the CPU
# build of PyTorch (pinned: an unpinned torch pulls a multi-GB CUDA build), the package in
# editable mode with its console scripts, and what the tests need; then it runs the suite.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test demo setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[test,report,train,triton,hf]"
	touch $(STAMP)

# Two workers (pytest-xdist), one thread each (tests/conftest.py); the tests that share a
# launched job or a trained comparison carry one xdist_group, so that one worker runs it once.
# Timings: docs/BENCHMARKS.md.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

demo: $(STAMP)
	$(VENV)/bin/attnres compare

clean:
	rm -rf $(VENV) build *.egg-info
