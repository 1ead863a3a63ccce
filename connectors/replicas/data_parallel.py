"""Data parallelism on one machine: `data_parallel_size=N` runs N engine processes, one per GPU (or per
share of the CPU cores), fed from one work queue.

    batchllm.generate(df, prompt_column="q", max_tokens=64, data_parallel_size=2)
    batchllm.run_job("in/", "out/", prompt_column="q", data_parallel_size=2)
    batchllm run in/ out/ --prompt-column q --data-parallel 2

Rows are encoded in the calling process, exactly as with one engine (bad rows get their `error` there and
never reach a replica); results come back into the same machinery, so `generate` keeps input order and
jobs write the same shards and manifest (and resume the same way, with any data_parallel_size). Greedy
and seeded rows give the same output as one engine; unseeded sampling draws from each replica's own
generator. `pool.py` has the mechanics: the queue, replica death, shutdown. A replica that dies
has its unfinished rows re-run by the others (`JobResult.replica_failures`, and a `RuntimeWarning`).

`data_parallel_size=1` is the in-process path, untouched. With GPUs, replica i uses GPUs
[i * tp, (i + 1) * tp) where tp = engine_kwargs' `tensor_parallel_size` (default 1): dp × tp GPUs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchllm.connectors.engine_cache import get_llm
from batchllm.connectors.replicas.pool import ReplicaPool
from batchllm.entrypoints.llm import LLM


def check_data_parallel_size(data_parallel_size: Any, llm: Any = None) -> int:
    """Fail fast, before any work, on a bad size or on a size that cannot apply."""
    size = data_parallel_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"data_parallel_size must be an int >= 1, got {size!r}")
    if size > 1 and llm is not None:
        raise ValueError(f"data_parallel_size={size} builds one engine in each replica process, and an existing "
                         f"llm= cannot be replicated: pass model= (and engine_kwargs=) instead of llm=")
    return size


@contextmanager
def engine_for(data_parallel_size: int, model: str | Path | None, llm: LLM | None,
               engine_kwargs: Mapping[str, Any] | None, max_in_flight_per_replica: int | None = None
               ) -> Iterator[LLM | ReplicaPool]:
    """The engine a connector call runs on: with data_parallel_size > 1 a started pool, stopped on leaving the
    block; with 1 the in-process engine (`llm`, or the process's cached one), exactly as without data
    parallelism."""
    if data_parallel_size == 1:
        yield get_llm(model, llm, engine_kwargs)
        return
    with ReplicaPool(data_parallel_size, model, engine_kwargs,
                     max_in_flight_per_replica=max_in_flight_per_replica) as pool:
        yield pool
