"""Beam search on top of the engine, with HF transformers' selection and stopping rules.

Each step asks the engine, for every live beam, for the top `2 * beam_width` next-token log-probabilities
(one-token requests). Beams of a prompt share their history's K/V through the prefix cache: every full
16-token block of the common history is computed once and hit by all beams and all later steps; only the
partly filled last block is recomputed per beam (at most 15 tokens), which plays the role that a
copy-on-write of that block would.

Selection follows `transformers` `generate(num_beams=k, do_sample=False)` with `early_stopping=False`:
- the best `2k` continuations over all beams are ranked by cumulative log-probability;
- of those, the ones among the top `k` that end (EOS, or `max_tokens` reached) join the finished pool
  with score `cum_logprob / generated_len ** length_penalty`; the best `k` non-ending ones run on;
- the search ends when no continuation can run on, or when the finished pool is full and the best running
  beam, scored at its current length, cannot beat the worst finished one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from batchllm.outputs import RequestOutput
from batchllm.sampling_params import SamplingParams

# `LLM.generate` for token-id prompts, without a progress bar. Beam search takes the engine's pieces, not
# the `LLM` itself, so that the facade can import this module without an import cycle.
GenerateFn = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]

_MAX_BEAM_WIDTH = 10  # 2 * beam_width logprobs are requested per beam; SamplingParams caps logprobs at 20


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ValueError(f"BeamSearchParams.{name} must be {expected}, got {getattr(self, name)!r}")

        check(_is_int(self.beam_width) and 1 <= self.beam_width <= _MAX_BEAM_WIDTH, "beam_width",
              f"an int in [1, {_MAX_BEAM_WIDTH}]")
        check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an int >= 1")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "True or False")
        check(_is_int(self.length_penalty) or (isinstance(self.length_penalty, float)
                                                and math.isfinite(self.length_penalty)), "length_penalty",
              "a finite number")


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens (EOS included when the beam ended on it)
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    text: str = ""


@dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _Beam:
    token_ids: list[int]
    cum_logprob: float


@dataclass
class _PromptSearch:
    prompt_token_ids: list[int]
    running: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    can_improve: bool = True
    done: bool = False


def beam_search(generate: GenerateFn, tokenizer: Any, eos_token_ids: frozenset[int],
                prompts: Sequence[str | list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    token_lists = [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
    searches = [_PromptSearch(ids, [_Beam([], 0.0)]) for ids in token_lists]
    eos = frozenset() if params.ignore_eos else eos_token_ids
    step_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2 * params.beam_width)
    for _ in range(params.max_tokens):
        live = [s for s in searches if not s.done]
        if not live:
            break
        beams = [(search, beam) for search in live for beam in search.running]
        outputs = generate([search.prompt_token_ids + beam.token_ids for search, beam in beams], step_params)
        candidates: dict[int, list[tuple[float, _Beam, int]]] = {id(s): [] for s in live}
        for (search, beam), output in zip(beams, outputs):
            if output.error:
                raise ValueError(f"beam search: prompt {searches.index(search)} failed: {output.error}")
            for token_id, logprob in output.outputs[0].logprobs[0].items():
                candidates[id(search)].append((beam.cum_logprob + logprob.logprob, beam, token_id))
        for search in live:
            _advance(search, candidates[id(search)], params, eos)
    return [_finish(tokenizer, text, search) for text, search in zip(prompts, searches)]


def _advance(search: _PromptSearch, candidates: list[tuple[float, _Beam, int]], params: BeamSearchParams,
             eos: frozenset[int]) -> None:
    k = params.beam_width
    ranked = sorted(candidates, key=lambda c: -c[0])[: 2 * k]
    generated_len = len(search.running[0].token_ids) + 1
    ends = [token in eos or generated_len >= params.max_tokens for _, _, token in ranked]
    if search.can_improve:
        for (score, beam, token), ended in zip(ranked[:k], ends[:k]):
            if ended:
                search.finished.append(BeamSearchSequence(
                    beam.token_ids + [token], score, score / generated_len ** params.length_penalty))
        search.finished = sorted(search.finished, key=lambda s: -s.score)[:k]
    search.running = [_Beam(beam.token_ids + [token], score)
                      for (score, beam, token), ended in zip(ranked, ends) if not ended][:k]
    if search.running and len(search.finished) == k:
        best_possible = search.running[0].cum_logprob / generated_len ** params.length_penalty
        search.can_improve = best_possible > search.finished[-1].score
    search.done = not search.running or not search.can_improve


def _finish(tokenizer: Any, prompt: str | list[int], search: _PromptSearch) -> BeamSearchOutput:
    for sequence in search.finished:
        sequence.text = "" if tokenizer is None else tokenizer.decode(sequence.token_ids, skip_special_tokens=True)
    return BeamSearchOutput(prompt if isinstance(prompt, str) else None, search.prompt_token_ids, search.finished)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
