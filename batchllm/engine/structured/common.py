"""What both grammar engines' wrappers share: the error type, the JSON layout, and the bitmask rows' vocabulary.

A bitmask row is int32 words of ceil(tokenizer_size / 32): bit `t % 32` of word `t // 32` is set when token `t`
may come next (llguidance and xgrammar write this same layout). The engines see the tokenizer's vocabulary only:
the model's padding ids past it (its vocab_size may be larger) have no bits, and whoever applies a row to the
logits forbids them (`kernels.apply_token_bitmask_`). A padded vocabulary would cost xgrammar 7-15x per
accepted token and per fill (measured with SmolLM2's 49k tokens on a 128k model). Whatever the engine writes,
a row never allows an id the tokenizer lacks; a finished matcher's row allows the EOS ids alone. No grammar
engine is imported here (no torch either).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Hashable
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")

# The JSON layout of both engines: one line, as `json.dumps` writes it (between items, after keys).
JSON_SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """A constraint the grammar engine rejects; the message names its kind and carries the engine's error."""


class CompileCache(Generic[T]):
    """Compiled constraints by key, each compiled once; a rejection is cached too and raised on every use."""

    def __init__(self) -> None:
        self._items: dict[Hashable, T | GrammarError] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, compile_once: Callable[[], T]) -> T:
        with self._lock:
            compiled = self._items.get(key)
            if compiled is None:
                try:
                    compiled = compile_once()
                except GrammarError as error:
                    compiled = error
                self._items[key] = compiled
        if isinstance(compiled, GrammarError):
            raise GrammarError(*compiled.args)
        return compiled


class AcceptedTokens:
    """Which accepted tokens the grammar engine counted: an EOS after the grammar's end is accepted but not
    counted, so a rollback must undo only the engine's own tokens."""

    def __init__(self) -> None:
        self._counted: list[bool] = []

    def add(self, counted: bool = True) -> None:
        self._counted.append(counted)

    def take_back(self, num_tokens: int) -> int:
        """Forget the last `num_tokens`; returns how many of them the engine must roll back."""
        if not 0 <= num_tokens <= len(self._counted):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._counted)} were accepted")
        if num_tokens == 0:
            return 0
        counted = sum(self._counted[-num_tokens:])
        del self._counted[-num_tokens:]
        return counted


def tokenizer_size(tokenizer) -> int:
    """Token ids the tokenizer has, added tokens included (a fast tokenizer's)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured outputs need a fast (tokenizers-backed) tokenizer")
    return backend.get_vocab_size(with_added_tokens=True)


class BitmaskRows:
    """The vocabulary every row shares: its width, the EOS-only row, and the padding bits no row may have."""

    def __init__(self, tokenizer_size: int, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        eos = sorted({int(t) for t in eos_token_ids})
        if not eos:
            raise ValueError("GrammarCompiler needs at least one EOS token id")
        if vocab_size < tokenizer_size:
            raise ValueError(f"the model's vocab_size {vocab_size} is smaller than the tokenizer's "
                             f"{tokenizer_size} tokens")
        if eos[-1] >= tokenizer_size or eos[0] < 0:
            raise ValueError(f"EOS ids {eos} are outside the tokenizer's {tokenizer_size} tokens")
        self.tokenizer_size = tokenizer_size
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos)
        self.width = (tokenizer_size + 31) // 32
        self.eos_row = np.zeros(self.width, dtype=np.int32)
        for t in eos:
            self.eos_row[t // 32] |= np.uint32(1 << (t % 32)).view(np.int32)
        # Cleared after every fill: the bits of the last word past the tokenizer's ids.
        self._tail = tokenizer_size // 32
        self._tail_keep = np.zeros(self.width - self._tail, dtype=np.int32)
        if self._tail < self.width:
            self._tail_keep[0] = np.uint32((1 << (tokenizer_size % 32)) - 1).view(np.int32)

    def clean(self, out: np.ndarray) -> None:
        """Clear the padding bits in every row of `out` ([..., width])."""
        if self._tail < self.width:
            out[..., self._tail:] &= self._tail_keep


def check_out(out: np.ndarray, shape: tuple[int, ...]) -> None:
    if out.dtype != np.int32 or out.shape != shape or not out.flags["C_CONTIGUOUS"] or not out.flags["WRITEABLE"]:
        raise ValueError(f"bitmask must be a writeable C-contiguous int32 array of shape {shape}, got "
                         f"{out.dtype} {out.shape}")
