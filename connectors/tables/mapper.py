"""The in-memory map: encode every row, run the good ones through the engine, return output columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from batchllm.connectors.constraints import require_compiles, row_params
from batchllm.connectors.options import MapOptions
from batchllm.connectors.progress import RowProgress
from batchllm.connectors.prompts import PromptEncoder, RowError, encode_rows
from batchllm.connectors.replicas.pool import ReplicaPool
from batchllm.connectors.results import RowOutcome, output_arrays
from batchllm.llm import LLM


def map_columns(columns: Mapping[str, Sequence[Any]], num_rows: int, options: MapOptions, llm: LLM | ReplicaPool,
                use_tqdm: bool) -> list[pa.Array]:
    """Generate for `num_rows` rows given by their needed columns; output columns come back in row order.

    Every good row is admitted before the first engine step, in the engine's prefix-aware order, as
    `LLM.generate` does, so results equal the facade's on the same prompts. Rows with a prompt error never
    reach the engine. With a `ReplicaPool` the rows are handed out in that order, so neighbours in it (rows
    sharing a prefix) mostly land on the same replica.

    A call-wide constraint (`structured_outputs`) is compiled first and raises the engine's GrammarError;
    with `schema_column`, each row gets its own constraint; a malformed value fails its row (the error names
    the row's position: "row 3: ..."), and so does a schema the engine rejects (with the engine's message).
    """
    require_compiles(llm, options.sampling_params.structured_outputs)
    encoded = encode_rows(columns, num_rows, options, PromptEncoder.for_llm(llm, options))
    params = row_params(columns, num_rows, options.sampling_params, options.schema_column, name_rows=True)
    outcomes: list[RowOutcome | None] = []
    for prompt, row in zip(encoded, params):
        error = prompt.error if prompt.error is not None else str(row) if isinstance(row, RowError) else None
        outcomes.append(None if error is None else RowOutcome(None, error, prompt.num_tokens))
    progress = RowProgress(num_rows, use_tqdm, done=sum(o is not None for o in outcomes))
    good = [i for i, o in enumerate(outcomes) if o is None]
    order = llm.admission_order([encoded[i].token_ids for i in good])
    requests = ((good[j], encoded[good[j]].token_ids, params[good[j]]) for j in order)
    try:
        for index, output in llm.stream(requests):
            outcomes[index] = RowOutcome.from_output(output, params[index])
            progress.update(1, outcomes[index].completion_tokens)
    finally:
        progress.close()
    return output_arrays(outcomes, options)
