"""A data-parallel replica: a process that builds one engine and serves chunks of rows until told to stop.

Started by `pool.ReplicaPool` from the `spawn` context, not daemonic (a replica may start its own
tensor-parallel workers). It keeps its engine full by asking for the next chunk as soon as its local
buffer is empty, while the engine still works on the rows it has (`LLM.stream` pulls from `source()`
before every step), and sends results back in batches, once per engine step.

It ignores SIGINT: Ctrl-C reaches the whole process group, and the parent decides what happens (a job
finishes the rows in flight, then stops the replicas). It exits by itself when the parent is gone: its
task pipe reaches EOF without a `Stop`, or its parent process id changes.
"""

from __future__ import annotations

import os
import signal
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Iterator

from batchllm.connectors.replicas.channel import EXIT_PARENT_GONE, Inbox, Outbox, picklable_error
from batchllm.connectors.replicas.messages import (
    BuildFailed,
    CheckConstraint,
    Chunk,
    ConstraintChecked,
    Crashed,
    Ready,
    Results,
    Stop,
    WantWork,
    WorkItem,
)

# Test hook: replica 0 exits with status 1 right after its N-th finished row (and after sending it), so
# a replica death mid-job can be tested deterministically.
EXIT_AFTER_ROWS_ENV = "BATCHLLM_TEST_REPLICA_EXIT_AFTER_ROWS"


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    index: int
    model: str
    engine_kwargs: dict[str, Any]
    num_threads: int | None  # torch threads for a CPU replica; None leaves torch's default (GPU replicas)
    max_in_flight: int | None  # prompts admitted into this replica's engine at once; None: `default_in_flight`
    parent_pid: int


def default_chunk_rows(max_num_seqs: int) -> int:
    """Rows handed to a replica at a time: a quarter of its engine's batch, 8 to 256."""
    return max(8, min(256, max_num_seqs // 4))


def default_in_flight(max_num_seqs: int) -> int:
    """Prompts in a replica's engine at once: its batch plus one chunk, so a chunk waits while a batch runs."""
    return max_num_seqs + default_chunk_rows(max_num_seqs)


def replica_main(spec: ReplicaSpec, tasks: Connection, results: Connection) -> None:
    """The replica process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # From now on, a parent that dies takes this process with it, even mid-build.
    inbox = Inbox(tasks, Stop, "replica-inbox")
    outbox = Outbox(results, "replica-outbox")
    try:
        llm = _build_engine(spec)
    except Exception as exc:
        outbox.send(BuildFailed(spec.index, picklable_error(exc), traceback.format_exc()))
        outbox.exit(1)
    outbox.send(Ready(spec.index, os.getpid(), llm.max_model_len, llm.max_num_seqs))
    try:
        _serve(llm, spec, inbox, outbox)
    except Exception:
        outbox.send(Crashed(spec.index, traceback.format_exc()))
        outbox.exit(1)
    outbox.close()


def _build_engine(spec: ReplicaSpec) -> Any:
    import torch

    from batchllm.entrypoints.llm import LLM

    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    return LLM(spec.model, **spec.engine_kwargs)


@dataclass(slots=True)
class _State:
    buffered: deque[WorkItem] = field(default_factory=deque)
    finished: list = field(default_factory=list)  # (seq, output) not yet sent
    in_flight: int = 0
    done: int = 0
    want_sent: bool = False
    stopping: bool = False


def _serve(llm: Any, spec: ReplicaSpec, inbox: Inbox, outbox: Outbox) -> None:
    exit_after = _exit_after_rows(spec.index)
    state = _State()

    def flush() -> None:
        if state.finished:
            outbox.send(Results(state.finished))
            state.finished = []

    def take(message: object) -> None:
        if isinstance(message, Chunk):
            state.buffered.extend(message.items)
            state.want_sent = False
        elif isinstance(message, CheckConstraint):
            outbox.send(_check_constraint(llm, spec.index, message))
        elif isinstance(message, Stop):
            state.stopping = True

    def source() -> Iterator[tuple[int, list[int], Any] | None]:
        while True:
            flush()
            while (message := inbox.get(block=False)) is not None:
                take(message)
            if state.stopping:
                if state.in_flight or state.buffered:
                    os._exit(0)  # the parent gave these rows up (it is aborting): do not finish them
                return
            if not state.buffered and not state.want_sent:
                outbox.send(WantWork(spec.index))  # ask now, while the engine still has work: no drain
                state.want_sent = True
            if state.buffered:
                item = state.buffered.popleft()
                state.in_flight += 1
                yield item.seq, _prompt_of(item), item.params, item.lora
            elif state.in_flight:
                yield None  # let the engine step; ask again before the next one
            else:
                message = inbox.get(block=True)
                if message is None and os.getppid() != spec.parent_pid:
                    os._exit(EXIT_PARENT_GONE)
                take(message)

    max_in_flight = spec.max_in_flight or default_in_flight(llm.max_num_seqs)
    for seq, output in llm.stream(source(), max_in_flight=max_in_flight):
        state.in_flight -= 1
        state.done += 1
        output.prompt_token_ids = []  # the parent holds them: do not send them back
        state.finished.append((seq, output))
        if exit_after is not None and state.done >= exit_after:
            flush()
            outbox.close()
            os._exit(1)
    flush()


def _check_constraint(llm: Any, index: int, message: CheckConstraint) -> ConstraintChecked:
    """Compile the constraint on this replica's engine (which keeps it compiled for the rows that use it)."""
    try:
        llm.check_structured_outputs(message.params)
    except ValueError as exc:  # GrammarError, or an engine without a tokenizer
        return ConstraintChecked(index, message.token, picklable_error(exc), str(exc))
    return ConstraintChecked(index, message.token, None, None)


def _exit_after_rows(index: int) -> int | None:
    value = os.environ.get(EXIT_AFTER_ROWS_ENV)
    return int(value) if value and index == 0 else None


def _prompt_of(item: WorkItem) -> Any:
    """The row as this replica's `LLM.stream` takes it: its token ids, or the prepared row with its images."""
    if item.mm is None and item.error is None:
        return item.token_ids
    from batchllm.entrypoints.multimodal_prompts import PreparedRow

    return PreparedRow(None, item.token_ids, item.mm, item.error)
