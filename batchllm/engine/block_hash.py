"""Content hashes of full KV-cache blocks, chained so that a hash names a whole prefix.

hash(block i) = sha256(hash(block i-1) ‖ token ids of block i ‖ extra keys). A match on block i's hash
therefore means the same tokens at the same positions with the same history, which is exactly when its
K/V can be reused. SHA-256 is used rather than Python's 64-bit `hash()` because a collision would silently
return another prompt's K/V: with a cryptographic hash that is not a practical event, even for
adversarial inputs, and the cost (about a microsecond per 16-token block) is small next to the step.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Callable, Sequence

BlockHash = bytes

_ROOT = hashlib.sha256(b"batchllm-prefix-cache-v1").digest()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    digest = hashlib.sha256(parent or _ROOT)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple = (), block_keys: Callable[[int, int], tuple] | None = None) -> None:
    """Append the hashes of the full blocks of `token_ids` not yet in `hashes`. `block_keys(start, end)`: what
    the block of tokens `[start, end)` depends on beside them and `extra_keys` (the images whose placeholders it
    holds: the same tokens with another image are other K/V)."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        keys = extra_keys if block_keys is None else extra_keys + block_keys(start, start + block_size)
        hashes.append(hash_block(parent, token_ids[start : start + block_size], keys))
