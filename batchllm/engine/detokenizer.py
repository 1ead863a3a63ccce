"""Token ids → text, incrementally where stop strings need it, and the stop rules.

Requests with stop strings are detokenized as their tokens arrive (the `tokenizers` DecodeStream, which
handles multi-byte characters split across tokens), so a stop string ends generation on the step it
appears. Requests without stop strings are decoded once, when they finish: cheaper on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from tokenizers.decoders import DecodeStream

from batchllm.engine.request import Request, RequestStatus


@dataclass(slots=True)
class _StreamState:
    stream: DecodeStream
    text: str = ""
    num_tokens: int = 0  # output tokens fed into the stream so far
    scanned_chars: int = 0  # text before this offset has been checked for stop strings


@dataclass
class Detokenizer:
    """`tokenizer` is a transformers tokenizer backed by `tokenizers` (a "fast" tokenizer), or None for
    token-ids-only engines: texts are then empty and stop strings are refused."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    # False: `finish` leaves the final text to the consumer (the server's HTTP process decodes it with
    # `final_text`, so the engine process spends its time on steps).
    decode_finished: bool = True
    _streams: dict[str, _StreamState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._backend = None if self.tokenizer is None else self.tokenizer.backend_tokenizer

    def check_stop(self, request: Request) -> bool:
        """Decide whether `request` stops after its newest token; sets its status and stop_reason."""
        params = request.sampling_params
        token = request.token_ids[-1]
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return _finish(request, RequestStatus.FINISHED_STOPPED, token)
            if token in params.stop_token_ids:
                return _finish(request, RequestStatus.FINISHED_STOPPED, token)
        if params.stop_strings:
            if self._backend is None:
                raise ValueError("stop strings need a tokenizer (the LLM was built with skip_tokenizer_init=True)")
            stop = self._find_stop_string(request)
            if stop is not None and num_output >= params.min_tokens:
                return _finish(request, RequestStatus.FINISHED_STOPPED, stop)
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return _finish(request, RequestStatus.FINISHED_LENGTH, None)
        return False

    def _find_stop_string(self, request: Request) -> str | None:
        state = self._streams.get(request.request_id)
        if state is None:
            state = self._streams[request.request_id] = _StreamState(
                DecodeStream(skip_special_tokens=request.sampling_params.skip_special_tokens)
            )
        for token in request.output_token_ids[state.num_tokens:]:
            chunk = state.stream.step(self._backend, token)
            if chunk:
                state.text += chunk
        state.num_tokens = request.num_output_tokens
        stops = request.sampling_params.stop_strings
        # A stop string may straddle the previous step's text: rescan the last (longest stop - 1) chars.
        start = max(0, state.scanned_chars - max(len(s) for s in stops) + 1)
        state.scanned_chars = len(state.text)
        hits = [(pos, s) for s in stops if (pos := state.text.find(s, start)) >= 0]
        return min(hits)[1] if hits else None

    def finish(self, request: Request) -> str:
        """The request's final text (stop string cut off unless asked for), releasing its stream."""
        self._streams.pop(request.request_id, None)
        if not self.decode_finished:
            return ""
        return final_text(self.tokenizer, request.output_token_ids, request.sampling_params, request.stop_reason)

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)


def _finish(request: Request, status: RequestStatus, reason: int | str | None) -> bool:
    request.status = status
    request.stop_reason = reason
    return True


def final_text(tokenizer: Any, output_token_ids: list[int], params: Any, stop_reason: int | str | None) -> str:
    """A finished request's text: its output decoded, cut at the stop string that ended it (kept with
    `include_stop_str_in_output`); empty without a tokenizer."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(output_token_ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(stop_reason, str):
        # rfind: the stop that fired is the newest occurrence (min_tokens may have let earlier ones pass).
        cut = text.rfind(stop_reason)
        if cut >= 0:
            text = text[: cut + len(stop_reason)] if params.include_stop_str_in_output else text[:cut]
    return text
