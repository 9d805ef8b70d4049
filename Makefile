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

# The browser tier (tests/test_browser.py) drives Debian's Chromium; it never
# downloads browser builds. `system-deps` (below) installs it when missing;
# a tier that cannot run skips, printing why (-rs); a test that passed only when
# run again (PyTorch's suites may, once) is named in the summary too (-rR).
CHROMIUM ?= /usr/bin/chromium
PYTEST   := $(PY) -m pytest -q -rsR

.PHONY: lab test test-gpu test-fast test-oldest test-python test-notebooks test-torch-suites test-browser test-slurm screenshots system-deps browser-deps lint bench clean

# $(call install,EXTRAS): the environment, torch first (pinned: an unpinned torch
# would pull gigabytes of CUDA packages), then nbrpc with EXTRAS.
define install
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[$(1)]'
	touch $@
endef

# The test extras hold the lab's, so the test environment also serves `make lab`.
$(STAMP): pyproject.toml
	$(call install,test)
	touch $(LAB_STAMP)

$(LAB_STAMP): pyproject.toml
	$(call install,lab)

# JupyterLab on the tutorials, as root or not (tools/lab.py adds --allow-root for
# root and prints the URL): opened from copies in $(LAB_DIR)/, made once and never
# overwritten, so a reader's runs and autosaves leave the tracked notebooks/ clean.
# Extra JupyterLab arguments: make lab LAB_ARGS="--port 9999 --no-browser".
LAB_DIR  ?= lab
LAB_ARGS ?=
lab: $(LAB_STAMP)
	@mkdir -p $(LAB_DIR)
	@for nb in notebooks/*.ipynb; do \
	  [ -e "$(LAB_DIR)/$${nb#notebooks/}" ] || cp "$$nb" "$(LAB_DIR)/"; \
	done
	$(PY) tools/lab.py $(LAB_DIR) $(LAB_ARGS)

# The tutorials are compared with their saved outputs (nbval) inside the suite, in
# the environment binder/ builds (tests/test_binder.py): they run once, as Binder
# would run them. `make test-notebooks` runs nbval in this environment instead.
# The 25 slowest tests are listed at the end: what to look at when CI nears 30 minutes.
test: $(STAMP) system-deps
	$(PY) -m ruff check nbrpc tests benchmarks examples tools
	$(PYTEST) --durations=25

# The tiers that start no processes (no engines, workers, browser or namespaces).
FAST := not multiprocess and not torch_rpc and not cluster and not netns and not slurm \
        and not mpi and not browser and not faults and not binder and not torch_suites and not lab

test-fast: $(STAMP)
	$(PYTEST) -m "$(FAST)"

# $(call side_install,VENV,PIP_OPTIONS,TORCH): into an environment beside .venv,
# torch first (TORCH), then nbrpc with its test extras; PIP_OPTIONS for both.
define side_install
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet $(2) $(3)
	$(1)/bin/python -m pip install --quiet $(2) -e '.[test]'
endef

# The floors pyproject.toml gives its dependencies, checked: .venv-oldest holds
# the oldest release each admits (tools/oldest.py pins them) and runs the fast
# tiers. Not part of make test: PyPI's torch is a CUDA build (about 4 GB with
# its nvidia-* packages; the pinned CPU wheel exists only for torch 2.13).
OLDEST := .venv-oldest
test-oldest: $(STAMP)
	$(PYTHON) -m venv $(OLDEST)
	$(PY) tools/oldest.py > $(OLDEST)/pins.txt
	$(call side_install,$(OLDEST),-c $(OLDEST)/pins.txt,torch)
	$(OLDEST)/bin/python -m pip list 2>/dev/null | grep -iE "^($$(cut -d= -f1 $(OLDEST)/pins.txt | paste -sd'|')) "
	$(OLDEST)/bin/python -m pytest -q -rsR -m "$(FAST)"

# Another Python than make test's (nbrpc admits 3.11 and later): the fast tiers
# in .venv-python, e.g. make test-python OTHER_PYTHON=python3.13. Not part of
# make test either: torch for another Python is PyPI's CUDA build (about 5 GB).
OTHER_PYTHON ?= python3.12
OTHER_VENV   := .venv-python
test-python:
	$(OTHER_PYTHON) -m venv --clear $(OTHER_VENV)
	$(call side_install,$(OTHER_VENV),,torch==2.13.0)
	$(OTHER_VENV)/bin/python -m pytest -q -rsR -m "$(FAST)"

test-notebooks: $(STAMP)
	$(PYTEST) $(NBVAL) notebooks/

# PyTorch's own RPC test suites against nbrpc (tests/torch_suites.py says which),
# also part of `make test`; NBRPC_TORCH_SUITES=all runs the excluded and
# known-failing ones too, NBRPC_TORCH_SUITES=known-failing only those.
test-torch-suites: $(STAMP)
	$(PYTEST) tests/test_torch_suites.py

# The Slurm tier only: a real Slurm cluster on network-namespace hosts (root).
test-slurm: $(STAMP) system-deps
	$(PYTEST) -s -m slurm tests/test_slurm.py

# The widgets in JupyterLab + Chromium only (tutorials 07, 08 and tests/browser/*.ipynb).
test-browser: $(STAMP) browser-deps
	$(PYTEST) -s tests/test_browser.py

# The README's images: the browser tier's screenshots, written to docs/img.
screenshots: $(STAMP) browser-deps
	NBRPC_SCREENSHOTS=$(CURDIR)/docs/img $(PYTEST) tests/test_browser.py

# On a host with a GPU and a CUDA build of torch (not the CPU wheel this
# environment pins): nbrpc's cuda tier, the benchmark's CUDA rows, then
# PyTorch's CUDA RPC suite against nbrpc (tools/test_gpu.sh says more), e.g.
# make test-gpu GPU_PYTHON=python3. Without a GPU it says so, and skips.
GPU_PYTHON ?= $(PY)
test-gpu:
	tools/test_gpu.sh $(GPU_PYTHON)

# Debian packages the test tiers drive: Chromium (browser tier), Slurm and munge
# (slurm tier), Open MPI (mpi tier). Installed when missing and we may (root, or password-less sudo,
# with apt-get); if that fails the build goes on and those tiers skip, saying why.
system-deps:
	@missing=; \
	{ [ -n "$$NBRPC_CHROMIUM" ] || [ -x "$(CHROMIUM)" ] || command -v chromium >/dev/null 2>&1; } \
	  || missing="chromium fonts-liberation"; \
	{ command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; } \
	  || missing="$${missing:+$$missing }slurm-wlm munge"; \
	command -v mpiexec >/dev/null 2>&1 || missing="$${missing:+$$missing }openmpi-bin"; \
	if [ -z "$$missing" ]; then \
	  exit 0; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "system-deps: missing $$missing and no apt-get: their test tiers will skip"; \
	else \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else echo "system-deps: missing $$missing, and apt-get needs root: their test tiers" \
	            "will skip (run: sudo apt-get install -y $$missing)"; exit 0; fi; \
	  echo "system-deps: installing Debian's $$missing with apt-get"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null 2>&1 \
	  || { $$SUDO apt-get update -qq && \
	       $$SUDO apt-get install -y -qq --no-install-recommends $$missing; } \
	  || echo "system-deps: apt-get could not install $$missing: their test tiers will skip"; \
	fi

browser-deps: system-deps

lint: $(STAMP)
	$(PY) -m ruff check nbrpc tests benchmarks examples tools

bench: $(STAMP)
	$(PY) benchmarks/bench_rpc.py
	$(PY) benchmarks/bench_cluster.py
	$(PY) benchmarks/bench_security.py
	$(PY) benchmarks/bench_compute.py

clean:
	rm -rf $(VENV) $(OLDEST) *.egg-info .pytest_cache
