"""KV connectors, scheduler side: K/V that lives outside the device pool and is copied in and out of it.

Two implementations: the host tier (host_tier.py: swap space for preempted requests and a second level of the
prefix cache) and the link of disaggregated prefill / decode (kv_handoff.py: a prompt's K/V handed from one
engine to the other). Each has a worker side (executor/kv_connector.py) that performs the copies this side decides.

A step's life, and who calls each hook (a connector overrides only the hooks it needs):
- `begin_step`: the scheduler, before it schedules;
- admission of a waiting request, by the scheduler: `get_num_held_tokens` first (a connector that holds the
  request's whole computed context: swapped out, or computed by another engine); else the KV manager looks up the
  device prefix cache and asks `get_num_new_matched_tokens` for what follows it;
- `update_state_after_alloc`: once the request's device blocks are allocated, with the blocks the connector's
  tokens go into (it issues their loads; the request computes from the next step, when they have landed);
- `save_preempted`: the KV manager, for a victim of a preemption in swap mode; True keeps its K/V (and its
  computed tokens), False recomputes it;
- `on_evict`: the KV manager, for each cached device block handed out for other contents, after the allocation
  that evicted it (a connector loading into the allocated blocks has taken its own blocks by then);
- `request_finished`: the scheduler, when a request ends or is aborted; True keeps its device blocks for the
  connector, which frees them itself (through the callable it was built with);
- `build_connector_meta`: the scheduler, last: the step's copies, opaque to everything but the connector's worker
  side, which finds them in `SchedulerOutput.kv_connector_metadata` under the connector's `name`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from batchllm.engine.block_pool import KVCacheBlock
    from batchllm.engine.interfaces import SchedulerOutput
    from batchllm.engine.request import Request


class KVConnector:
    """The scheduler side of a connector; every hook defaults to "nothing here"."""

    name: ClassVar[str]  # the key of its metadata, shared with its worker side

    def begin_step(self) -> None:
        pass

    def get_num_held_tokens(self, request: Request) -> int:
        """Tokens of a waiting request whose K/V this connector holds in full (0: none); the request computes from
        there once they are loaded."""
        return 0

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> int:
        """Tokens after the first `num_computed` (found on the device) whose K/V this connector can load."""
        return 0

    def update_state_after_alloc(self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int) -> None:
        """`num_external_tokens` of the tokens this connector claimed go into `blocks`, in order: load them."""

    def save_preempted(self, request: Request, blocks: list[KVCacheBlock]) -> bool:
        """Keep the K/V of a preempted request's computed tokens (in `blocks`, about to be freed)?"""
        return False

    def on_evict(self, block_id: int, block_hash: bytes, reused: bool) -> None:
        """A cached device block was handed out for other contents (`reused`: a prefix lookup had found it)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """The request ended or was aborted; True: this connector frees its device blocks later."""
        return False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object | None:
        """The step's work for the worker side (None: none)."""
        return None

    def reset_stats(self) -> None:
        pass


def connector_metadata(connectors: list[KVConnector], scheduler_output: SchedulerOutput) -> dict[str, object] | None:
    """Each connector's metadata for the step, by name; None when no connector has work."""
    metadata = {}
    for connector in connectors:
        meta = connector.build_connector_meta(scheduler_output)
        if meta is not None:
            metadata[connector.name] = meta
    return metadata or None
