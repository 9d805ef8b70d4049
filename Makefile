# Set-up is two commands on a fresh machine: `make lab` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test test-fast lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: an unpinned torch would pull gigabytes of CUDA packages
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# For now: the script-mode tutorial example (JupyterLab arrives with the cluster magics).
lab: $(STAMP)
	$(PY) examples/script_mode.py

test: $(STAMP)
	$(PY) -m ruff check nbrpc tests benchmarks examples
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not multiprocess and not torch_rpc"

lint: $(STAMP)
	$(PY) -m ruff check nbrpc tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/bench_rpc.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
