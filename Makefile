# Every target builds what it needs from scratch: a fresh clone needs only python3 (>= 3.11).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo demo-down test lint typecheck check bench bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/run_demo.py

demo-down: $(STAMP)
	CORRAL_HOME=$(CURDIR)/.corral-demo $(PY) -m corral down --all
	CORRAL_HOME=$(CURDIR)/.corral-demo $(PY) -m corral daemon stop

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy src

check: lint typecheck test

bench: $(STAMP)
	$(PY) bench/jobs_vs_processes.py

bench-quick: $(STAMP)
	$(PY) bench/jobs_vs_processes.py --quick

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
