"""The parent's handle on replica processes: starting one, waiting for what they send, stopping them all."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from batchllm.connectors.replicas.channel import spawn_child
from batchllm.connectors.replicas.devices import Placement
from batchllm.connectors.replicas.messages import Stop
from batchllm.connectors.replicas.replica import ReplicaSpec, replica_main

ABORT_SECONDS = 5.0  # after `Stop`, a replica with rows in flight exits at its next engine step


@dataclass(slots=True, eq=False)
class ReplicaProcess:
    index: int
    process: BaseProcess
    tasks: Connection  # parent → replica
    results: Connection  # replica → parent
    pid: int | None = None
    ready: bool = False
    alive: bool = True
    hungry: bool = False  # it asked for work and got none yet
    results_closed: bool = False
    assigned: set[int] = field(default_factory=set)  # seqs handed to it, result not yet back
    error: str | None = None


def start_replica(spec: ReplicaSpec, placement: Placement) -> ReplicaProcess:
    """Start a replica with `placement.env` in its environment from its first instruction (so before it can import
    torch), and the pipes it talks through."""
    process, tasks, results = spawn_child(replica_main, (spec,), f"batchllm-replica-{spec.index}", placement.env)
    return ReplicaProcess(spec.index, process, tasks, results, pid=process.pid)


def replica_events(replicas: list[ReplicaProcess]) -> Iterator[tuple[ReplicaProcess, object | None]]:
    """Wait for something to happen; yield (replica, message), and (replica, None) once a replica has
    exited and every message it sent was read."""
    waiting: dict[Any, ReplicaProcess] = {}
    for replica in replicas:
        if replica.alive:
            waiting[replica.process.sentinel] = replica
            if not replica.results_closed:
                waiting[replica.results] = replica
    exited = []
    for ready in wait(list(waiting)):
        replica = waiting[ready]
        if ready is replica.results:
            yield from ((replica, m) for m in _read_available(replica))
        else:
            exited.append(replica)
    for replica in exited:
        yield from ((replica, m) for m in _read_available(replica))
        yield replica, None


def _read_available(replica: ReplicaProcess) -> Iterator[object]:
    while not replica.results_closed and replica.results.poll():
        try:
            yield replica.results.recv()
        except (EOFError, OSError):
            replica.results_closed = True  # it is exiting; its sentinel follows


def shutdown_replicas(replicas: list[ReplicaProcess], timeout: float) -> None:
    """`Stop` to each, then terminate and kill whatever has not exited within `timeout` seconds: no orphans."""
    for replica in replicas:
        if replica.process.is_alive():
            try:
                replica.tasks.send(Stop())
            except OSError:
                pass
    deadline = time.monotonic() + timeout
    for replica in replicas:
        replica.process.join(max(0.0, deadline - time.monotonic()))
    for replica in replicas:
        if replica.process.is_alive():
            replica.process.terminate()
    for replica in replicas:
        replica.process.join(ABORT_SECONDS)
        if replica.process.is_alive():
            replica.process.kill()
            replica.process.join()
        replica.tasks.close()
        replica.results.close()
