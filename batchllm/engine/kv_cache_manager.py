"""Which KV-cache blocks each request owns.

Blocks are allocated on demand, as a request's computed tokens grow, and all of a request's blocks are
returned when it finishes or is preempted. Invariant: a request with `num_computed_tokens + n` tokens
scheduled owns exactly `ceil((num_computed_tokens + n) / block_size)` blocks.
"""

from __future__ import annotations

from batchllm.engine.block_pool import BlockPool, KVCacheBlock
from batchllm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self.peak_used_blocks = 0

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        owned = len(self._blocks.get(request.request_id, ()))
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - owned)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's blocks to hold `num_new_tokens` more tokens.

        Returns the ids of the newly added blocks, or None (and changes nothing) if the pool is too short.
        """
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.allocate(needed)
        self._blocks.setdefault(request.request_id, []).extend(new_blocks)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return [block.block_id for block in new_blocks]

    def block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self._blocks.get(request.request_id, ())]

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        # Tail first: once prefix caching keeps freed contents, the blocks of a prefix outlive its suffix.
        self.pool.free(blocks[::-1])
