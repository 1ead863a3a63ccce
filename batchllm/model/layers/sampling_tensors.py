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
    own logits and seed, never on the rest of the batch. `position` (the index in the sequence of the token
    this row samples) reseeds the generator for that position (`position_seed`): a token then depends only on
    the seed and where it is, whichever steps and drafts led there. None: the generator's stream continues.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    position: int | None = None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator of a seeded request; it must live on the device the sampler runs on."""
    return torch.Generator(device=device).manual_seed(seed)


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for the token at `position`: an odd-multiplier mix, so nearby
    (seed, position) pairs land far apart."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63)


def keeps_token_history(params: SamplingParams) -> bool:
    """Penalties and min_tokens read the row's tokens so far; nothing else does."""
    return params.uses_penalties or params.min_tokens > 0


@dataclass(slots=True)
class SamplingColumns:
    """The per-row parameters every row has, one host array each, rows in the order of the logits.

    Greedy rows and rows that do not use a filter hold its neutral value (temperature 1, top_k 0, top_p +inf,
    min_p 0), so a stage is needed exactly when some entry differs from it. A runner keeps these columns for
    every live request and gathers a step's rows with one `take` per column (`executor/sampling_table.py`).
    """

    greedy: np.ndarray  # bool
    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int64, 0 = off
    top_p: np.ndarray  # float32, +inf = off
    min_p: np.ndarray  # float32

    @classmethod
    def empty(cls, num_rows: int) -> SamplingColumns:
        return cls(np.ones(num_rows, dtype=bool), np.ones(num_rows, dtype=np.float32),
                   np.zeros(num_rows, dtype=np.int64), np.full(num_rows, np.inf, dtype=np.float32),
                   np.zeros(num_rows, dtype=np.float32))

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplingColumns:
        columns = cls.empty(len(params))
        for row, p in enumerate(params):
            columns.set(row, p)
        return columns

    def set(self, row: int, p: SamplingParams) -> None:
        greedy = self.greedy[row] = p.greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_k[row] = 0 if greedy else p.top_k
        # +inf, not 1.0, disables a row: float rounding lets the cumulative sum pass 1.0 and would otherwise
        # cut the tail of a row that asked for no cut at all.
        self.top_p[row] = np.inf if greedy or p.top_p >= 1 else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p

    def take(self, rows: np.ndarray) -> SamplingColumns:
        return SamplingColumns(*(column.take(rows) for column in
                                 (self.greedy, self.temperature, self.top_k, self.top_p, self.min_p)))


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
    generators: list[tuple[int, torch.Generator, int | None]]  # (row, generator, draw seed) of seeded random rows
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
        """Gathers the batch's parameters into device tensors (see `from_columns`)."""
        columns = SamplingColumns.of([row.params for row in rows])
        special = [(i, row) for i, row in enumerate(rows) if row.params.needs_row_state]
        return cls.from_columns(columns, special, vocab_size, device, eos_token_ids)

    @classmethod
    def from_columns(
        cls,
        columns: SamplingColumns,
        special: Sequence[tuple[int, SamplingRow]],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Collection[int] = (),
    ) -> SamplingTensors:
        """Device tensors for a batch given as `columns` plus, for the rows that `SamplingParams.needs_row_state`, their
        (row, `SamplingRow`): host work is vectorized over the batch and per row only for those.

        `eos_token_ids` are the model's end-of-sequence ids: a row with fewer than `min_tokens` outputs
        has them (unless `ignore_eos`) and its `stop_token_ids` masked, so it cannot stop early.
        """
        device = torch.device(device)
        for _, row in special:
            if (row.params.seed is None) != (row.generator is None):
                raise ValueError("SamplingRow.generator must be set exactly when params.seed is set")
        num_rows = len(columns.greedy)

        def column(values: np.ndarray, needed: bool) -> torch.Tensor | None:
            return _upload(torch.from_numpy(values), device) if needed else None

        all_greedy = bool(columns.greedy.all())
        greedy_mask = temperature = top_k = top_p = min_p = None
        generators: list[tuple[int, torch.Generator, int | None]] = []
        if not all_greedy:
            greedy_mask = column(columns.greedy, bool(columns.greedy.any()))
            temperature = column(columns.temperature, bool((columns.temperature != 1).any()))
            enabled = (columns.top_k > 0) & (columns.top_k < vocab_size)
            top_k = column(np.where(enabled, columns.top_k, vocab_size), bool(enabled.any()))
            top_p = column(columns.top_p, bool(np.isfinite(columns.top_p).any()))
            min_p = column(columns.min_p, bool((columns.min_p > 0).any()))
            generators = [(i, row.generator, None if row.position is None else position_seed(row.params.seed,
                                                                                              row.position))
                          for i, row in special if row.generator is not None and not columns.greedy[i]]

        num_logprobs: list[int | None] = [None] * num_rows
        for i, row in special:
            num_logprobs[i] = row.params.logprobs
        requested = [row.params.logprobs for _, row in special if row.params.logprobs is not None]
        return cls(
            all_greedy=all_greedy,
            greedy=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            penalties=_build_penalties(special, num_rows, vocab_size, device),
            banned_index=_build_banned_index(special, vocab_size, device, eos_token_ids),
            generators=generators,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
        )


def _build_penalties(special: Sequence[tuple[int, SamplingRow]], num_rows: int, vocab_size: int,
                     device: torch.device) -> PenaltyTensors | None:
    penalised = [(i, row) for i, row in special if row.params.uses_penalties]
    if not penalised:
        return None

    def optional_column(name: str, neutral: float) -> torch.Tensor | None:
        values = np.full(num_rows, neutral, dtype=np.float32)
        for i, row in penalised:
            values[i] = getattr(row.params, name)
        if (values == neutral).all():
            return None
        return _upload(torch.from_numpy(values), device)

    repetition = optional_column("repetition_penalty", 1.0)
    prompt_index = None
    if repetition is not None:
        prompts = [(i, row.prompt_token_ids) for i, row in penalised if row.params.repetition_penalty != 1]
        prompt_index = _upload(_flat_index(prompts, vocab_size), device)
    return PenaltyTensors(
        repetition=repetition,
        frequency=optional_column("frequency_penalty", 0.0),
        presence=optional_column("presence_penalty", 0.0),
        output_index=_upload(_flat_index([(i, row.output_token_ids) for i, row in penalised], vocab_size), device),
        prompt_index=prompt_index,
    )


def _build_banned_index(
    special: Sequence[tuple[int, SamplingRow]], vocab_size: int, device: torch.device, eos_token_ids: Collection[int]
) -> torch.Tensor | None:
    banned = []
    for i, row in special:
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
