"""One sample's progress as its consumer has seen it: tokens reported so far, and incremental text.

Streamed text is decoded with the `tokenizers` DecodeStream (as the engine's detokenizer does for stop
strings: it handles characters split across tokens). A request with stop strings holds back its last
`max(len(stop)) - 1` characters until it finishes: a stop string that is still being completed is never sent,
and the final update sends the rest of the engine's final text (which trims the stop string), so the
concatenated updates equal the text a non-streaming request gets.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers.decoders import DecodeStream

from batchllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class SampleProgress:
    def __init__(self, request_id: str, index: int, params: SamplingParams, backend_tokenizer: Any,
                 incremental: bool) -> None:
        self.request_id = request_id
        self.index = index
        self.num_tokens = 0  # output tokens reported to the consumer
        self.last_token_time: float | None = None
        self.done = False
        self._backend = backend_tokenizer if incremental else None
        self._decoder = None
        if self._backend is not None:
            self._decoder = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._text = ""
        self._num_sent_chars = 0
        self._holdback = max((len(s) for s in params.stop_strings), default=1) - 1

    def text_of(self, new_token_ids: list[int]) -> str:
        """The text that may be sent for the sample's next tokens (empty without a tokenizer)."""
        if self._decoder is None:
            return ""
        for token_id in new_token_ids:
            chunk = self._decoder.step(self._backend, token_id)
            if chunk:
                self._text += chunk
        sendable = len(self._text) - self._holdback
        if sendable <= self._num_sent_chars:
            return ""
        delta = self._text[self._num_sent_chars:sendable]
        self._num_sent_chars = sendable
        return delta

    def rest_of(self, final_text: str) -> str:
        """What is left to send of the sample's final text."""
        sent = self._text[:self._num_sent_chars]
        if not final_text.startswith(sent):  # incremental and one-shot decoding disagree: should not happen
            logger.warning("request %s: streamed text %r is not a prefix of its final text %r", self.request_id,
                           sent, final_text)
        return final_text[len(sent):]
