"""The KV pool starts as zeros (executor/kv_cache.py). Slots nothing has written are read, masked: a verification
step's inert tokens and a CUDA graph's padding rows sit at such positions, and a masked key's value still enters
`p @ V` as 0 x value, which is NaN where the memory held a NaN bit pattern. A pool taken from recycled memory
(`torch.empty` after a NaN-filled tensor of the same size was freed) turned greedy tokens into 0s."""

from __future__ import annotations

import pytest
import torch

from batchllm.executor.kv_cache import zeroed_pool

SHAPE = (2, 2, 8, 16, 2, 16)  # 64 KiB in float32: under glibc's mmap threshold, so a freed chunk is handed out again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_pool_allocated_where_nan_was_freed_holds_zeros(dtype):
    for _ in range(4):  # free NaN-filled memory of the pool's size, then allocate the pool
        poison = [torch.full(SHAPE, float("nan"), dtype=torch.float32) for _ in range(3)]
        del poison
        pool = zeroed_pool(SHAPE, dtype, torch.device("cpu"))
        assert pool.shape == SHAPE and pool.dtype == dtype and pool.is_contiguous()
        assert torch.count_nonzero(pool.view(torch.uint8)) == 0
    pool[1, 0, 3] = 1.5  # writable, and a write lands where a view says
    assert pool.float().sum() == 1.5 * 16 * 2 * 16

