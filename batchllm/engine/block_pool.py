"""The pool of KV-cache blocks, its free list and the prefix-cache index.

Invariants:
- a block is in the free queue iff its `ref_cnt` is 0;
- `ref_cnt` never goes negative (freeing a free block raises);
- the free queue is ordered by eviction priority: the head is taken first. Freed blocks join the tail, so
  a block that was used recently is reused last (LRU), which is what lets cached contents survive longest;
  a block whose contents live on elsewhere (a host block copied back to the device) may join the head;
- `cached[h] is b` iff `b.block_hash == h`: a full block keeps its hash (and stays findable) while it sits
  in the free queue, and loses it only when it is handed out again (lazy eviction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block is full and indexed in the prefix cache
    reused: bool = False  # found by a prefix-cache lookup since it was last handed out
    # Intrusive links of the free queue: O(1) removal from the middle without a search.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) append, pop-front and remove."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free, block.next_free = last, self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def prepend(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free, block.next_free = self._head, first
        first.prev_free = block
        self.num_free += 1

    def pop_front(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV-cache block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """`on_evict(block, block_hash)` is told of each cached block just before it is handed out for other
    contents (the host tier copies it out then: see host_tier.py)."""

    def __init__(self, num_blocks: int, enable_caching: bool = False,
                 on_evict: Callable[[KVCacheBlock, bytes], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV-cache pool needs at least one block, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        self.num_free_uncached = num_blocks  # free blocks that hold nothing cached: handing one out evicts nothing
        self.on_evict = on_evict

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, count: int) -> list[KVCacheBlock]:
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV-cache blocks, only {self.num_free_blocks} free")
        taken = [self.free_queue.pop_front() for _ in range(count)]
        for block in taken:
            if block.block_hash is not None:
                self._evict(block)
            else:
                self.num_free_uncached -= 1
            block.ref_cnt = 1
            block.reused = False
        return taken

    def _evict(self, block: KVCacheBlock) -> None:
        if self.on_evict is not None:
            self.on_evict(block, block.block_hash)
        del self.cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit or a shared block)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_free_uncached -= block.block_hash is None
            block.ref_cnt += 1

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Index a block that just became full. If an identical block is already indexed, keep that one:
        the new block stays private and is simply freed later."""
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def free(self, blocks: list[KVCacheBlock], first_out: bool = False) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue in the given order, at
        its tail, or with `first_out` at its head (each before the ones freed earlier: the last is evicted first)."""
        enqueue = self.free_queue.prepend if first_out else self.free_queue.append
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV-cache block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                enqueue(block)
                self.num_free_uncached += block.block_hash is None
