"""Set for the whole test session, before any test module is imported.

Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. `triton.jit` reads
TRITON_INTERPRET when it decorates, and Triton's own library functions are decorated when `triton` is first
imported, which some test dependencies do at import (peft does): so it is set here, ahead of every module.

The interpreter's `tl.dot` is `numpy.matmul`, so the batch-invariance tests of the deterministic kernels hold only
if numpy's BLAS rounds a row the same wherever it sits in a tile (as a GPU tile does). OpenBLAS's Haswell / Zen
SGEMM kernels do not (a row at tile row 0 and at row 6 can differ in the last bit); its Sandybridge kernel does.
OpenBLAS reads OPENBLAS_CORETYPE when it loads, at numpy's import, which `import torch` does: so before it.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")
# Each CPU engine's default KV pool would be 4 GiB, allocated untouched. A machine that does not overcommit memory
# (vm.overcommit_memory=2) charges all of it at once: with a few engines alive in this process (module fixtures)
# and in its replicas, allocations then fail. 1 GiB (1,456 blocks of the default model) holds every test's rows;
# tests that size the pool say so.
os.environ.setdefault("BATCHLLM_CPU_KV_CACHE_BYTES", str(1 << 30))
# Under pytest-xdist (`make test` runs two workers on a 2-core machine) each worker keeps to one thread, as do the
# engines, replicas and BLAS it starts: two workers of two threads each fight over the cores and gain nothing.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # in case a plugin imported torch before the variables above were set

# `python -m pytest` from the repo root puts the root first on sys.path, where kernels/ (installed as
# batchllm.kernels) shadows HF's `kernels` package, which transformers >= 5.25 imports. `make test` runs pytest's
# own script, which never puts it there; for `python -m pytest` it goes here, before a test imports transformers.
REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or os.getcwd()).resolve() != REPO]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama written by transformers (2 layers, hidden 64) with the default model's tokenizer
    and chat template: for the tests whose point is a door's or a job's bookkeeping (resume, signals, replicas,
    flags), where the 135M default model only costs time (each of its decode steps reads its 538 MB of weights).
    Large initial weights give clear greedy choices, so its outputs do not hinge on rounding."""
    from tests.tiny_models import TINY_LLAMA, write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", **TINY_LLAMA)
