"""The in-memory map: encode every row, run the good ones through the engine, return output columns."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from batchllm.connectors.adapters import adapter_requests, row_adapters
from batchllm.connectors.cells import RowError
from batchllm.connectors.constraints import require_compiles, row_params
from batchllm.connectors.options import MapOptions
from batchllm.connectors.progress import RowProgress, preemption_figures
from batchllm.connectors.prompts import EncodedPrompt, PromptEncoder, render_rows
from batchllm.connectors.replicas.pool import ReplicaPool
from batchllm.connectors.results import RowOutcome, output_arrays
from batchllm.entrypoints.llm import LLM
from batchllm.entrypoints.tokenize_ahead import can_tokenize_aside, tokenized_ahead
from batchllm.lora.request import LoRARequest
from batchllm.sampling_params import SamplingParams


def map_columns(columns: Mapping[str, Sequence[Any]], num_rows: int, options: MapOptions, llm: LLM | ReplicaPool,
                use_tqdm: bool) -> list[pa.Array]:
    """Generate for `num_rows` rows given by their needed columns; output columns come back in row order.

    The rows' prompts are rendered first, then tokenized in chunks while the engine runs on the first ones
    (`batchllm/entrypoints/tokenize_ahead.py`, as `LLM.generate` does). The good rows are admitted in the engine's
    prefix-aware order of their prompt texts (`LLM.admission_order`), as `LLM.generate` admits texts; rows
    with a prompt error never reach the engine. With a `ReplicaPool` the rows are handed out in that order, so
    neighbours in it (rows sharing a prefix) mostly land on the same replica.

    A call-wide constraint (`structured_outputs`) is compiled first and raises the engine's GrammarError;
    with `schema_column`, each row gets its own constraint; a malformed value fails its row (the error names
    the row's position: "row 3: ..."), and so does a schema the engine rejects (with the engine's message).

    With `lora_column`, each row runs under the adapter its cell names (`row_loras`).

    A pooling task (`options.pools`) pools each row's prompt instead (the engine's `pooling_params`); its prompt
    may fill max_model_len.
    """
    encoder = PromptEncoder.for_llm(llm, options)
    rendered = render_rows(columns, num_rows, options, encoder)
    if options.pools:
        params: list[Any] = [options.pooling] * num_rows
        max_tokens = 0  # nothing is generated: no room to keep
    else:
        require_compiles(llm, options.sampling_params.structured_outputs)
        params = row_params(columns, num_rows, options.sampling_params, options.schema_column, name_rows=True)
        max_tokens = options.sampling_params.max_tokens
    loras = row_loras(columns, num_rows, options, llm)
    outcomes: list[RowOutcome | None] = [RowOutcome(None, str(p)) if isinstance(p, RowError) else None
                                         for p in rendered]
    candidates = [i for i, o in enumerate(outcomes) if o is None]  # their prompts rendered; tokenized next
    # A row whose adapter is an error still has its prompt tokenized (its token count is reported); it sorts with
    # the base rows and never runs.
    adapters = [loras[i] if isinstance(loras[i], LoRARequest) else None for i in candidates]
    order = llm.admission_order([rendered[i].text for i in candidates], adapters)
    encoded = tokenized_ahead([candidates[j] for j in order],
                              lambda rows: encoder.encode([rendered[i] for i in rows], [max_tokens] * len(rows)),
                              llm.has_unfinished, can_tokenize_aside(encoder.tokenizer))
    progress = RowProgress(num_rows, use_tqdm, done=num_rows - len(candidates), preemptions=preemption_figures(llm))

    def requests() -> Iterator[tuple[int, list[int], SamplingParams, LoRARequest | None] | None]:
        for item in encoded:
            if item is None:
                yield None
                continue
            i, prompt = item
            outcomes[i] = _failure(prompt, params[i], loras[i])
            if outcomes[i] is None:
                yield i, prompt.engine_prompt, params[i], loras[i]
            else:
                progress.update(1)

    try:
        for index, output in llm.stream(requests()):
            outcomes[index] = RowOutcome.from_output(output, params[index])
            progress.update(1, outcomes[index].completion_tokens)
    finally:
        progress.close()
    return output_arrays(outcomes, options)


def _failure(prompt: EncodedPrompt, params: SamplingParams | RowError,
             lora: LoRARequest | RowError | None) -> RowOutcome | None:
    """The outcome of a row that cannot run (its prompt's, its parameters' or its adapter's error), else None."""
    error = prompt.error or next((str(e) for e in (params, lora) if isinstance(e, RowError)), None)
    return None if error is None else RowOutcome(None, error, prompt.num_tokens)


def row_loras(columns: Mapping[str, Sequence[Any]], num_rows: int, options: MapOptions,
              llm: LLM | ReplicaPool) -> list[LoRARequest | RowError | None]:
    """Each row's adapter (None: the base model), or the error of a row naming one not in `loras`. The adapters
    are checked first: one the engine cannot apply fails the call, naming it."""
    if options.lora_column is None:
        return [None] * num_rows
    requests = adapter_requests(options.loras, llm)
    return row_adapters(columns[options.lora_column], requests, f"lora_column {options.lora_column!r}", True)

