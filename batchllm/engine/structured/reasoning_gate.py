"""Structured outputs under a reasoning parser: the grammar constrains the answer, not the reasoning.

A constrained request's matcher is wrapped in a `ReasoningGate`: while the model reasons every token passes (its
bitmask row allows the whole vocabulary), the output being decoded as it grows; once the parser sees the reasoning
end (`answer_offset`: Qwen3's `</think>`, harmony's final channel opened), the grammar's matcher takes every later
token. The prompt's end says whether the output starts inside an open section (`prompt_prefix`).

Limits: an output that never ends its reasoning is never constrained (and finishes with the grammar's "incomplete"
note); a token that closes the reasoning and carries non-blank answer text with it (a tokenizer whose marker is no
token of its own) is refused, since a grammar takes whole tokens. A prompt that closed the section itself (Qwen3's
enable_thinking=False) is constrained from the first token. Constrained requests are never speculated on, so
a gate is never rolled back into its reasoning.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers.decoders import DecodeStream

from batchllm.reasoning import PROMPT_TAIL_TOKENS, ReasoningParser


class ReasoningGate:
    def __init__(self, matcher: Any, parser: ReasoningParser, tokenizer: Any, prompt_token_ids: list[int],
                 open_row: np.ndarray) -> None:
        tail = tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        self.inner = matcher
        self.reasoning = not parser.prompt_skips_reasoning(tail)  # the grammar has not started yet
        self._parser = parser
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)  # the markers may be special tokens (harmony)
        self._text = parser.prompt_prefix(tail)
        self._open_row = open_row

    def accept_token(self, token_id: int) -> bool:
        if not self.reasoning:
            return self.inner.accept_token(token_id)
        self._text += self._stream.step(self._backend, token_id) or ""
        offset = self._parser.answer_offset(self._text)
        if offset is not None:
            if self._text[offset:].strip():
                return False  # the token holds answer text the grammar never saw
            self.reasoning = False
        return True

    def rollback(self, num_tokens: int) -> None:
        if self.reasoning:
            raise RuntimeError("a reasoning gate cannot roll back reasoning tokens")
        self.inner.rollback(num_tokens)

    def fill_bitmask(self, out: np.ndarray) -> None:
        if self.reasoning:
            out[:] = self._open_row
        else:
            self.inner.fill_bitmask(out)

    @property
    def is_terminated(self) -> bool:
        return not self.reasoning and self.inner.is_terminated

    @property
    def can_finish(self) -> bool:
        return not self.reasoning and self.inner.can_finish

    @property
    def error(self) -> str | None:
        return None if self.reasoning else self.inner.error
