# Set-up is two commands on a fresh machine: `make lab` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Stamps: torch, nbrpc and the test tools / torch, nbrpc and JupyterLab.
STAMP     := $(VENV)/.installed
LAB_STAMP := $(VENV)/.installed-lab

# The tutorial notebooks, executed and compared with their saved outputs.
# The sanitize file masks what varies between runs (hosts, pids); each cell is
# bounded (a cell that hangs is interrupted and fails).
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
          --nbval-cell-timeout=90

.PHONY: lab test test-fast test-notebooks lint bench clean

# $(call install,EXTRAS): the environment, torch first (pinned: an unpinned torch
# would pull gigabytes of CUDA packages), then nbrpc with EXTRAS.
define install
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[$(1)]'
	touch $@
endef

$(STAMP): pyproject.toml
	$(call install,test)

$(LAB_STAMP): pyproject.toml
	$(call install,lab)

# JupyterLab on the tutorials (`make test` does not install JupyterLab: CI time).
lab: $(LAB_STAMP)
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 notebooks/

test: $(STAMP)
	$(PY) -m ruff check nbrpc tests benchmarks examples
	$(PY) -m pytest -q
	$(PY) -m pytest -q $(NBVAL) notebooks/

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not multiprocess and not torch_rpc and not cluster and not netns"

test-notebooks: $(STAMP)
	$(PY) -m pytest -q $(NBVAL) notebooks/

lint: $(STAMP)
	$(PY) -m ruff check nbrpc tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/bench_rpc.py
	$(PY) benchmarks/bench_cluster.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
