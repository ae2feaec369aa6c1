# rayfleet: `make demo` runs the end-to-end demo on a local fleet, `make test` runs every test.
# Both create the virtual environment and install everything on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-unit test-cluster test-integration bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to the 2.13.0 CPU build in pyproject.toml (an open range pulls CUDA).
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m rayfleet.demo

# Unit tests (no Ray) and cluster tests (one shared local fleet) in one session; the
# `ray up cluster.yaml` integration test owns its own cluster, so it runs alone afterwards.
test: setup
	$(PY) -m pytest tests/unit tests/cluster tests/gpu -q
	$(PY) -m pytest tests/integration -q

test-unit: setup
	$(PY) -m pytest tests/unit -q

test-cluster: setup
	$(PY) -m pytest tests/cluster -q

test-integration: setup
	$(PY) -m pytest tests/integration -q

bench: setup
	$(PY) benchmarks/placement.py
	$(PY) benchmarks/fp8_parity.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
