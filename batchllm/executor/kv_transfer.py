"""The host tier's memory and the copies between it and the device KV pool (engine/host_tier.py decides them,
kv_connector.py has them run).

The host pool is laid out block-major: one block's K/V, every layer, is one contiguous run, so a run of
consecutive host blocks is one DMA. On a GPU the pool is pinned, and the copies run on a stream of their own,
through a small device staging buffer:
- it first waits for the work already queued on the compute stream (the steps that wrote the blocks it
  offloads);
- the step's forward pass waits for the offloads, since it may overwrite those blocks;
- the loads run while it computes: the engine computes nothing on loaded blocks before the next step
  (engine/kv_cache_manager.py), whose forward pass waits for them (`wait_for_loads`).
Every wait is a stream-to-stream event: the host never syncs. On the CPU (the device pool is host memory
too) the copies are plain indexed copies, done when `run` returns.

The same pool, backed by a shared file (`backing`, not pinned), is the buffer through which a disaggregated
prefill engine hands K/V to the decode engine (engine/kv_handoff.py): one process offloads into it, the other
loads from it.
"""

from __future__ import annotations

import math
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from batchllm.engine.interfaces import BlockTransfers
from batchllm.model.uploads import to_device

STAGING_BYTES = 64 << 20  # device staging per cache: copies move this much at a time


def host_blocks_for(swap_space_bytes: int, bytes_per_block: int) -> int:
    return swap_space_bytes // bytes_per_block if bytes_per_block else 0


class HostKVPool:
    """`caches`: the device KV tensors that share the block ids (the target's, and a drafter's), each laid out
    [2, layers, blocks, block_size, heads, head_dim]."""

    def __init__(self, caches: list[torch.Tensor], num_blocks: int, device: torch.device,
                 backing: Path | None = None) -> None:
        # Block-major byte views of the device caches (dtype-agnostic: FP8 caches have no index_copy_).
        self._device_views = [cache.view(torch.uint8).permute(2, 0, 1, 3, 4, 5) for cache in caches]
        if backing is not None and len(caches) != 1:
            raise ValueError("a shared K/V buffer holds one cache")
        self._host = [_host_tensor((num_blocks, *view.shape[1:]), device, backing) for view in self._device_views]
        self.num_blocks = num_blocks
        self.bytes_per_block = sum(host[0].numel() for host in self._host)
        self._cuda = device.type == "cuda"
        self._device = device
        if self._cuda:
            self._stream = torch.cuda.Stream(device)
            self._staging = [torch.empty((max(1, STAGING_BYTES // host[0].numel()), *host.shape[1:]),
                                         dtype=torch.uint8, device=device) for host in self._host]
            self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
            self._loads_landed: torch.cuda.Event | None = None
        self._copy_seconds = 0.0
        self.bytes_moved = 0

    def run(self, transfers: BlockTransfers) -> None:
        """Offloads, then loads: the compute stream's later work waits for the offloads, the next step for the loads."""
        self.bytes_moved += (len(transfers.offloads) + len(transfers.loads)) * self.bytes_per_block
        if not self._cuda:
            start = time.perf_counter()
            for view, host in zip(self._device_views, self._host):
                _copy_on_host(view, host, transfers)
            self._copy_seconds += time.perf_counter() - start
            return
        compute = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(compute)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record()
            if transfers.offloads:
                for view, host, staging in zip(self._device_views, self._host, self._staging):
                    self._offload(view, host, staging, transfers.offloads)
                compute.wait_stream(self._stream)
            if transfers.loads:
                for view, host, staging in zip(self._device_views, self._host, self._staging):
                    self._load(view, host, staging, transfers.loads)
            end.record()
        if transfers.loads:
            self._loads_landed = end
        self._timings.append((begin, end))
        if len(self._timings) > 64:
            self._collect_timings(wait=False)

    def synchronize(self) -> None:
        """Wait until every copy issued so far is done (another process reads what the offloads wrote)."""
        if self._cuda:
            self._stream.synchronize()

    def wait_for_loads(self) -> None:
        """Called before each step: its forward pass may read what the previous step's loads wrote."""
        if self._cuda and self._loads_landed is not None:
            torch.cuda.current_stream(self._device).wait_event(self._loads_landed)
            self._loads_landed = None

    def _offload(self, view: torch.Tensor, host: torch.Tensor, staging: torch.Tensor,
                 pairs: list[tuple[int, int]]) -> None:
        for start in range(0, len(pairs), len(staging)):
            chunk = pairs[start : start + len(staging)]
            src = self._index([d for d, _ in chunk])
            torch.index_select(view, 0, src, out=staging[: len(chunk)])
            for first, dst, count in _runs([h for _, h in chunk]):
                host[dst : dst + count].copy_(staging[first : first + count], non_blocking=True)

    def _load(self, view: torch.Tensor, host: torch.Tensor, staging: torch.Tensor,
              pairs: list[tuple[int, int]]) -> None:
        for start in range(0, len(pairs), len(staging)):
            chunk = pairs[start : start + len(staging)]
            for first, src, count in _runs([h for h, _ in chunk]):
                staging[first : first + count].copy_(host[src : src + count], non_blocking=True)
            dst = self._index([d for _, d in chunk])
            view.index_copy_(0, dst, staging[: len(chunk)])

    def _index(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device, queued behind the copy stream's work (uploads.py)."""
        return to_device(ids, self._device)

    def _collect_timings(self, wait: bool) -> None:
        pending = []
        for begin, end in self._timings:
            if wait:
                end.synchronize()
            if end.query():
                self._copy_seconds += begin.elapsed_time(end) / 1000
            else:
                pending.append((begin, end))
        self._timings = pending

    @property
    def copy_seconds(self) -> float:
        """Time the copies took (on a GPU: the copy stream's busy time; reading it waits for copies in flight)."""
        if self._cuda:
            self._collect_timings(wait=True)
        return self._copy_seconds


def _copy_on_host(view: torch.Tensor, host: torch.Tensor, transfers: BlockTransfers) -> None:
    if transfers.offloads:
        src, dst = np.array(transfers.offloads, dtype=np.int64).T
        host.index_copy_(0, torch.from_numpy(dst), view.index_select(0, torch.from_numpy(src)))
    if transfers.loads:
        src, dst = np.array(transfers.loads, dtype=np.int64).T
        view.index_copy_(0, torch.from_numpy(dst), host.index_select(0, torch.from_numpy(src)))


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in `ids`, first id, count) of each run of consecutive ids: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for index, block_id in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((index, block_id, 1))
    return runs


def _host_tensor(shape: tuple[int, ...], device: torch.device, backing: Path | None = None) -> torch.Tensor:
    """Host memory for the pool (or the shared file `backing`, mapped); pinned (page-locked) for a GPU, registered
    in place: torch's pinned allocator rounds each allocation up to a power of two, which would nearly double a
    20 GiB swap space."""
    if backing is None:
        tensor = torch.empty(shape, dtype=torch.uint8)
    else:
        tensor = torch.from_file(str(backing), shared=True, size=math.prod(shape), dtype=torch.uint8).view(shape)
    if device.type != "cuda" or not tensor.numel() or backing is not None:
        # A shared buffer stays pageable: an H200 machine (gVisor) stopped answering during the first run that
        # pinned a shared file mapping (cause not established), and copies from pageable memory are only slower
        # (the driver stages them and the host waits).
        return tensor
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if error != 0:
        raise RuntimeError(f"could not pin {tensor.numel() / (1 << 30):.1f} GiB of host memory for swap_space "
                           f"(CUDA error {int(error)}): lower swap_space")
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
    return tensor
