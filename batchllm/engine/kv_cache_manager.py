"""Which KV-cache blocks each request owns: on-demand allocation, prefix-cache hits, sharing and copy-on-write.

Invariants:
- a request with `num_computed_tokens + n` tokens scheduled owns
  `ceil((num_computed_tokens + n) / block_size)` blocks: exactly, unless speculative decoding rolled
  `num_computed_tokens` back past rejected drafts, whose blocks the request keeps for its next drafts;
- a block is written only by a request that owns it alone: before a request writes into a block it
  shares (a forked sample's last block), the block is copied to a fresh one (copy-on-write) and the copy
  is reported so the runner performs it before the step's forward pass;
- prefix-cache hits cover full blocks only and never the request's last token, whose logits are needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchllm.engine.block_hash import extend_block_hashes
from batchllm.engine.block_pool import BlockPool, KVCacheBlock
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


_UNCHANGED = BlockAllocation([])  # shared, never mutated: the request's block table stays as it is


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids for the current step
        self.peak_used_blocks = 0
        self.stats = PrefixCacheStats()

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that starts the request (excluding its last token)."""
        if not self.pool.enable_caching:
            return []
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, _extra_keys(request))
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[KVCacheBlock] | None = None) -> BlockAllocation | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the `cached_blocks` hit
        at admission). Returns what changed in the request's block table, or None, changing nothing, if the
        pool is too short."""
        owned = self._blocks.get(request.request_id)
        if owned is not None and not cached_blocks:
            # Most decode steps write into the request's own last block: nothing to allocate or copy.
            end = request.num_computed_tokens + num_new_tokens
            first_write = request.num_computed_tokens // self.block_size
            num_owned = len(owned)
            if first_write < num_owned and end <= num_owned * self.block_size and owned[first_write].ref_cnt == 1:
                self._cache_full_blocks(request, owned, end)
                return _UNCHANGED
        cached_blocks = cached_blocks or []
        if owned is None:
            owned = self._blocks[request.request_id] = []
        computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        end = computed + num_new_tokens
        first_write = computed // self.block_size
        needs_copy = first_write < len(owned) and owned[first_write].ref_cnt > 1
        num_new_blocks = max(0, cdiv(end, self.block_size) - len(owned) - len(cached_blocks)) + needs_copy
        # Touching a cached block that sits in the free queue takes it out of the free count too.
        num_revived = sum(1 for block in cached_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            if not owned:
                del self._blocks[request.request_id]
            return None
        self.pool.touch(cached_blocks)
        owned.extend(cached_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        if needs_copy:
            self._copy_on_write(owned, first_write, new_blocks.pop(0))
        owned.extend(new_blocks)
        self._cache_full_blocks(request, owned, end)
        if num_new_blocks or cached_blocks:
            self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return BlockAllocation([block.block_id for block in new_blocks], needs_copy)

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

    def block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self._blocks.get(request.request_id, ())]

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._num_hashed_blocks.pop(request.request_id, None)
        # Tail first: the free queue evicts from its head, so a prefix outlives its suffix.
        self.pool.free(blocks[::-1])


def _extra_keys(request: Request) -> tuple:
    """What a block's K/V depends on beside its tokens: the adapter it was computed under."""
    return () if request.lora_request is None else request.lora_request.cache_key
