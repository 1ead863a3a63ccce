"""The KV blocks of a model with sliding-window layers: a block table per group of layers (kv_groups.py), and a
window group's blocks returned to the pool once no query can see them.

Invariants, beside those of `KVCacheManager`:
- every group's table of a request has the same length, ceil(tokens / block_size) (or more, after speculative
  rollback): a new block of a sequence is allocated in every group at once;
- a window group's block j is freed (its entry becomes None) once the request's first uncomputed position p has
  `(j + 1) * block_size <= p - window + 1`: no query at p or later sees a key of it. Never earlier: a step's
  queries start at the computed position, and their windows reach back from there;
- a freed block keeps its prefix-cache entry until the pool hands it out again; a prefix hit of n blocks needs
  every full-attention group's blocks 0..n-1 and each window group's blocks that a query at n * block_size sees,
  each found on the device or in the host tier (keyed per group as on the device: its spills carry the pool's keys);
- a request swapped out to a connector keeps only what each group holds at its computed position p: a full group's
  blocks 0..ceil(p / block_size) - 1, a window group's from the first a query at p sees. The connector gets them
  interleaved (block j of every group, then j + 1), and a request swapped back in, or handed over by a prefill
  engine, gets fresh blocks for exactly those entries, in that order (`held_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchllm.engine.block_hash import extend_block_hashes
from batchllm.engine.block_pool import KVCacheBlock
from batchllm.engine.kv_cache_manager import BlockAllocation, KVCacheManager, _block_keys, _extra_keys, cdiv
from batchllm.engine.kv_connector import KVConnector
from batchllm.engine.kv_groups import KVGroupLayout
from batchllm.engine.request import Request

Table = list[KVCacheBlock | None]


@dataclass(slots=True)
class GroupedPrefix:
    """A prompt's longest cached prefix over every group: `tables[g]` is group g's device blocks of it (None where a
    window group does not need one, or where the block is only in the host tier: `host_loads`)."""

    num_blocks: int
    tables: list[Table] = field(default_factory=list)
    host_loads: list[tuple[int, int, KVCacheBlock]] = field(default_factory=list)  # (group, index, host block)


_NO_PREFIX = GroupedPrefix(0)
_UNCHANGED = BlockAllocation([])


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, layout: KVGroupLayout, enable_caching: bool = False,
                 num_host_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, enable_caching, num_host_blocks)
        self.layout = layout
        self.num_groups = layout.num_groups
        self._tables: dict[str, list[Table]] = {}
        self._num_released: dict[str, int] = {}  # leading blocks the request's window groups have let go

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the pool holds even if no window frees a block."""
        return self.pool.num_blocks // self.num_groups * self.block_size

    def _first_seen(self, group: int, position: int) -> int:
        """The first block of `group` that a query at `position` (or later) reads."""
        window = self.layout.group_windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def _key(self, group: int, block_hash: bytes) -> bytes:
        return block_hash + group.to_bytes(2, "little")

    def num_blocks_to_hold(self, num_tokens: int) -> int:
        """Every group's blocks; a window group holds no more than its window needs. A decode at length l > window
        holds the blocks from the one with position l - window on: cdiv(window + r, block_size) of them where
        r = (l - window) mod block_size, at most cdiv(window + block_size - 1, block_size). (A prefill chunk of n
        tokens briefly holds up to n more; preemption covers that.)"""
        full = cdiv(num_tokens, self.block_size)
        return sum(full if window is None else min(full, cdiv(window + self.block_size - 1, self.block_size))
                   for window in self.layout.group_windows)

    def num_blocks_held(self, request: Request) -> int:
        tables = self._tables.get(request.request_id, ())
        return sum(1 for table in tables for block in table if block is not None)

    def num_blocks_in_use(self, cached: GroupedPrefix) -> int:  # type: ignore[override]
        return sum(1 for table in cached.tables for block in table if block is not None and block.ref_cnt > 0)

    def find_cached_prefix(self, request: Request) -> GroupedPrefix:
        if not self.pool.enable_caching or (request.pooling is not None and request.pooling.reads_every_token):
            return _NO_PREFIX
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, _extra_keys(request),
                            _block_keys(request))
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        limit = len(hashes)
        for group, window in enumerate(self.layout.group_windows):
            if window is None:
                run = 0
                while run < limit and self._find(group, hashes[run]) is not None:
                    run += 1
                limit = run
        for num_blocks in range(limit, 0, -1):
            prefix = self._lookup(hashes, num_blocks)
            if prefix is not None:
                return prefix
        return _NO_PREFIX

    def _find(self, group: int, block_hash: bytes) -> tuple[KVCacheBlock, bool] | None:
        """Group `group`'s cached block of that hash, and whether it is a host block; None if neither tier has it."""
        key = self._key(group, block_hash)
        block = self.pool.lookup(key)
        if block is not None:
            return block, False
        block = None if self.host is None else self.host.lookup(key)
        return None if block is None else (block, True)

    def _lookup(self, hashes: list[bytes], num_blocks: int) -> GroupedPrefix | None:
        """Every group's cached blocks of the first `num_blocks` blocks, or None if a window group lacks one that a
        query right after them reads."""
        prefix = GroupedPrefix(num_blocks)
        for group in range(self.num_groups):
            first = self._first_seen(group, num_blocks * self.block_size)
            table: Table = [None] * first
            for index in range(first, num_blocks):
                found = self._find(group, hashes[index])
                if found is None:
                    return None
                block, on_host = found
                if on_host:
                    prefix.host_loads.append((group, index, block))
                table.append(None if on_host else block)
            prefix.tables.append(table)
        return prefix

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: GroupedPrefix = _NO_PREFIX) -> BlockAllocation | None:
        request_id = request.request_id
        tables = self._tables.get(request_id)
        computed = request.num_computed_tokens + cached.num_blocks * self.block_size
        if tables is not None:
            self._release_unseen(request_id, tables, computed)
        owned = 0 if tables is None else len(tables[0])
        needed = cdiv(computed + num_new_tokens, self.block_size)
        first_write = computed // self.block_size
        shared = [] if tables is None else [group for group, table in enumerate(tables)
                                            if first_write < owned and (block := table[first_write]) is not None
                                            and block.ref_cnt > 1]
        num_loads = len(cached.host_loads)
        num_new_blocks = self.num_groups * max(0, needed - max(owned, cached.num_blocks)) + len(shared) + num_loads
        if tables is not None and not num_new_blocks:
            self._cache_full_blocks(request, tables, computed + num_new_tokens)
            return _UNCHANGED
        hits = [block for table in cached.tables for block in table if block is not None]
        if num_new_blocks + sum(1 for block in hits if block.ref_cnt == 0) > self.pool.num_free_blocks:
            return None
        if tables is None:
            tables = self._tables[request_id] = [list(table) for table in cached.tables] or [
                [] for _ in range(self.num_groups)]
            self._num_released[request_id] = 0  # a hit's leading None entries are skipped, not freed
            self.pool.touch(hits)
            for block in hits:
                block.reused = True
        # Hits on blocks that another request's loads fill in this step are read from the next one.
        loading = bool(num_loads) or any(block.block_id in self._landing for block in hits)
        new_blocks = self.pool.allocate(num_new_blocks)
        if num_loads:
            self._load_from_host(cached, tables, new_blocks[:num_loads])
            del new_blocks[:num_loads]
        self._report_evictions()
        for group in shared:
            self._copy_on_write(tables[group], first_write, new_blocks.pop(0))
        new_ids = []
        for _ in range(len(tables[0]), needed):
            for table in tables:
                block = new_blocks.pop(0)
                table.append(block)
                new_ids.append(block.block_id)
        self._release_unseen(request_id, tables, computed)
        if loading:  # it computes from the next step: only its cached prefix is indexed now
            self._loading.add(request_id)
        self._cache_full_blocks(request, tables, computed if loading else computed + num_new_tokens)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return BlockAllocation(new_ids, bool(shared))

    def _load_from_host(self, cached: GroupedPrefix, tables: list[Table], blocks: list[KVCacheBlock]) -> None:
        """Fresh device blocks in the hit's table entries that only the host tier has, loaded in this step."""
        for (group, index, _), block in zip(cached.host_loads, blocks, strict=True):
            tables[group][index] = block
            block.reused = True  # a hit in the host tier: as much a reuse as a device hit
            self._landing.add(block.block_id)
        num_tokens = len({index for _, index, _ in cached.host_loads}) * self.block_size
        self.host.load_prefix([host_block for *_, host_block in cached.host_loads], blocks, num_tokens)

    def _release_unseen(self, request_id: str, tables: list[Table], position: int) -> None:
        """Free the window groups' blocks that no query at `position` or later reads."""
        released = self._num_released.get(request_id, 0)
        for group, table in enumerate(tables):
            first = min(self._first_seen(group, position), len(table))
            if first <= released:
                continue
            unseen = [block for block in table[released:first] if block is not None]
            table[released:first] = [None] * (first - released)
            self.pool.free(unseen[::-1])
        # Every window group has let go of the blocks before the nearest of their first seen blocks.
        self._num_released[request_id] = max(released, min(
            (min(self._first_seen(group, position), len(tables[group])) for group in range(self.num_groups)
             if self.layout.group_windows[group] is not None), default=0))

    def _cache_full_blocks(self, request: Request, tables: list[Table], num_tokens: int) -> None:  # type: ignore[override]
        if not self.pool.enable_caching:
            return
        num_full = min(num_tokens, len(request.token_ids)) // self.block_size
        start = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, _extra_keys(request),
                            _block_keys(request))
        for group, table in enumerate(tables):
            for index in range(start, num_full):
                block = table[index]
                if block is not None:
                    self.pool.cache(block, self._key(group, request.block_hashes[index]))
        self._num_hashed_blocks[request.request_id] = num_full

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        count = cdiv(num_tokens, self.block_size)
        tables = [table[:count] for table in self._tables[parent.request_id]]
        self.pool.touch([block for table in tables for block in table if block is not None])
        self._tables[child.request_id] = tables
        self._num_released[child.request_id] = self._num_released.get(parent.request_id, 0)
        parent_hashed = self._num_hashed_blocks.get(parent.request_id, 0)
        self._num_hashed_blocks[child.request_id] = min(parent_hashed, num_tokens // self.block_size)
        self.stats.shared_blocks += sum(1 for table in tables for block in table if block is not None)

    def block_ids(self, request: Request) -> list[int]:
        """The request's tables interleaved (block j of group g at j * G + g); a freed block's entry is 0, which
        no kernel reads: it lies outside every window."""
        tables = self._tables.get(request.request_id)
        if tables is None:
            return []
        return [0 if block is None else block.block_id for row in zip(*tables, strict=True) for block in row]

    def free(self, request: Request) -> None:
        self._loading.discard(request.request_id)
        tables = self._tables.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)
        self._num_hashed_blocks.pop(request.request_id, None)
        if tables is not None:
            # Tail first, as the plain manager does: a prefix outlives its suffix in the free queue.
            blocks = [block for row in zip(*tables, strict=True) for block in row if block is not None]
            self.pool.free(blocks[::-1])

    def held_layout(self, num_tokens: int) -> list[int]:
        """Each group's first block that a request computed up to `num_tokens` still holds (0 for a full group):
        it holds that group's blocks from there to ceil(num_tokens / block_size) - 1."""
        return [self._first_seen(group, num_tokens) for group in range(self.num_groups)]

    def held_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The blocks of the request's computed tokens that its groups hold, interleaved (`held_layout`), after
        freeing what no later query reads."""
        tables, computed = self._tables[request.request_id], request.num_computed_tokens
        self._release_unseen(request.request_id, tables, computed)
        count = cdiv(computed, self.block_size)
        return [block for row in zip(*(table[:count] for table in tables)) for block in row if block is not None]

    def swap_out(self, request: Request) -> bool:
        """Preempt by swapping only the blocks each group still holds (the window's for a window group)."""
        if request.request_id not in self._tables:
            return False
        if not any(connector.save_preempted(request, self.held_blocks(request)) for connector in self.connectors):
            return False
        self.free(request)
        return True

    def allocate_held(self, request: Request, connector: KVConnector, num_held_tokens: int,
                      num_new_tokens: int) -> bool:
        """Fresh blocks per group for what the connector holds (`held_layout`, loaded in this step) and for
        `num_new_tokens` more; False, changing nothing, if the pool is too short."""
        needed = cdiv(num_held_tokens + num_new_tokens, self.block_size)
        firsts = self.held_layout(num_held_tokens)
        if sum(max(0, needed - first) for first in firsts) > self.pool.num_free_blocks:
            return False
        tables: list[Table] = [[] for _ in range(self.num_groups)]
        held: list[KVCacheBlock] = []
        for index in range(needed):  # allocated in the interleaved order, so the held ones come first
            for group, table in enumerate(tables):
                block = self.pool.allocate(1)[0] if index >= firsts[group] else None
                table.append(block)
                if block is not None and index * self.block_size < num_held_tokens:
                    held.append(block)
        self._tables[request.request_id] = tables
        self._num_released[request.request_id] = 0  # the leading None entries are skipped, not freed
        connector.update_state_after_alloc(request, held, num_held_tokens)
        self._report_evictions()
        self._loading.add(request.request_id)  # its blocks are indexed once it computes, in the next step
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return True
