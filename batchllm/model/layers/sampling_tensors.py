"""A step's per-row sampling parameters, gathered on the host and uploaded to the device for `Sampler`."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from batchllm.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One request's sampling state for a step.

    `generator` must be set exactly when `params.seed` is set: the caller creates it once per request
    with `make_generator` and keeps it across steps, so a seeded request's tokens depend only on its
    own logits and seed, never on the rest of the batch.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator of a seeded request; it must live on the device the sampler runs on."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(slots=True)
class PenaltyTensors:
    """Penalty parameters of a batch, on the device.

    Token occurrences travel as flat indices `row * vocab_size + token_id`, so rows of any length need
    no padding and the device builds the `[B, V]` tables with one scatter each. An unused penalty is None.
    """

    repetition: torch.Tensor | None  # [B] float32, 1 on rows without it
    frequency: torch.Tensor | None  # [B] float32, 0 on rows without it
    presence: torch.Tensor | None  # [B] float32, 0 on rows without it
    output_index: torch.Tensor  # [N] long: every output token of a penalised row, repeats included
    prompt_index: torch.Tensor | None  # [M] long: prompt tokens of rows with a repetition penalty


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, on the device, rows in the order of the logits.

    A tensor that is None means no row needs that stage, and the sampler skips it. Rows that do not use
    a stage carry a neutral value in its tensor (top_k = vocab_size, top_p = +inf, min_p = 0, ...).
    """

    all_greedy: bool
    greedy: torch.Tensor | None  # [B] bool; None unless the batch mixes greedy and random rows
    temperature: torch.Tensor | None  # [B] float32 (1 on greedy rows); None when every random row has 1
    top_k: torch.Tensor | None  # [B] long
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    penalties: PenaltyTensors | None
    banned_index: torch.Tensor | None  # [N] long, flat `row * V + token`: stop tokens under min_tokens
    generators: list[tuple[int, torch.Generator]]  # (row, generator) of seeded random rows
    num_logprobs: list[int | None]  # per row, as asked in SamplingParams.logprobs
    max_num_logprobs: int | None  # None when no row asks for logprobs
    # Structured outputs: the rows a grammar constrains and their allowed-token bitmask ([N, ceil(V / 32)] int32).
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None

    def add_grammar(self, rows: list[int], bitmask: np.ndarray, device: torch.device) -> None:
        self.grammar_rows = _upload(torch.tensor(rows, dtype=torch.long), device)
        self.grammar_bitmask = _upload(torch.from_numpy(bitmask), device)

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Collection[int] = (),
    ) -> SamplingTensors:
        """Gathers the batch's parameters into device tensors.

        `eos_token_ids` are the model's end-of-sequence ids: a row with fewer than `min_tokens` outputs
        has them (unless `ignore_eos`) and its `stop_token_ids` masked, so it cannot stop early.
        """
        device = torch.device(device)
        params = [row.params for row in rows]
        for row in rows:
            if (row.params.seed is None) != (row.generator is None):
                raise ValueError("SamplingRow.generator must be set exactly when params.seed is set")

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return _upload(torch.tensor(values, dtype=dtype), device)

        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        greedy_mask = temperature = top_k = top_p = min_p = None
        generators: list[tuple[int, torch.Generator]] = []
        if not all_greedy:
            if any(greedy):
                greedy_mask = column(greedy, torch.bool)
            # Greedy rows get neutral values so that the random path stays finite on them; its result
            # is discarded there.
            random = [p for p, g in zip(params, greedy) if not g]
            if any(p.temperature != 1 for p in random):
                temperature = column([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)
            if any(0 < p.top_k < vocab_size for p in random):
                ks = [p.top_k if not g and 0 < p.top_k < vocab_size else vocab_size for p, g in zip(params, greedy)]
                top_k = column(ks, torch.long)
            if any(p.top_p < 1 for p in random):
                # +inf, not 1.0, disables a row: float rounding lets the cumulative sum pass 1.0 and would
                # otherwise cut the tail of a row that asked for no cut at all.
                ps = [p.top_p if not g and p.top_p < 1 else float("inf") for p, g in zip(params, greedy)]
                top_p = column(ps, torch.float32)
            if any(p.min_p > 0 for p in random):
                min_p = column([0.0 if g else p.min_p for p, g in zip(params, greedy)], torch.float32)
            generators = [
                (i, row.generator) for i, row in enumerate(rows) if row.generator is not None and not greedy[i]
            ]

        num_logprobs = [p.logprobs for p in params]
        requested = [k for k in num_logprobs if k is not None]
        return cls(
            all_greedy=all_greedy,
            greedy=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            penalties=_build_penalties(rows, vocab_size, device),
            banned_index=_build_banned_index(rows, vocab_size, device, eos_token_ids),
            generators=generators,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
        )


def _build_penalties(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> PenaltyTensors | None:
    params = [row.params for row in rows]
    if not any(p.uses_penalties for p in params):
        return None

    def optional_column(values: list[float], neutral: float) -> torch.Tensor | None:
        if all(v == neutral for v in values):
            return None
        return _upload(torch.tensor(values, dtype=torch.float32), device)

    repetition = optional_column([p.repetition_penalty for p in params], 1.0)
    prompt_index = None
    if repetition is not None:
        prompts = [(i, row.prompt_token_ids) for i, row in enumerate(rows) if row.params.repetition_penalty != 1]
        prompt_index = _upload(_flat_index(prompts, vocab_size), device)
    outputs = [(i, row.output_token_ids) for i, row in enumerate(rows) if row.params.uses_penalties]
    return PenaltyTensors(
        repetition=repetition,
        frequency=optional_column([p.frequency_penalty for p in params], 0.0),
        presence=optional_column([p.presence_penalty for p in params], 0.0),
        output_index=_upload(_flat_index(outputs, vocab_size), device),
        prompt_index=prompt_index,
    )


def _build_banned_index(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device, eos_token_ids: Collection[int]
) -> torch.Tensor | None:
    banned = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        # ignore_eos means EOS does not end the request, so there is nothing to protect against.
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        in_vocab = [token for token in stop_ids if token < vocab_size]
        if in_vocab:
            banned.append((i, in_vocab))
    if not banned:
        return None
    return _upload(_flat_index(banned, vocab_size), device)


def _flat_index(rows_tokens: list[tuple[int, Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """Host tensor of `row * vocab_size + token` for every (row, token) pair."""
    row_ids = torch.tensor([row for row, _ in rows_tokens], dtype=torch.long)
    lengths = torch.tensor([len(tokens) for _, tokens in rows_tokens], dtype=torch.long)
    # np.fromiter reads the token lists about 4x faster than torch.tensor(list): it is per-step host work.
    flat = chain.from_iterable(tokens for _, tokens in rows_tokens)
    tokens = torch.from_numpy(np.fromiter(flat, dtype=np.int64, count=int(lengths.sum())))
    return row_ids.repeat_interleave(lengths) * vocab_size + tokens


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pinned memory the copy is asynchronous, so building the next step's tensors overlaps the
    # running forward pass; the caching host allocator keeps the buffer alive until the copy is done.
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
