"""KV connectors, worker side: the copies that the scheduler side (engine/kv_connector.py) decided.

The runner calls, before each step's copy-on-write copies and forward pass, for each connector in turn:
`wait_for_load()` (the forward pass reads what an earlier step's loads wrote), `start_load_kv(metadata)` (issue this
step's copies) and `wait_for_save(metadata)` (block until what this step saves may be read elsewhere). `metadata`
is what the connector's scheduler side built for the step, None when it had nothing.

Two implementations, both over a `HostKVPool` (kv_transfer.py): the host tier (swap space and prefix spill in host
memory) and the disaggregated P/D link (a buffer in a file both engines' workers map).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from batchllm.distributed.parallel_state import all_reduce_min
from batchllm.engine.host_tier import HOST_TIER
from batchllm.engine.interfaces import BlockTransfers
from batchllm.engine.kv_handoff import KV_LINK
from batchllm.executor.drafter_base import Drafter
from batchllm.executor.kv_cache import KVCache
from batchllm.executor.kv_transfer import HostKVPool, host_blocks_for


class KVConnectorWorker:
    """A connector's worker side; `name`: its scheduler side's, under which the step's metadata arrives."""

    name: ClassVar[str]

    def wait_for_load(self) -> None:
        pass

    def start_load_kv(self, metadata: object | None) -> None:
        pass

    def wait_for_save(self, metadata: object | None) -> None:
        pass


class _PoolCopies(KVConnectorWorker):
    """Copies between the device pool and a `HostKVPool`, as `BlockTransfers`."""

    def __init__(self, pool: HostKVPool) -> None:
        self.pool = pool

    def wait_for_load(self) -> None:
        self.pool.wait_for_loads()

    def start_load_kv(self, metadata: BlockTransfers | None) -> None:
        """Offloads, then loads: the forward pass waits for the offloads, the next step's for the loads."""
        if metadata is not None:
            self.pool.run(metadata)


class HostTierWorker(_PoolCopies):
    name = HOST_TIER


class KVLinkWorker(_PoolCopies):
    name = KV_LINK

    def wait_for_save(self, metadata: BlockTransfers | None) -> None:
        if metadata is not None and metadata.offloads:
            self.pool.synchronize()  # the decode engine may read them once this step is applied


def allocate_host_tier(swap_space_bytes: int, kv_cache: KVCache, drafter: Drafter | None,
                       device: torch.device) -> HostKVPool | None:
    """The host tier's pool: as many blocks as `swap_space_bytes` holds on every rank (None without swap space).
    A drafter's K/V lives in the same block ids: it moves along."""
    if not swap_space_bytes:
        return None
    caches = [kv_cache.tensor]
    if drafter is not None and drafter.kv_cache is not None:
        caches.append(drafter.kv_cache.tensor)
    bytes_per_block = sum(cache[:, :, 0].numel() * cache.element_size() for cache in caches)
    num_blocks = all_reduce_min(host_blocks_for(swap_space_bytes, bytes_per_block))
    if not num_blocks:
        raise ValueError(f"swap_space={swap_space_bytes / (1 << 30):g} GiB holds no KV block "
                         f"({bytes_per_block} bytes each): raise it, or 0 to turn the host tier off")
    return HostKVPool(caches, num_blocks, device)


def build_kv_connector_workers(host_tier: HostKVPool | None, kv_link: tuple[Path, int] | None,
                               cache: torch.Tensor, device: torch.device) -> list[KVConnectorWorker]:
    """The runner's connectors, in the scheduler side's order: the host tier, then the P/D link (the buffer file
    and its blocks), whichever are there."""
    connectors: list[KVConnectorWorker] = [] if host_tier is None else [HostTierWorker(host_tier)]
    if kv_link is not None:
        connectors.append(KVLinkWorker(HostKVPool([cache], kv_link[1], device, backing=kv_link[0])))
    return connectors
