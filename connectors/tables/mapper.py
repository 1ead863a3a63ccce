"""The in-memory map: encode every row, run the good ones through the engine, return output columns."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from batchllm.connectors.adapters import adapter_requests, row_adapters
from batchllm.connectors.constraints import require_compiles, row_params
from batchllm.connectors.options import MapOptions
from batchllm.connectors.progress import RowProgress
from batchllm.connectors.prompts import EncodedPrompt, PromptEncoder, Rendered, RowError, render_rows
from batchllm.connectors.replicas.pool import ReplicaPool
from batchllm.connectors.results import RowOutcome, output_arrays
from batchllm.llm import LLM
from batchllm.lora.request import LoRARequest
from batchllm.sampling_params import SamplingParams

# Tables of at least this many rows are tokenized in chunks while the engine runs (`_streamed_requests`).
STREAM_MIN_ROWS = 1024
FIRST_CHUNK_ROWS = 512  # tokenized before the first step: enough for the first steps' batches
CHUNK_ROWS = 2048


def map_columns(columns: Mapping[str, Sequence[Any]], num_rows: int, options: MapOptions, llm: LLM | ReplicaPool,
                use_tqdm: bool) -> list[pa.Array]:
    """Generate for `num_rows` rows given by their needed columns; output columns come back in row order.

    Small tables: every good row is admitted before the first engine step, in the engine's prefix-aware order,
    as `LLM.generate` does, so results equal the facade's on the same prompts. Rows with a prompt error never
    reach the engine. With a `ReplicaPool` the rows are handed out in that order, so neighbours in it (rows
    sharing a prefix) mostly land on the same replica.

    Tables of `STREAM_MIN_ROWS` or more on one `LLM` are tokenized in chunks on a worker thread while the
    engine runs on the first chunk, so tokenizing a large column overlaps generation instead of preceding
    it. Their rows are admitted in the order of their prompt texts, which groups shared prefixes as the token
    order does; as with any change of batch composition, bf16 results may then differ from the facade's at
    near-ties.

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
    streamed = isinstance(llm, LLM) and len(candidates) >= STREAM_MIN_ROWS and _reads_only(encoder.tokenizer)
    if not streamed:
        encoded = dict(zip(candidates, encoder.encode([rendered[i] for i in candidates],
                                                      [max_tokens] * len(candidates))))
        for i, prompt in encoded.items():
            outcomes[i] = _failure(prompt, params[i], loras[i])
    progress = RowProgress(num_rows, use_tqdm, done=sum(o is not None for o in outcomes))
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="batchllm-tokenize") as pool:
            if streamed:
                requests = _streamed_requests(llm, encoder, pool, rendered, candidates, params, loras, max_tokens,
                                              outcomes, progress)
            else:
                ok = [(i, prompt.token_ids) for i, prompt in encoded.items() if outcomes[i] is None]
                token_lists = [token_ids for _, token_ids in ok]
                order = llm.admission_order(token_lists, [loras[i] for i, _ in ok])
                requests = ((ok[j][0], ok[j][1], params[ok[j][0]], loras[ok[j][0]]) for j in order)
            for index, output in llm.stream(requests):
                outcomes[index] = RowOutcome.from_output(output, params[index])
                progress.update(1, outcomes[index].completion_tokens)
    finally:
        progress.close()
    return output_arrays(outcomes, options)


def _reads_only(tokenizer: Any) -> bool:
    """Whether tokenizing leaves the fast tokenizer's Rust side untouched, so a worker thread may tokenize while
    the engine detokenizes with it: transformers clears a truncation or padding set on the backend when a call
    does not ask for one, a write that would clash with a concurrent read ("Already borrowed")."""
    backend = tokenizer.backend_tokenizer
    return backend.truncation is None and backend.padding is None


def _failure(prompt: EncodedPrompt, params: SamplingParams | RowError,
             lora: LoRARequest | RowError | None) -> RowOutcome | None:
    """The outcome of a row that cannot run (its prompt's, its parameters' or its adapter's error), else None."""
    error = prompt.error or next((str(e) for e in (params, lora) if isinstance(e, RowError)), None)
    return None if error is None else RowOutcome(None, error, prompt.num_tokens)


def _streamed_requests(llm: LLM, encoder: PromptEncoder, pool: ThreadPoolExecutor, rendered: list[Rendered],
                       candidates: list[int], params: list[SamplingParams | RowError],
                       loras: list[LoRARequest | RowError | None], max_tokens: int | None,
                       outcomes: list[RowOutcome | None], progress: RowProgress,
                       ) -> Iterator[tuple[int, list[int], SamplingParams, LoRARequest | None] | None]:
    """The rows in prompt-text order, tokenized chunk by chunk on `pool` while the engine runs. A chunk not
    tokenized yet pauses admission for a step, unless the engine has nothing to run (then it is awaited)."""
    order = sorted(candidates, key=lambda i: (_lora_key(loras[i]), rendered[i].text))
    bounds = [0, *range(min(FIRST_CHUNK_ROWS, len(order)), len(order), CHUNK_ROWS), len(order)]
    chunks = [order[start:end] for start, end in zip(bounds, bounds[1:])]
    futures: list[Future[list[EncodedPrompt]]] = [
        pool.submit(encoder.encode, [rendered[i] for i in chunk], [max_tokens] * len(chunk)) for chunk in chunks]
    for chunk, future in zip(chunks, futures):
        if not future.done() and llm.engine.has_unfinished():
            yield None
        for i, prompt in zip(chunk, future.result()):
            outcomes[i] = _failure(prompt, params[i], loras[i])
            if outcomes[i] is None:
                yield i, prompt.token_ids, params[i], loras[i]
            else:
                progress.update(1)


def row_loras(columns: Mapping[str, Sequence[Any]], num_rows: int, options: MapOptions,
              llm: LLM | ReplicaPool) -> list[LoRARequest | RowError | None]:
    """Each row's adapter (None: the base model), or the error of a row naming one not in `loras`. The adapters
    are checked first: one the engine cannot apply fails the call, naming it."""
    if options.lora_column is None:
        return [None] * num_rows
    requests = adapter_requests(options.loras, llm)
    return row_adapters(columns[options.lora_column], requests, f"lora_column {options.lora_column!r}", True)


def _lora_key(lora: LoRARequest | RowError | None) -> tuple:
    """Rows of one adapter go together (base rows first), so more adapters than device slots swap rarely."""
    return (0, "") if not isinstance(lora, LoRARequest) else (1, lora.lora_name)
