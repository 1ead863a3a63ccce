"""The model-parallel executor: `pipeline_parallel_size * tensor_parallel_size` spawned worker processes, one
per rank.

The engine stays in the caller's process and never touches `torch.distributed`: each step it writes the
`SchedulerOutput` once into a shared-memory broadcast queue that every rank reads, and reads the driver's
sampled tokens back from a second queue. Only the driver (the last stage's tensor-parallel rank 0) samples,
from logits gathered across its stage's ranks, so ranks cannot disagree about a token. Pipeline stages read the
same messages and hand activations down the pipeline themselves; the engine keeps several steps in flight,
and the replies come back in launch order. Keeping the engine out of the process group means a waiting engine
can always notice a dead worker and fail with a clear error, whatever the backend is doing.

Lifecycle: workers are daemonic `spawn` processes. `shutdown()` (also run when the executor is garbage
collected, at interpreter exit, after a failed or interrupted step) asks them to exit, then terminates and
kills what is left. Workers exit by themselves when the engine process disappears. A worker that dies
makes the next wait raise `WorkerDiedError` with its traceback when it left one.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import weakref
from typing import Any

from batchllm.distributed.shm_queue import ShmReader, ShmWriter, create_queue, unlink_queue
from batchllm.engine.interfaces import AwaitingGrammar, GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from batchllm.executor.tp_worker import POLL_S, WorkerArgs, WorkerReady, worker_main, worker_name

_JOIN_S = 5.0


class WorkerDiedError(RuntimeError):
    """A model-parallel worker process ended while the engine needed it."""


class MultiprocExecutor:
    def __init__(self, runner_config: Any, tensor_parallel_size: int, num_threads: int,
                 pipeline_parallel_size: int = 1, label: str = "model-parallel") -> None:
        """`label` names the workers in errors ("model-parallel", or a disaggregated engine's "prefill")."""
        context = multiprocessing.get_context("spawn")
        self._group = _WorkerGroup(context, runner_config, tensor_parallel_size, pipeline_parallel_size, num_threads,
                                   label)
        # At garbage collection and interpreter exit alike; holds the group, not self, so self can be collected.
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        ready: WorkerReady = self._group.call(None, first=True)
        self.num_blocks, self.max_model_len, self.block_size = ready.num_blocks, ready.max_model_len, ready.block_size
        self.max_verify_rows, self.num_host_blocks = ready.max_verify_rows, ready.num_host_blocks
        self.host_block_bytes, self.calibration = ready.host_block_bytes, ready.calibration

    @property
    def worker_pids(self) -> list[int]:
        return [process.pid for process in self._group.processes]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._group.call(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> _Reply | AwaitingGrammar:
        """Broadcast the step and return; the workers run it while the engine schedules the next one.
        Replies come back in step order, so the engine must read them in the order it launched them.
        A constrained step without its bitmask: the workers run the forward pass and wait for the bitmask
        as the next message (`tp_worker.py`)."""
        self._group.call(scheduler_output, wait=False)
        if scheduler_output.grammar_request_ids and scheduler_output.grammar is None:
            return AwaitingGrammar(self._send_grammar)
        return _Reply(self._group)

    def _send_grammar(self, grammar: GrammarBitmask) -> _Reply:
        self._group.call(grammar, wait=False)
        return _Reply(self._group)

    def shutdown(self) -> None:
        self._finalizer()


class _WorkerGroup:
    def __init__(self, context: Any, runner_config: Any, tp_size: int, pp_size: int, num_threads: int,
                 label: str) -> None:
        world = tp_size * pp_size
        self.tp_size, self.pp_size, self.label = tp_size, pp_size, label
        self.steps = create_queue(context, world)
        self.replies = create_queue(context, 1)
        self.errors = context.Queue()
        self.failure: str | None = None
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.processes = [
            context.Process(target=worker_main, name=f"batchllm-rank{rank}", daemon=True, args=(WorkerArgs(
                runner_config, rank, tp_size, pp_size, init_method, num_threads, os.getpid(), self.steps,
                self.replies, self.errors),))
            for rank in range(world)
        ]
        try:
            for process in self.processes:
                process.start()
            self.writer = ShmWriter(self.steps, self.check_workers, POLL_S / 10)
            self.reader = ShmReader(self.replies, 0, self.check_workers, POLL_S / 10)
        except BaseException:
            self.shutdown()
            raise

    def call(self, message: SchedulerOutput | GrammarBitmask | None, first: bool = False, wait: bool = True) -> Any:
        """Broadcast `message` (None: only wait) and return the driver's reply (`wait=False`: only broadcast);
        any failure shuts the group down."""
        if self.failure is not None:
            raise WorkerDiedError(f"the {self.label} workers are shut down: {self.failure}")
        try:
            if message is not None:
                self.writer.put(message)
            if not wait:
                return None
            reply = self.reader.get()
        except BaseException as exc:
            if self.failure is None:
                self.failure = f"a step was interrupted by {type(exc).__name__}"
            self.shutdown()
            raise
        if first:  # every rank has mapped the queues by now: their files need not outlive the processes
            unlink_queue(self.steps)
            unlink_queue(self.replies)
        return reply

    def check_workers(self) -> None:
        """Raise `WorkerDiedError` if a rank exited or reported an error (it may still be alive, stuck)."""
        dead = [(rank, p) for rank, p in enumerate(self.processes) if p.exitcode is not None]
        reports = self._drain_errors(wait_s=0.2 if dead else 0.0)
        if not dead and not reports:
            return
        # A rank that died without a report (killed, out of memory) is the cause; the others then fail in
        # their collectives and report that, which is only a consequence.
        silent = [(rank, p) for rank, p in dead if rank not in reports]
        if silent:
            rank, process = silent[0]
            self.failure = f"{self._name(rank)} (pid {process.pid}) exited with code {process.exitcode}"
        else:
            rank = min(reports)
            self.failure = f"{self._name(rank)} (pid {self.processes[rank].pid}) failed"
        detail = reports.get(rank, "")
        raise WorkerDiedError(f"{self.label} worker {self.failure}" + (f"; its error:\n{detail}" if detail else ""))

    def _name(self, rank: int) -> str:
        return worker_name(rank, self.tp_size, self.pp_size)

    def _drain_errors(self, wait_s: float) -> dict[int, str]:
        """The (rank → traceback) reports waiting on the error queue; waits up to `wait_s` for the first."""
        reports: dict[int, str] = {}
        try:
            while True:
                rank, text = self.errors.get(timeout=wait_s) if wait_s and not reports else self.errors.get_nowait()
                reports[rank] = text
        except queue.Empty:
            pass
        return reports

    def shutdown(self) -> None:
        if self.failure is None:
            # No step in flight: ask for a clean exit, which lets NCCL/gloo tear down their connections.
            self.failure = "the engine was shut down"
            try:
                self.writer.put(None)
                for process in self.processes:
                    process.join(timeout=_JOIN_S)
            except Exception:
                pass
        # After a failure the survivors may be blocked in a collective that never completes: do not wait.
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            if process.pid is not None:
                process.join(timeout=_JOIN_S)
            if process.is_alive():
                process.kill()
                process.join()
        for handle in (self.steps, self.replies):
            unlink_queue(handle)
        self.errors.close()


class _Reply:
    """The driver's reply to a launched step, read when the engine asks for it."""

    def __init__(self, group: _WorkerGroup) -> None:
        self._group = group
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._group.call(None)
        return self._output


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
