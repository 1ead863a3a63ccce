"""Set for the whole test session, before any test module is imported.

Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. `triton.jit` reads
TRITON_INTERPRET when it decorates, and Triton's own library functions are decorated when `triton` is first
imported, which some test dependencies do at import (peft does): so it is set here, ahead of every module.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `python -m pytest` from the repo root puts the root first on sys.path, where kernels/ (installed as
# batchllm.kernels) shadows HF's `kernels` package, which transformers >= 5.25 imports. `make test` runs pytest's
# own script, which never puts it there; for `python -m pytest` it goes here, before a test imports transformers.
REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or os.getcwd()).resolve() != REPO]
