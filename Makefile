# One setup path for everything: a local virtual environment with the CPU build of torch pinned
# first (an unpinned torch would pull a multi-GB CUDA build), then paratrain itself.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup run test test-fast lint typecheck bench bench-federated bench-data-peer gpu-check docs clean

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
# on 2 cores. A module's tests stay together (loadscope) so its shared fixture runs once. The
# slowest 25 are listed at the end: where the suite's time goes, in every CI log.
test: setup         ## the whole suite (spawns real worker processes on free ports)
	$(PY) -m pytest -q -n 2 --dist loadscope --durations=25

# The fast tier, for the edit loop: strategies trained in worker processes that stay up between
# tests (tests/conftest.py), none of the tests that start commands, kill workers or make clusters.
test-fast: setup    ## the fast tier only
	$(PY) -m pytest -q -n 2 --dist loadscope -m "not integration"

# ruff's rules and layout are in pyproject.toml ([tool.ruff]); `ruff format .` fixes the layout.
lint: setup         ## ruff: lint and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy's settings are in pyproject.toml ([tool.mypy]): src/ only, bodies of unannotated functions
# checked too; third-party packages without type information are listed there one by one.
typecheck: setup    ## mypy over src/ (static types: a shadowed name called, a None used, a wrong argument)
	$(VENV)/bin/mypy

bench: setup        ## paratrain dp vs torch DDP, side by side
	$(VENV)/bin/paratrain bench dp

# On a machine with CUDA GPUs (docs/gpus.md): tests/test_gpu.py, every strategy at world 1 eager and
# compiled (benchmarks/gpu_matrix.py), then benchmarks/gpu.py, whose results file
# (benchmarks/results/gpu-DATE.md) keeps the other two's logs. It runs with our venv where there is
# one, else with the image's python3 and the torch it has (no `make setup`: that pins the CPU build).
# Without a GPU: one line, exit 0.
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))

gpu-check:          ## the GPU path: its tests, the strategy matrix, the benchmark (skips without a GPU)
	@PYTHONPATH=src $(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; \
	case $$? in 0) ;; 3) echo "gpu-check: skipped, no CUDA GPU on this machine"; exit 0 ;; \
	  *) echo "gpu-check: $(GPU_PY) cannot import torch (make setup, or a python3 with torch)"; exit 1 ;; esac; \
	logs=$$(mktemp -d); failed=0; \
	PYTHONPATH=$(CURDIR)/src:$(CURDIR)/tests $(GPU_PY) -m pytest -q -p no:cacheprovider -n 4 tests/test_gpu.py \
	  >$$logs/test_gpu.txt 2>&1 & tests=$$!; \
	PYTHONPATH=$(CURDIR)/src $(GPU_PY) benchmarks/gpu_matrix.py >$$logs/gpu_matrix.txt 2>&1 || failed=1; \
	wait $$tests || failed=1; \
	cat $$logs/test_gpu.txt $$logs/gpu_matrix.txt; \
	PYTHONPATH=$(CURDIR)/src $(GPU_PY) benchmarks/gpu.py --results benchmarks/results \
	  --attach $$logs/test_gpu.txt --attach $$logs/gpu_matrix.txt || failed=1; \
	rm -rf $$logs; exit $$failed

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
