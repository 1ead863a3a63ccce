"""The body of a model-parallel worker process: one rank, one `ModelRunner`, one step per message.

Each rank joins the process group, builds its shard of the model and KV cache (its tensor-parallel share of
its pipeline stage's layers), then loops: read the step's `SchedulerOutput` from the shared-memory broadcast,
run it, and (the driver: the last stage's tensor-parallel rank 0) write the sampled tokens back. Under pipeline
parallelism a stage moves on to the next message as soon as it has handed its activations on, so several
steps are in flight along the pipeline. `None` is the shutdown message. A failure is reported on the error
queue with its traceback before the process exits, so the engine can raise it instead of hanging.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

from batchllm.distributed.shm_queue import ShmQueueHandle, ShmReader, ShmWriter
from batchllm.engine.interfaces import AwaitingGrammar

POLL_S = 1.0  # how often a waiting process checks that the other side is still alive


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    runner: Any  # RunnerConfig (typed loosely: this module is imported before torch in the worker)
    rank: int  # global: stage * tp_size + tensor-parallel rank
    tp_size: int
    pp_size: int
    init_method: str
    num_threads: int
    parent_pid: int
    steps: ShmQueueHandle  # engine → every rank
    replies: ShmQueueHandle  # rank 0 → engine
    errors: Any  # multiprocessing Queue of (rank, traceback text)


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """The driver's first reply: the facts the engine sizes its scheduler by, agreed by every rank."""

    num_blocks: int
    max_model_len: int
    block_size: int
    max_verify_rows: int | None
    num_host_blocks: int
    host_block_bytes: int
    calibration: Any  # Calibration | None: the step sizes the ranks chose by timing (executor/calibration.py)


def worker_main(args: WorkerArgs) -> None:
    # Ctrl-C reaches the whole process group; the engine process handles it and shuts the workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def exit_if_orphaned() -> None:
        if os.getppid() != args.parent_pid:
            raise SystemExit(f"batchllm worker {worker_name(args.rank, args.tp_size, args.pp_size)}: the engine "
                         f"process is gone")

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` prints where a rank is stuck
    try:
        steps = ShmReader(args.steps, args.rank, exit_if_orphaned, POLL_S)
        driver = args.rank == (args.pp_size - 1) * args.tp_size
        replies = ShmWriter(args.replies, exit_if_orphaned, POLL_S) if driver else None
        runner = _build_runner(args)
        if replies is not None:
            replies.put(WorkerReady(runner.num_blocks, runner.max_model_len, runner.block_size,
                                    runner.max_verify_rows, runner.num_host_blocks,
                                    runner.host_block_bytes, runner.calibration))
        # The rank lives for its runner: what exists now stays, so full collections need not scan it (host_gc.py).
        gc.collect()
        gc.freeze()
        while (scheduler_output := steps.get()) is not None:
            launched = runner.execute_model_async(scheduler_output)
            if isinstance(launched, AwaitingGrammar):  # the engine sends the bitmask as the next message
                launched = launched.sample(steps.get())
            output = launched.result()
            if replies is not None:
                replies.put(output)
    except SystemExit:
        raise
    except BaseException:
        # Report and leave at once: tearing the process group down could wait forever on ranks still
        # inside a collective, and the engine kills every rank when one fails anyway.
        args.errors.put((args.rank, traceback.format_exc()))
        args.errors.close()
        args.errors.join_thread()
        os._exit(1)
    from batchllm.distributed.parallel_state import destroy_model_parallel

    destroy_model_parallel()


def _build_runner(args: WorkerArgs):
    import torch

    from batchllm.distributed.parallel_state import init_model_parallel
    from batchllm.executor.model_runner import ModelRunner

    config = args.runner
    if config.device.type == "cuda":
        # From the GPU a runner config names (disaggregated engines each start at their own), one GPU per rank.
        device = torch.device("cuda", (config.device.index or 0) + args.rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = config.device, "gloo"
        torch.set_num_threads(args.num_threads)
    init_model_parallel(args.rank, args.tp_size, args.pp_size, backend, args.init_method, timeout_s=1800,
                        expert_parallel=config.enable_expert_parallel)
    return ModelRunner(dataclasses.replace(config, device=device))


def worker_name(rank: int, tp_size: int, pp_size: int) -> str:
    """How errors name a worker: `rank 1`, or under pipeline parallelism `stage 1 (rank 3)`."""
    return f"rank {rank}" if pp_size == 1 else f"stage {rank // tp_size} (rank {rank})"
