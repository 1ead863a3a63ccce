"""The in-memory map: encode every row, run the good ones through the engine, return output columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from batchllm.connectors.options import MapOptions
from batchllm.connectors.progress import RowProgress
from batchllm.connectors.prompts import PromptEncoder, encode_rows
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
    """
    encoded = encode_rows(columns, num_rows, options, PromptEncoder.for_llm(llm, options))
    outcomes = [RowOutcome(None, e.error, e.num_tokens) for e in encoded]
    progress = RowProgress(num_rows, use_tqdm, done=sum(e.error is not None for e in encoded))
    params = options.sampling_params
    good = [i for i, e in enumerate(encoded) if e.error is None]
    order = llm.admission_order([encoded[i].token_ids for i in good])
    requests = ((good[j], encoded[good[j]].token_ids, params) for j in order)
    try:
        for index, output in llm.stream(requests):
            outcomes[index] = RowOutcome.from_output(output, params)
            progress.update(1, outcomes[index].completion_tokens)
    finally:
        progress.close()
    return output_arrays(outcomes, options)
