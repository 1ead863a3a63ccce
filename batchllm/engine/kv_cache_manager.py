"""Which KV-cache blocks each request owns: on-demand allocation, prefix-cache hits, sharing and copy-on-write.

Invariants:
- a request with `num_computed_tokens + n` tokens scheduled owns
  `ceil((num_computed_tokens + n) / block_size)` blocks: exactly, unless speculative decoding rolled
  `num_computed_tokens` back past rejected drafts, whose blocks the request keeps for its next drafts;
- a block is written only by a request that owns it alone: before a request writes into a block it
  shares (a forked sample's last block), the block is copied to a fresh one (copy-on-write) and the copy
  is reported so the runner performs it before the step's forward pass;
- prefix-cache hits cover full blocks only and never the request's last token, whose logits are needed;
- with KV connectors (kv_connector.py: the host tier, the P/D link) a request is in at most one place: on the
  device (`_blocks`) or held by a connector (swapped out, or computed by another engine);
- K/V a connector loads in a step is read from the next step on: the copies run while the step computes
  (executor/kv_transfer.py). A request whose blocks a step loads, or that hits blocks the step loads for another,
  is `loading`: the scheduler computes nothing of it in that step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchllm.engine.block_hash import extend_block_hashes
from batchllm.engine.block_pool import BlockPool, KVCacheBlock
from batchllm.engine.host_tier import HostTier
from batchllm.engine.kv_connector import KVConnector
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
    """A prompt's longest cached prefix: full blocks found on the device, then the ones after them that a connector
    holds (the host tier's: their K/V is copied into fresh device blocks)."""

    device: list[KVCacheBlock]
    num_external_blocks: int = 0
    connector: KVConnector | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.device) + self.num_external_blocks


_NO_PREFIX = CachedPrefix([])
_UNCHANGED = BlockAllocation([])  # shared, never mutated: the request's block table stays as it is


class KVCacheManager:
    """`num_host_blocks`: a host tier of that many blocks (0: none), the first of `connectors`; a subclass may
    add more (kv_handoff.py)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.host = HostTier(num_host_blocks, enable_caching, block_size) if num_host_blocks else None
        self.connectors: list[KVConnector] = [] if self.host is None else [self.host]
        self.pool = BlockPool(num_blocks, enable_caching, self._record_eviction)
        self._evictions: list[tuple[int, bytes, bool]] = []  # (block id, hash, reused), until the allocation ends
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._loading: set[str] = set()  # requests that wait for this step's loads
        self._landing: set[int] = set()  # device blocks this step's loads fill (indexed already: others may hit)
        self._num_hashed_blocks: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids for the current step
        self.peak_used_blocks = 0
        self.stats = PrefixCacheStats()

    def reset_stats(self) -> None:
        self.peak_used_blocks = self.pool.num_used_blocks
        self.stats = PrefixCacheStats()
        for connector in self.connectors:
            connector.reset_stats()

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
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, _extra_keys(request),
                            _block_keys(request))
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        device: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            device.append(block)
        for connector in self.connectors:
            num_tokens = connector.get_num_new_matched_tokens(request, len(device) * self.block_size)
            if num_tokens:
                return CachedPrefix(device, cdiv(num_tokens, self.block_size), connector)
        return CachedPrefix(device) if device else _NO_PREFIX

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
                # `_cache_full_blocks`' own first test, without the call per row and step: a block filled since
                # the last indexing (always true once a block is full with caching off, where the call returns).
                if min(end, len(request.token_ids)) // self.block_size > self._num_hashed_blocks.get(
                        request.request_id, 0):
                    self._cache_full_blocks(request, owned, end)
                return _UNCHANGED
        if owned is None:
            owned = self._blocks[request.request_id] = []
        computed = request.num_computed_tokens + cached.num_blocks * self.block_size
        end = computed + num_new_tokens
        first_write = computed // self.block_size
        needs_copy = first_write < len(owned) and owned[first_write].ref_cnt > 1
        # A connector's blocks need device blocks too: fresh ones, the first allocated, which its loads fill.
        num_new_blocks = max(0, cdiv(end, self.block_size) - len(owned) - len(cached.device)) + needs_copy
        # Touching a cached block that sits in the free queue takes it out of the free count too.
        num_revived = sum(1 for block in cached.device if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            if not owned:
                del self._blocks[request.request_id]
            return None
        self.pool.touch(cached.device)
        for block in cached.device:
            block.reused = True
        owned.extend(cached.device)
        new_blocks = self.pool.allocate(num_new_blocks)
        loading = bool(cached.num_external_blocks) or any(block.block_id in self._landing for block in cached.device)
        if cached.num_external_blocks:
            loaded = new_blocks[: cached.num_external_blocks]
            for block in loaded:
                block.reused = True  # a hit in a connector: as much a reuse as a device hit
                self._landing.add(block.block_id)
            cached.connector.update_state_after_alloc(request, loaded, cached.num_external_blocks * self.block_size)
        self._report_evictions()
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
        """Preempt by swapping: a connector keeps the K/V of the request's computed tokens and its device blocks are
        freed. False, changing nothing, when no connector takes it (none, or too little room)."""
        owned = self._blocks.get(request.request_id)
        if owned is None:
            return False
        computed = owned[: cdiv(request.num_computed_tokens, self.block_size)]
        if not any(connector.save_preempted(request, computed) for connector in self.connectors):
            return False
        self.free(request)
        return True

    def allocate_held(self, request: Request, connector: KVConnector, num_held_tokens: int,
                      num_new_tokens: int) -> bool:
        """Admit a request whose first `num_held_tokens` tokens' K/V `connector` holds (swapped out, or computed by
        another engine): fresh device blocks, the first filled by this step's loads (it is `loading`), and room for
        `num_new_tokens` more. False, changing nothing, if the device pool is too short."""
        num_blocks = cdiv(num_held_tokens + num_new_tokens, self.block_size)
        if num_blocks > self.pool.num_free_blocks:
            return False
        blocks = self._blocks[request.request_id] = self.pool.allocate(num_blocks)
        connector.update_state_after_alloc(request, blocks, num_held_tokens)
        self._report_evictions()
        self._loading.add(request.request_id)  # its blocks are indexed once it computes, in the next step
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return True

    def _record_eviction(self, block: KVCacheBlock, block_hash: bytes) -> None:
        self._evictions.append((block.block_id, block_hash, block.reused))

    def _report_evictions(self) -> None:
        """Tell the connectors of the evictions of the allocation that just ended. Only now: a connector that loads
        into the allocated blocks has taken the blocks it loads from (a host tier spilling first could reuse them)."""
        if self._evictions:
            for connector in self.connectors:
                for eviction in self._evictions:
                    connector.on_evict(*eviction)
            self._evictions.clear()

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
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, _extra_keys(request),
                            _block_keys(request))
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

    def block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self._blocks.get(request.request_id, ())]

    # KV-aware admission (admission.py) asks these; a manager whose requests hold blocks differently answers for it.
    def num_blocks_to_hold(self, num_tokens: int) -> int:
        """The most blocks a request holds on its way to a length of `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_blocks_held(self, request: Request) -> int:
        return len(self._blocks.get(request.request_id, ()))

    def num_blocks_in_use(self, cached: CachedPrefix) -> int:
        """Of a cached prefix's device blocks, those that other requests hold already: reusing them takes nothing
        from the free pool (a cached block in the free queue does)."""
        return sum(1 for block in cached.device if block.ref_cnt > 0)

    def free(self, request: Request) -> None:
        self._loading.discard(request.request_id)
        blocks = self._blocks.pop(request.request_id, [])
        self._num_hashed_blocks.pop(request.request_id, None)
        # Tail first: the free queue evicts from its head, so a prefix outlives its suffix.
        self.pool.free(blocks[::-1])


def _extra_keys(request: Request) -> tuple:
    """What a block's K/V depends on beside its tokens: the adapter it was computed under."""
    return () if request.lora_request is None else request.lora_request.cache_key


def _block_keys(request: Request) -> Callable[[int, int], tuple] | None:
    """What a block's K/V depends on beside its tokens, per block: the images whose placeholders it holds."""
    return None if request.mm is None else request.mm.image_hashes_in
