"""Which KV-cache blocks each request owns: on-demand allocation, prefix-cache hits, sharing and copy-on-write.

Invariants:
- a request with `num_computed_tokens + n` tokens scheduled owns
  `ceil((num_computed_tokens + n) / block_size)` blocks: exactly, unless speculative decoding rolled
  `num_computed_tokens` back past rejected drafts, whose blocks the request keeps for its next drafts;
- a block is written only by a request that owns it alone: before a request writes into a block it
  shares (a forked sample's last block), the block is copied to a fresh one (copy-on-write) and the copy
  is reported so the runner performs it before the step's forward pass;
- prefix-cache hits cover full blocks only and never the request's last token, whose logits are needed;
- with a host tier (host_tier.py) a request is in at most one place: on the device (`_blocks`) or swapped
  out (`_swapped`, the host blocks holding its first `num_computed_tokens` tokens' K/V);
- K/V loaded from the host tier in a step is read from the next step on: the copies run while the step
  computes (executor/kv_transfer.py). A request whose blocks a step loads, or that hits blocks the step loads
  for another, is `loading`: the scheduler computes nothing of it in that step.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchllm.engine.block_hash import extend_block_hashes
from batchllm.engine.block_pool import BlockPool, KVCacheBlock
from batchllm.engine.host_tier import HostTier, HostTierStats
from batchllm.engine.interfaces import BlockTransfers
from batchllm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens whose K/V came from the cache
    shared_blocks: int = 0  # block references taken on blocks another request already held (forks)
    cow_copies: int = 0


@dataclass(slots=True)
class BlockAllocation:
    new_block_ids: list[int]  # appended to the request's block table
    copied: bool = False  # a shared block in the table was replaced by its private copy


@dataclass(slots=True)
class CachedPrefix:
    """A prompt's longest cached prefix: full blocks found on the device, then the ones after them found only in
    the host tier (their K/V is copied back into fresh device blocks)."""

    device: list[KVCacheBlock]
    host: list[KVCacheBlock]

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.host)


_NO_PREFIX = CachedPrefix([], [])
_UNCHANGED = BlockAllocation([])  # shared, never mutated: the request's block table stays as it is


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.host = HostTier(num_host_blocks, enable_caching) if num_host_blocks else None
        self.pool = BlockPool(num_blocks, enable_caching, None if self.host is None else self.host.spill)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._swapped: dict[str, list[KVCacheBlock]] = {}  # request id → its host blocks, while swapped out
        self._loading: set[str] = set()  # requests that wait for this step's loads
        self._landing: set[int] = set()  # device blocks this step's loads fill (indexed already: others may hit)
        self._num_hashed_blocks: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids for the current step
        self.peak_used_blocks = 0
        self.stats = PrefixCacheStats()

    def reset_stats(self) -> None:
        self.peak_used_blocks = self.pool.num_used_blocks
        self.stats = PrefixCacheStats()
        if self.host is not None:
            self.host.stats = HostTierStats()

    def begin_step(self) -> None:
        """A new step: the last step's loads land before its forward pass, so what they fill can be read."""
        if self._loading or self._landing:
            self._loading.clear()
            self._landing.clear()

    def is_loading(self, request: Request) -> bool:
        return request.request_id in self._loading

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of cached full blocks that starts the request (excluding its last token)."""
        if not self.pool.enable_caching or (request.pooling is not None and request.pooling.reads_every_token):
            return _NO_PREFIX
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, _extra_keys(request))
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        device: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            device.append(block)
        host: list[KVCacheBlock] = []
        if self.host is not None:
            for block_hash in hashes[len(device):]:
                block = self.host.lookup(block_hash)
                if block is None:
                    break
                host.append(block)
        return CachedPrefix(device, host) if device or host else _NO_PREFIX

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: CachedPrefix = _NO_PREFIX) -> BlockAllocation | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the `cached` prefix found at
        admission). Returns what changed in the request's block table, or None, changing nothing, if the pool
        is too short."""
        owned = self._blocks.get(request.request_id)
        if owned is not None and cached is _NO_PREFIX:
            # Most decode steps write into the request's own last block: nothing to allocate or copy.
            end = request.num_computed_tokens + num_new_tokens
            first_write = request.num_computed_tokens // self.block_size
            num_owned = len(owned)
            if first_write < num_owned and end <= num_owned * self.block_size and owned[first_write].ref_cnt == 1:
                self._cache_full_blocks(request, owned, end)
                return _UNCHANGED
        if owned is None:
            owned = self._blocks[request.request_id] = []
        computed = request.num_computed_tokens + cached.num_blocks * self.block_size
        end = computed + num_new_tokens
        first_write = computed // self.block_size
        needs_copy = first_write < len(owned) and owned[first_write].ref_cnt > 1
        # The host hits need device blocks too: fresh ones, the first allocated, which their loads fill.
        num_new_blocks = max(0, cdiv(end, self.block_size) - len(owned) - len(cached.device)) + needs_copy
        # Touching a cached block that sits in the free queue takes it out of the free count too.
        num_revived = sum(1 for block in cached.device if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            if not owned:
                del self._blocks[request.request_id]
            return None
        if cached.host:
            self.host.hold(cached.host)  # before the device allocation, whose evictions spill into the tier
        self.pool.touch(cached.device)
        for block in cached.device:
            block.reused = True
        owned.extend(cached.device)
        new_blocks = self.pool.allocate(num_new_blocks)
        loading = bool(cached.host) or any(block.block_id in self._landing for block in cached.device)
        if cached.host:
            loaded = new_blocks[: len(cached.host)]
            self.host.load(cached.host, loaded)
            for block in loaded:
                block.reused = True  # a host-tier hit: as much a reuse as a device hit
                self._landing.add(block.block_id)
            self.host.stats.loaded_blocks += len(cached.host)
            self.host.stats.host_prefix_hits += len(cached.host) * self.block_size
        if needs_copy:
            self._copy_on_write(owned, first_write, new_blocks.pop(0))
        owned.extend(new_blocks)
        if loading:  # it computes from the next step: only its cached prefix is indexed now
            self._loading.add(request.request_id)
            end = computed
        self._cache_full_blocks(request, owned, end)
        if num_new_blocks or cached.device:
            self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return BlockAllocation([block.block_id for block in new_blocks], needs_copy)

    def swap_out(self, request: Request) -> bool:
        """Preempt by swapping: move the K/V of the request's computed tokens into the host tier and free its
        device blocks. False, changing nothing, when there is no host tier or too little room in it."""
        owned = self._blocks.get(request.request_id)
        if self.host is None or owned is None:
            return False
        host_blocks = self.host.swap_out(owned[: cdiv(request.num_computed_tokens, self.block_size)])
        if host_blocks is None:
            return False
        self.free(request)
        self._swapped[request.request_id] = host_blocks
        self.host.stats.swap_preemptions += 1
        return True

    def arrived_tokens(self, request: Request) -> int:
        """Tokens whose K/V another engine computed for this request (kv_handoff.py); 0: none."""
        return 0

    def take_link_transfers(self) -> BlockTransfers | None:
        """The step's copies to or from another engine's buffer (kv_handoff.py); None: none."""
        return None

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._swapped

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request back: fresh device blocks, the first filled from its host blocks by this
        step's loads (it is `loading`), and room for `num_new_tokens` more. False, changing nothing, if the device
        pool is too short."""
        host_blocks = self._swapped[request.request_id]
        end = request.num_computed_tokens + num_new_tokens
        num_blocks = max(cdiv(end, self.block_size), len(host_blocks))
        if num_blocks > self.pool.num_free_blocks:
            return False
        del self._swapped[request.request_id]
        self.host.hold(host_blocks)  # the step's reference replaces the request's
        self.host.release(host_blocks)
        blocks = self._blocks[request.request_id] = self.pool.allocate(num_blocks)
        self.host.load(host_blocks, blocks)
        self.host.stats.swapped_in_blocks += len(host_blocks)
        self._loading.add(request.request_id)  # its blocks are indexed once it computes, in the next step
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return True

    def _copy_on_write(self, owned: list[KVCacheBlock], index: int, copy: KVCacheBlock) -> None:
        shared = owned[index]
        self.pending_copies.append((shared.block_id, copy.block_id))
        self.pool.free([shared])  # drops our reference only: the other owners keep it
        owned[index] = copy
        self.stats.cow_copies += 1

    def _cache_full_blocks(self, request: Request, owned: list[KVCacheBlock], num_tokens: int) -> None:
        """Index the blocks that this step fills, so later requests with the same prefix can reuse them.

        Done at scheduling time: a request that hits such a block in the same step reads it in the same
        forward pass, where every layer writes the step's K/V before any attention reads it.
        """
        if not self.pool.enable_caching:
            return
        # A block whose last token is still pending (asynchronous scheduling) is indexed in a later step.
        num_full = min(num_tokens, len(request.token_ids)) // self.block_size
        if not num_full:
            return
        start = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, _extra_keys(request))
        for index in range(start, num_full):
            self.pool.cache(owned[index], request.block_hashes[index])
        self._num_hashed_blocks[request.request_id] = num_full

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Let `child` share the blocks holding `parent`'s first `num_tokens` tokens (already computed)."""
        shared = self._blocks[parent.request_id][: cdiv(num_tokens, self.block_size)]
        self.pool.touch(shared)
        self._blocks[child.request_id] = list(shared)
        parent_hashed = self._num_hashed_blocks.get(parent.request_id, 0)
        self._num_hashed_blocks[child.request_id] = min(parent_hashed, num_tokens // self.block_size)
        self.stats.shared_blocks += len(shared)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_transfers(self) -> BlockTransfers | None:
        """The step's copies between the device pool and the host tier (None: none)."""
        return None if self.host is None else self.host.take_transfers()

    def block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self._blocks.get(request.request_id, ())]

    def free(self, request: Request) -> None:
        self._loading.discard(request.request_id)
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            self.host.release(swapped[::-1])
        blocks = self._blocks.pop(request.request_id, [])
        self._num_hashed_blocks.pop(request.request_id, None)
        # Tail first: the free queue evicts from its head, so a prefix outlives its suffix.
        self.pool.free(blocks[::-1])


def _extra_keys(request: Request) -> tuple:
    """What a block's K/V depends on beside its tokens: the adapter it was computed under."""
    return () if request.lora_request is None else request.lora_request.cache_key
