"""Per-request sampling options, with vLLM-compatible field names.

Validation happens at construction so that a bad value fails before any generation starts, with an
error naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchllm.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's max length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k logprobs returned for each sampled token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Checked before they are normalized: tuple(5) would raise a TypeError, and list("ab") hide the mistake.
        _check(self.stop is None or isinstance(self.stop, str) or _is_list_of(self.stop, str), "stop", self.stop,
               "a non-empty string, a list of them or None")
        _check(self.stop_token_ids is None or _is_list_of(self.stop_token_ids, int), "stop_token_ids",
               self.stop_token_ids, "a list of non-negative ints or None")
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self.stop_strings = _as_tuple(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an int >= 1")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "an int >= 0, or -1")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        # A seeded request's generator takes 64 bits: a larger seed would fail inside an engine step.
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed", self.seed,
               "an int in [-2**63, 2**64) or None")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an int >= 1 or None")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "an int >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"<= max_tokens ({self.max_tokens})")
        _check(all(self.stop_strings), "stop", self.stop, "non-empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "non-negative ints")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
        _check(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
               self.presence_penalty, "in [-2, 2]")
        _check(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
               self.frequency_penalty, "in [-2, 2]")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "> 0")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "an int in [0, 20] or None")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_row_state(self) -> bool:
        """Whether sampling a row needs more than its per-row columns (model/layers/sampling_tensors.py): a seeded
        generator, penalties, min_tokens (they read the row's tokens) or logprobs. Such rows are the few the host
        visits one by one."""
        return self.seed is not None or self.uses_penalties or self.min_tokens > 0 or self.logprobs is not None

    @property
    def reads_only_logits(self) -> bool:
        """Its next token depends on the logits alone: no row state and no grammar, which the host keeps between
        two tokens (decode bursts, engine/decode_burst.py, need that)."""
        return not self.needs_row_state and self.structured_outputs is None


def _as_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to a user


def _is_number(value: object) -> bool:
    """An int or a finite float (NaN and infinity are no temperature or penalty); bools are not numbers here."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _is_list_of(value: object, kind: type) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
