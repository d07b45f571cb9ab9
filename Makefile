# Both targets do all set-up themselves on a fresh Debian machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# What each target needs, installed once: the demo the worker extra (engine, worker and the
# client) on CPU torch; tests and lint every extra but gpu (CuPy, for a CUDA device).
BASE_STAMP := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
# Where torch's CPU wheel comes from: pip's own indexes by default (they serve the CPU build
# here); on a machine whose pip reaches PyPI, whose Linux wheel is the CUDA build, pass
# TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_INDEX ?=

.PHONY: demo test lint setup redis-server clean

setup: $(STAMP) redis-server

$(BASE_STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	# The CPU wheel first: anything else would pull a multi-GB CUDA build.
	$(VPY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[worker]'
	touch $(BASE_STAMP)

$(STAMP): $(BASE_STAMP)
	$(VPY) -m pip install --quiet -e '.[test,worker,kernels,gateway,celery,structured]'
	touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	  else \
	    echo "redis-server is missing: run 'sudo apt-get install redis-server' and retry"; exit 1; \
	  fi; }

demo: $(BASE_STAMP) redis-server
	$(VPY) -m benchmarks.demo

lint: setup
	$(VENV)/bin/ruff check engine worker producer tests benchmarks
	$(VENV)/bin/mypy engine worker producer

test: setup lint
	$(VPY) -m pytest -q -x --durations=25 tests

clean:
	rm -rf $(VENV)
