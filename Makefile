# Every target builds what it needs from scratch: a fresh clone needs only python3 (>= 3.11).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo demo-down test chaos lint typecheck check bench bench-quick bench-skyserve soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The demo needs corral alone: its own lean venv (pip install -e ., no test tools), not the
# development one (Ray, Playwright, schemathesis, mypy: over 600 MB for `make test`).
DEMO_VENV ?= .venv-demo
DEMO_PY := $(DEMO_VENV)/bin/python
DEMO_STAMP := $(DEMO_VENV)/.installed
# The demo's home: examples/run_demo.py uses $CORRAL_HOME when set, so demo-down does too.
DEMO_HOME := $(if $(CORRAL_HOME),$(CORRAL_HOME),$(CURDIR)/.corral-demo)

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_PY) -m pip install --quiet --upgrade pip
	$(DEMO_PY) -m pip install --quiet -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_PY) examples/run_demo.py

demo-down: $(DEMO_STAMP)
	CORRAL_HOME=$(DEMO_HOME) $(DEMO_PY) -m corral down --all -y
	CORRAL_HOME=$(DEMO_HOME) $(DEMO_PY) -m corral daemon stop --all

test: $(STAMP)
	$(PY) -m pytest -n 2 --durations=25 tests  # the slowest 25: the run's budget is ~15 min

# The long chaos suite (the default `make test` runs the short version of each chaos test).
CHAOS_REPORT ?= $(CURDIR)/chaos-report.jsonl
chaos: $(STAMP)
	rm -f $(CHAOS_REPORT)
	CORRAL_CHAOS=long CORRAL_CHAOS_REPORT=$(CHAOS_REPORT) $(PY) -m pytest -n 2 tests/chaos; \
	  status=$$?; $(PY) tests/chaos/summarize.py $(CHAOS_REPORT) && exit $$status

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

# corral's autoscaler against SkyPilot's own RequestRateAutoscaler, offline on the same traces.
# SkyPilot is a benchmark-only dependency: it lives in its own venv, never in corral's.
SKY_VENV ?= .venv-sky
SKYPILOT_VERSION ?= 0.14.1
SKY_STAMP := $(SKY_VENV)/.installed-$(SKYPILOT_VERSION)

$(SKY_STAMP): pyproject.toml
	$(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SKY_VENV)/bin/python -m pip install --quiet -e . 'skypilot==$(SKYPILOT_VERSION)'
	touch $(SKY_STAMP)

bench-skyserve: $(SKY_STAMP)
	$(SKY_VENV)/bin/python bench/autoscale_vs_skyserve.py

# 30 minutes of load and churn against one daemon: do its memory and fds stay flat?
soak: $(STAMP)
	$(PY) bench/soak.py

clean:
	rm -rf $(VENV) $(SKY_VENV) $(DEMO_VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
