"""The host tier of the KV cache: blocks in (pinned) CPU memory behind the device pool.

It serves two purposes: swap space for preempted requests (their K/V moves out and comes back instead of
being recomputed) and a second level of the prefix cache (a cached device block about to be evicted is
copied out, LRU, and a later prompt with that prefix copies it back). It is a KV connector (kv_connector.py): the
engine decides, the runner copies (executor/kv_connector.py, kv_transfer.py). Each step's metadata is two lists of
block ids, offloads (device → host) and loads (host → device); the runner performs all offloads, then all loads,
then the step's forward pass.

What the tier keeps, when it is full (with room, it keeps every block it is given):
- LRU, with the tiers nearly exclusive: a block loaded back to the device is the first the tier evicts while the
  device holds it, and becomes the most recent again when the device evicts it (no copy: the tier still has it);
- a block is admitted at its first eviction only if a prompt hit it on the device; one nobody hit (a row's own
  suffix or output, in a batch job most blocks) only at its second eviction (a short history of hashes, as
  in ARC's ghost lists).
On W2-large (benchmarks/kv_tier_hit_rates.py) the two rules raised the hit rate from 0.68 to 0.85 (unlimited
pool 0.91): the tier no longer held copies of what the device had, nor blocks no prompt would ask again for.

Invariants that make that one order right:
- a device block is offloaded in the step that frees it for good (swap-out) or hands it out again (eviction),
  so its old contents are read before anything of this step writes them;
- a host block a step copies into or out of is held (one extra reference) until the step's copies are taken,
  so no other copy of the same step can reuse it: no host block is both read and written in one step. (The KV
  manager reports an allocation's evictions after `update_state_after_alloc`, so the blocks a load reads are
  held before the spills of the same allocation look for room.)
- a cached host block (`block_hash` set) holds that prefix's K/V from the moment its offload is issued: the
  runner's copies run in issue order, so a load that follows the offload reads what it wrote.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from batchllm.engine.block_pool import BlockPool, KVCacheBlock
from batchllm.engine.interfaces import BlockTransfers, SchedulerOutput
from batchllm.engine.kv_connector import KVConnector
from batchllm.engine.request import Request

HOST_TIER = "host_tier"


@dataclass(slots=True)
class HostTierStats:
    swapped_out_blocks: int = 0  # device → host, for preempted requests
    swapped_in_blocks: int = 0  # host → device, when they resume
    spilled_blocks: int = 0  # cached device blocks copied out as they were evicted
    loaded_blocks: int = 0  # cached host blocks copied back for a prompt with their prefix
    host_prefix_hits: int = 0  # prompt tokens whose K/V came from the host tier
    swap_preemptions: int = 0  # preemptions that swapped (the others recompute)
    copied_blocks: int = 0  # offloads + loads handed to the runner (a block the tier holds already is not copied)


class HostTier(KVConnector):
    """`block_size`: the device pool's (tokens per block), which the tier's blocks mirror."""

    name = HOST_TIER

    def __init__(self, num_blocks: int, enable_caching: bool, block_size: int = 16) -> None:
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_size = block_size
        self.stats = HostTierStats()
        self._swapped: dict[str, list[KVCacheBlock]] = {}  # request id → its host blocks, while swapped out
        self._matched: dict[str, list[KVCacheBlock]] = {}  # request id → the host blocks its prefix hit, until loaded
        self._offloads: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._held: list[KVCacheBlock] = []  # by this step's offloads
        self._loaded: list[KVCacheBlock] = []  # by this step's loads
        self._ghosts: OrderedDict[bytes, None] = OrderedDict()  # hashes evicted once without a spill, oldest first

    def on_evict(self, block_id: int, block_hash: bytes, reused: bool) -> None:
        """The device pool evicted a cached block (spill): keep its K/V here unless this tier has it already or every
        host block is held (by swapped-out requests or this step's copies; then the prefix is simply dropped)."""
        if not self.pool.enable_caching:
            return
        kept = self.pool.lookup(block_hash)
        if kept is not None:
            if not kept.ref_cnt:  # the device's copy goes, so this one is the prefix's last: the most recent
                self.pool.touch([kept])
                self.pool.free([kept])
            return
        if not self.pool.num_free_blocks:
            return
        if not reused and not self.pool.num_free_uncached and block_hash not in self._ghosts:
            # A full tier admits a block unused since it was computed (likely a row's own suffix, not a shared
            # prefix) only when it is evicted a second time.
            self._ghosts[block_hash] = None
            if len(self._ghosts) > self.pool.num_blocks:
                self._ghosts.popitem(last=False)
            return
        self._ghosts.pop(block_hash, None)
        host_block = self.pool.allocate(1)[0]
        self.pool.cache(host_block, block_hash)
        self._held.append(host_block)
        self._offloads.append((block_id, host_block.block_id))
        self.stats.spilled_blocks += 1

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.pool.lookup(block_hash)

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> int:
        """The run of full prompt blocks after the device's prefix (`request.block_hashes`, extended by the KV
        manager) that this tier caches, the prompt's last token excluded; held from the allocation that loads them."""
        self._matched.pop(request.request_id, None)
        matched: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[num_computed // self.block_size:
                                               (request.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            matched.append(block)
        if matched:
            self._matched[request.request_id] = matched
        return len(matched) * self.block_size

    def get_num_held_tokens(self, request: Request) -> int:
        return request.num_computed_tokens if request.request_id in self._swapped else 0

    def update_state_after_alloc(self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int) -> None:
        """Load a swapped-out request's blocks, or a prefix hit's, into the first of `blocks`. The KV manager tells
        this tier of the allocation's evictions only afterwards, so the blocks are held before a spill could take
        them."""
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            self.hold(swapped)  # the step's reference replaces the request's
            self.pool.free(swapped)
            self.load(swapped, blocks)
            self.stats.swapped_in_blocks += len(swapped)
            return
        self.load_prefix(self._matched.pop(request.request_id), blocks, num_external_tokens)

    def load_prefix(self, host_blocks: list[KVCacheBlock], device_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Load cached host blocks of a prompt's prefix (`num_tokens` of its tokens) into fresh device blocks: held
        first, so that the allocation's spills, reported afterwards, cannot take them."""
        self.hold(host_blocks)
        self.load(host_blocks, device_blocks)
        self.stats.loaded_blocks += len(host_blocks)
        self.stats.host_prefix_hits += num_tokens

    def save_preempted(self, request: Request, blocks: list[KVCacheBlock]) -> bool:
        """Swap out: copy the device blocks of the request's computed tokens here, unless too few host blocks are
        free. A block whose prefix the tier already caches is not copied again."""
        existing = [None if b.block_hash is None else self.pool.lookup(b.block_hash) for b in blocks]
        num_copies = existing.count(None)
        num_revived = sum(1 for block in existing if block is not None and block.ref_cnt == 0)
        if num_copies + num_revived > self.pool.num_free_blocks:
            return False
        reused = [block for block in existing if block is not None]
        self.pool.touch(reused)  # first, so the allocation below cannot evict them
        fresh = iter(self.pool.allocate(num_copies))
        host_blocks = []
        for device_block, host_block in zip(blocks, existing):
            if host_block is None:
                host_block = next(fresh)
                self._offloads.append((device_block.block_id, host_block.block_id))
                if device_block.block_hash is not None:
                    self.pool.cache(host_block, device_block.block_hash)
            host_blocks.append(host_block)
        self._swapped[request.request_id] = host_blocks
        self.stats.swapped_out_blocks += len(blocks)
        self.stats.swap_preemptions += 1
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """An aborted request may still be swapped out: its host blocks are released (tail first)."""
        self._matched.pop(request.request_id, None)
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            self.pool.free(swapped[::-1])
        return False

    def hold(self, host_blocks: list[KVCacheBlock]) -> None:
        """Reference blocks a load of this step will read, before the step's allocations could evict them."""
        self.pool.touch(host_blocks)
        self._loaded += host_blocks

    def load(self, host_blocks: list[KVCacheBlock], device_blocks: list[KVCacheBlock]) -> None:
        """Copy held host blocks into device blocks before the step's forward pass."""
        self._loads += [(h.block_id, d.block_id) for h, d in zip(host_blocks, device_blocks)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BlockTransfers | None:
        return self.take_transfers()

    def reset_stats(self) -> None:
        self.stats = HostTierStats()

    def take_transfers(self) -> BlockTransfers | None:
        """The step's copies (None: none); the host blocks they use become reusable (and evictable) again.

        A block this step loaded has its contents on the device now: it is the first this tier evicts, so the two
        tiers together hold more distinct prefixes (were it kept as recently used, a prefix would take room in
        both). If the device evicts that prefix later, it is spilled again: a copy, not a recomputation."""
        transfers = BlockTransfers(self._offloads, self._loads) if self._offloads or self._loads else None
        self.stats.copied_blocks += len(self._offloads) + len(self._loads)
        self.pool.free(self._held[::-1])  # the newest last, so the prefix the step used outlives its tail
        # (A tier with room keeps them as recently used; a prefix's tail is evicted before its head.)
        self.pool.free(self._loaded, first_out=not self.pool.num_free_uncached)
        self._offloads, self._loads, self._held, self._loaded = [], [], [], []
        return transfers
