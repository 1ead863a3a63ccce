"""Set for the whole test session, before any test module is imported.

Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. `triton.jit` reads
TRITON_INTERPRET when it decorates, and Triton's own library functions are decorated when `triton` is first
imported, which some test dependencies do at import (peft does): so it is set here, ahead of every module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
