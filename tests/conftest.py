"""Set for the whole test session, before any test module is imported.

Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. `triton.jit` reads
TRITON_INTERPRET when it decorates, and Triton's own library functions are decorated when `triton` is first
imported, which some test dependencies do at import (peft does): so it is set here, ahead of every module.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
