"""Attention backends, and the one place that picks one (`attention_backend`).

Adding a kernel: a module with an `AttentionBackend` subclass (see `backend.py`), and its case below.
"""

from __future__ import annotations

import functools

import torch

from batchllm import kernels
from batchllm.model.attention.backend import AttentionBackend, AttentionParams
from batchllm.model.attention.invariant_backend import INVARIANT_BACKEND
from batchllm.model.attention.torch_backend import TORCH_BACKEND
from batchllm.model.layers import batch_invariant

__all__ = ["AttentionBackend", "AttentionParams", "attention_backend"]


def attention_backend(device: torch.device) -> AttentionBackend:
    """The backend for tensors on `device`: Triton on CUDA when the kernels take Triton there (the rule of
    `batchllm.kernels.triton_enabled`), the pure-torch reference otherwise (the CPU path), or its batch-invariant
    twin while the step runs batch-invariant (`deterministic=True`; the Triton backend has an invariant mode of
    its own)."""
    if device.type == "cuda" and kernels.triton_enabled():
        return _triton_backend()
    return INVARIANT_BACKEND if batch_invariant.active() else TORCH_BACKEND


@functools.cache
def _triton_backend() -> AttentionBackend:
    from batchllm.model.attention.triton_backend import TritonAttentionBackend  # imports Triton: only when used

    return TritonAttentionBackend()
