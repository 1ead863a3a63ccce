"""Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors.

The variable must be set before the kernel modules are imported (`triton.jit` reads it when it decorates),
which the test modules do lazily, after this file has run.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
