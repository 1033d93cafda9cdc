# One setup path for everything: a local virtual environment with the CPU build of torch pinned
# first (an unpinned torch would pull a multi-GB CUDA build), then paratrain itself.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup run test test-fast lint bench bench-federated bench-data-peer docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[report,datasets,test]'
	touch $@

run: setup          ## the built-in default job: a GPT on BPE shards of the stdlib source, data parallel, 2 processes
	$(VENV)/bin/paratrain run

# Two test processes: most of a test's time is its workers starting and meeting (imports, the
# rendezvous, sockets), which leaves a core idle; two at a time took the suite from 442 s to 285 s
# on 2 cores. A module's tests stay together (loadscope) so its shared fixture runs once.
test: setup         ## the whole suite (spawns real worker processes on free ports)
	$(PY) -m pytest -q -n 2 --dist loadscope

# The fast tier, for the edit loop: strategies trained in worker processes that stay up between
# tests (tests/conftest.py), none of the tests that start commands, kill workers or make clusters.
test-fast: setup    ## the fast tier only
	$(PY) -m pytest -q -n 2 --dist loadscope -m "not integration"

# ruff's rules and layout are in pyproject.toml ([tool.ruff]); `ruff format .` fixes the layout.
lint: setup         ## ruff: lint and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup        ## paratrain dp vs torch DDP, side by side
	$(VENV)/bin/paratrain bench dp

# The site (mkdocs + mkdocs-material) from docs/ and benchmarks/results/; --strict turns every
# warning (a broken link or anchor, a stale generated page) into a failure.
docs: $(VENV)/.docs-installed   ## the docs site in site/ (the configuration reference regenerated first)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[docs]'
	touch $@

# Flower in a venv of its own (its pins must not touch ours); <1.42: 1.42 needs a newer certifi
# than the package mirror holds
FLOWER_VENV ?= .venv-flower

$(FLOWER_VENV)/.installed:
	$(PYTHON) -m venv $(FLOWER_VENV)
	$(FLOWER_VENV)/bin/python -m pip install -q torch==2.13.0
	$(FLOWER_VENV)/bin/python -m pip install -q 'flwr[simulation]<1.42'
	touch $@

bench-federated: setup $(FLOWER_VENV)/.installed  ## paratrain federated vs Flower's simulation, side by side
	$(VENV)/bin/paratrain bench federated --flower-python $(FLOWER_VENV)/bin/python

bench-data-peer: .venv-mosaic/.installed  ## MosaicML Streaming, the peer of `paratrain bench data`, in a venv of its own

.venv-mosaic/.installed:
	$(PYTHON) -m venv .venv-mosaic
	.venv-mosaic/bin/python -m pip install -q torch==2.13.0 mosaicml-streaming==0.13.0
	touch $@

clean:
	rm -rf $(VENV) $(FLOWER_VENV) runs .pytest_cache site
