# make test : create .venv if missing, install longctx with its test deps, run the suite (both
#             processes; on a GPU machine the `gpu` tests too).
# make demo : same set-up, then decode with the embedded tiny model on the CPU (launch/decode.py).
# Where python3 can already import torch (a GPU machine), .venv reuses that torch; otherwise a
# CPU build of torch is installed (never a multi-GB CUDA download).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
TRITON_CPU ?= triton==3.6.0

.PHONY: test demo setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@if [ ! -x $(PY) ]; then $(PYTHON) -m venv $(VENV); fi
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "reusing the torch that $(PYTHON) already has"; \
		$(PYTHON) -c "import site, sys; print('\n'.join(site.getsitepackages()))" \
			> "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_host_site.pth"; \
	elif ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q "$(TORCH_CPU)" "$(TRITON_CPU)"; \
	fi
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

# pytest-xdist workers per process: one per core where there is no CUDA (CI's 2 cores: the suite
# in ~8 minutes instead of ~12); where CUDA is, 8 (half the cores if fewer), sharing the GPUs: the
# GPU tests compile hundreds of kernels, and one at a time the main process had run 35% of its
# tests after 560 s on 2x H200. tests/conftest.py gives each worker its share of the cores.
TEST_WORKERS ?= $(shell $(PY) -c "import os, torch; print(min(8, max(1, (os.cpu_count() or 2) // 2)) if torch.cuda.is_available() else 'auto')" 2>/dev/null || echo 0)

# Two pytest processes (tests/conftest.py): the main one (torch tests; `gpu` tests where CUDA is)
# and the interpreter one (`interpreter` tests: Triton kernels on CPU tensors). Both always run;
# the target fails if either does.
test: setup
	@status=0; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS) || status=1; \
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS) || status=1; \
	exit $$status

demo: setup
	$(PY) launch/decode.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
