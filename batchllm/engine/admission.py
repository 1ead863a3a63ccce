"""Admission: which waiting requests can run at all, whether the pool has room for one now, and where an admitted
request's K/V comes from.

Room (`admission_policy`): "kv_aware" (the default) admits a request only when the free pool holds it, with every
running request, to the end of the output the scheduler expects of each (output_length.py: `max_tokens` for forced
outputs, else a length learned from the rows finished in this run); the blocks each needs are the KV manager's
answer (`num_blocks_to_hold`: a window group holds at most its window), less the prefix-cache hits that other
requests hold already. Preempting a request throws its prefill away, and a full batch of forced outputs admitted
optimistically preempts again and again. "optimistic" admits whatever fits the prompt now and leaves the rest to
preemption (vLLM's policy, TensorRT-LLM's MAX_UTILIZATION; "kv_aware" on forced outputs is TensorRT-LLM's
GUARANTEED_NO_EVICT). Preemption stays the fallback of both: an estimate can prove short.

Where the K/V comes from, in order: a KV connector that holds the request's whole computed context (swapped out to
the host tier, or computed by a prefill engine), a fork parent whose prompt blocks it shares, the prefix cache
(device blocks, then a connector's), and fresh blocks for the rest. Mixed into `Scheduler` (scheduler.py), whose
state it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchllm.engine.image_chunks import whole_images
from batchllm.engine.kv_cache_manager import BlockAllocation, KVCacheManager
from batchllm.engine.kv_connector import KVConnector
from batchllm.engine.output_length import OutputLengthEstimator
from batchllm.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchllm.config import SchedulerConfig

_WAIT = object()  # sentinel: a forked sample waits for its parent's prompt


class Admission:
    config: SchedulerConfig
    kv_cache: KVCacheManager
    connectors: list[KVConnector]
    requests: dict[str, Request]
    _scheduled_now: dict[str, int]  # request id → tokens scheduled in the step being built
    running: list[Request]
    output_lengths: OutputLengthEstimator
    _reserved_blocks: int | None  # blocks the running requests still need to reach their expected ends; None: unknown
    # The last `_admit` that returned None found the pool too short (not a fork parent or an image to wait for).
    _admit_lacked_room: bool

    def _admission_error(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if n == 0:
            return "the prompt is empty (0 tokens)"
        if request.pooling is not None:  # nothing to generate: the prompt may fill max_model_len
            if n > self.config.max_model_len:
                return (f"the prompt has {n} tokens but max_model_len is {self.config.max_model_len} (limited by the "
                        f"model and by the KV pool of {self.kv_cache.capacity_tokens} tokens)")
            return None
        if n >= self.config.max_model_len:
            return (
                f"the prompt has {n} tokens but max_model_len is {self.config.max_model_len} (limited by the model "
                f"and by the KV pool of {self.kv_cache.capacity_tokens} tokens), leaving no room to generate"
            )
        return None

    def _admit(self, request: Request, budget: int) -> tuple[int, BlockAllocation | None] | None:
        """Give a waiting request its blocks: fresh ones under the K/V a connector holds for it, else shared with its
        fork parent, else from the prefix cache plus fresh ones. Returns (tokens to compute, allocation), or None if
        it must keep waiting. A request left `loading` (its K/V comes from a connector) computes from the next step:
        it has no allocation then."""
        kv = self.kv_cache
        self._admit_lacked_room = True  # cleared where it waits for something else
        for connector in self.connectors:
            # Swapped out (the host tier), or computed by a prefill engine (the P/D link).
            num_held = connector.get_num_held_tokens(request)
            if num_held:
                num_new = min(request.num_tokens - num_held, budget)
                if not self._has_room(request, 0) or not kv.allocate_held(request, connector, num_held, num_new):
                    return None
                request.num_computed_tokens = num_held
                return num_new, None
        parent = self._fork_parent(request)
        if parent is _WAIT:
            self._admit_lacked_room = False
            return None
        if parent is not None:
            if not self._has_room(request, 0):  # counted whole: its shared prompt blocks are few beside its output
                return None
            # Share the parent's prompt blocks and recompute only the last prompt token, whose logits this
            # sample needs; its write into the shared last block triggers the copy-on-write.
            kv.fork(parent, request, request.num_prompt_tokens)
            request.num_computed_tokens = request.num_prompt_tokens - 1
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            allocation = kv.allocate_slots(request, num_new)
            if allocation is None:
                kv.free(request)
                request.num_computed_tokens = 0
                return None
            return num_new, allocation
        cached = kv.find_cached_prefix(request)
        if not self._has_room(request, kv.num_blocks_in_use(cached)):
            return None
        num_cached = cached.num_blocks * kv.block_size
        num_new = min(request.num_tokens - num_cached, budget)
        if request.mm is not None and request.mm.bidirectional:
            num_new = whole_images(request.mm, num_cached, num_new, budget)
            if not num_new:
                self._admit_lacked_room = False
                return None  # its first image does not fit what is left of this step
        allocation = kv.allocate_slots(request, num_new, cached)
        if allocation is None:
            return None
        kv.stats.queries += request.num_tokens
        kv.stats.hits += num_cached
        request.num_computed_tokens = num_cached
        return num_new, allocation

    def _has_room(self, request: Request, num_shared_blocks: int) -> bool:
        """KV-aware admission: whether the free pool holds `request` (of whose blocks `num_shared_blocks` are held by
        other requests already) and every running request to the ends expected of them. With nothing running a
        request always has room: alone it fits, since max_model_len never exceeds the pool."""
        if self.config.admission_policy != "kv_aware" or not self.running:
            return True
        kv = self.kv_cache
        if self._reserved_blocks is None:  # once per step that admits: a pass over the running requests
            expected, max_len = self.output_lengths.expected_num_tokens, self.config.max_model_len
            to_hold, held = kv.num_blocks_to_hold, kv.num_blocks_held
            self._reserved_blocks = sum(max(0, to_hold(expected(r, max_len)) - held(r)) for r in self.running)
        expected = self.output_lengths.expected_num_tokens(request, self.config.max_model_len)
        need = kv.num_blocks_to_hold(expected) - num_shared_blocks
        return self._reserved_blocks + need <= kv.pool.num_free_blocks

    def _blocks_to_grow(self, request: Request) -> int:
        """The blocks a running request still takes from the pool to reach the end expected of it."""
        expected = self.output_lengths.expected_num_tokens(request, self.config.max_model_len)
        return max(0, self.kv_cache.num_blocks_to_hold(expected) - self.kv_cache.num_blocks_held(request))

    def _reserve_for(self, request: Request) -> None:
        """`request` was just admitted: what it still needs joins the running requests' reserve."""
        if self._reserved_blocks is not None:
            self._reserved_blocks += self._blocks_to_grow(request)

    def _fork_parent(self, request: Request) -> Request | object | None:
        """The running request whose prompt K/V this one can share, `_WAIT` if that parent is still
        computing its prompt, None to run on its own (no parent, or the parent is no longer running)."""
        if request.fork_of is None:
            return None
        parent = self.requests.get(request.fork_of)
        if parent is None or parent.status is not RequestStatus.RUNNING:
            return None
        if self.kv_cache.is_loading(parent):
            return _WAIT  # its blocks fill while this step runs
        # Only K/V written in earlier steps can be copied before this step's forward pass.
        ready = parent.num_computed_tokens - self._scheduled_now.get(parent.request_id, 0)
        return parent if ready >= request.num_prompt_tokens else _WAIT
