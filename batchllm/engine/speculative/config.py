"""`speculative_config`: which proposer drafts tokens, how many, and the adaptive policy's knobs.

The keys are vLLM's (`method`, `num_speculative_tokens`, `prompt_lookup_min`/`max`, `model`), plus three of
ours: `adaptive` (default True: speculate only where the expected accepted tokens pay for the verification,
see `policy.py`), `overhead_tokens` (the policy's cost of a forward pass, in tokens) and
`verify_overhead_tokens` (a verification step's cost beyond its tokens); None: the device's default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

NGRAM, DRAFT_MODEL, EAGLE, EAGLE3, MEDUSA = "ngram", "draft_model", "eagle", "eagle3", "medusa"
SPEC_METHODS = (NGRAM, DRAFT_MODEL, EAGLE, EAGLE3, MEDUSA)
# Proposers that run in the model runner on the device and return their drafts with the step's tokens.
DEVICE_METHODS = (DRAFT_MODEL, EAGLE, EAGLE3, MEDUSA)
MAX_SPECULATIVE_TOKENS = 16
# The policy's default cost of one forward pass in token units: reading the weights once costs about as
# much as this many extra query tokens (measured, benchmarks/README.md "Speculative decoding").
DEFAULT_OVERHEAD_TOKENS = {"cpu": 8.0, "cuda": 96.0}
# What a step that verifies drafts costs beyond its tokens, in the same units, by device and by where the drafts
# come from. On an H200, with verification steps replayed from CUDA graphs, a verifying step still drains the
# asynchronous loop and runs the rejection sampler: ~1.2 ms more than a decode step (smollm2), ~0.25 passes of
# llama3-8b (n-gram); a device proposer adds its own passes (EAGLE, k = 4: 6.7 ms, ~1.4 passes). See
# benchmarks/README.md, "Speculative decoding". On the CPU, where no step has a graph, the measured speedups
# match `overhead_tokens + T` alone.
DEFAULT_VERIFY_OVERHEAD_TOKENS = {("cpu", False): 0.0, ("cpu", True): 0.0, ("cuda", False): 40.0,
                                  ("cuda", True): 130.0}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    adaptive: bool = True
    overhead_tokens: float | None = None
    verify_overhead_tokens: float | None = None

    @property
    def on_device(self) -> bool:
        return self.method in DEVICE_METHODS

    def overhead_for(self, device_type: str) -> float:
        return self.overhead_tokens if self.overhead_tokens is not None else DEFAULT_OVERHEAD_TOKENS[device_type]

    def verify_overhead_for(self, device_type: str) -> float:
        if self.verify_overhead_tokens is not None:
            return self.verify_overhead_tokens
        return DEFAULT_VERIFY_OVERHEAD_TOKENS[device_type, self.on_device]


def parse_speculative_config(value: Any, source: str = "speculative_config") -> SpeculativeConfig | None:
    """A `SpeculativeConfig` from a dict, a JSON string (the CLI's `--speculative-config`) or None; every
    error names `source` and the key at fault."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{source} must be a dict (or a JSON object), got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{source} has unknown keys {unknown}; known: {sorted(known)}")
    method = value.get("method")
    if method not in SPEC_METHODS:
        raise ValueError(f"{source}: method must be one of {list(SPEC_METHODS)}, got {method!r}")
    k = value.get("num_speculative_tokens")
    if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{source}: num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], "
                         f"got {k!r}")
    config = SpeculativeConfig(**value)
    if method == NGRAM:
        if config.model is not None:
            raise ValueError(f"{source}: method 'ngram' takes no model (got {config.model!r})")
        lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
        if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
            raise ValueError(f"{source}: prompt_lookup_min and prompt_lookup_max must be ints with 1 <= min <= max, "
                             f"got {lo!r} and {hi!r}")
    elif not isinstance(config.model, str) or not config.model:
        raise ValueError(f"{source}: method {method!r} needs 'model', the directory of the "
                         f"{'draft model' if method == DRAFT_MODEL else method + ' heads'}")
    if not isinstance(config.adaptive, bool):
        raise ValueError(f"{source}: adaptive must be true or false, got {config.adaptive!r}")
    for key in ("overhead_tokens", "verify_overhead_tokens"):
        value = getattr(config, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{source}: {key} must be a number >= 0 or null, got {value!r}")
    return config


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
