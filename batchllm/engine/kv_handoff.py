"""Disaggregated prefill / decode: moving a prompt's K/V from the prefill engine to the decode engine.

The two engines share a buffer of K/V blocks (executor/kv_transfer.py maps it in both processes), whose slots
the coordinator (prefill_decode_core.py) hands out from one `BlockPool`:
- the prefill engine computes every prompt token but the last (its request is the prompt less its last token,
  one discarded greedy sample); when such a request ends, its blocks are copied into free slots by the next
  prefill step (offloads, run before that step's forward pass may reuse the blocks). While too few slots are
  free it keeps its blocks and waits, in order (the decode engine frees slots as it admits requests); one
  larger than the whole buffer is handed over without K/V, for the decode engine to compute;
- the decode engine admits the full prompt with those tokens already computed: its blocks are allocated and
  loaded from the slots in one step, and it computes from the next (the last prompt token, then decoding) as
  a request swapped back in does. Sampling, grammars, logprobs and stops all happen in the decode engine, so
  its outputs are one engine's.
A slot is free again three decode steps after its load was issued: by then the step after the loading one,
whose forward pass waited for the loads, has been applied (one step in flight).

With a hybrid KV cache (hybrid_kv_cache_manager.py; both engines plan the same groups) a prompt hands over only the
blocks each group holds at its computed position, interleaved: a window group's window, not its whole prompt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from batchllm.engine.block_pool import BlockPool, KVCacheBlock
from batchllm.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from batchllm.engine.interfaces import BlockTransfers, SchedulerOutput
from batchllm.engine.kv_cache_manager import KVCacheManager, cdiv
from batchllm.engine.kv_connector import KVConnector
from batchllm.engine.kv_groups import KVGroupLayout
from batchllm.engine.request import Request, RequestStatus

KV_LINK = "kv_link"
RELEASE_AFTER_STEPS = 3


def free_slots(link: BlockPool, slots: list[int]) -> None:
    link.free([link.blocks[slot] for slot in slots])


@dataclass(slots=True)
class Handoff:
    """A prompt whose first `num_tokens` tokens' K/V the prefill engine computed, in `slots` (None: the buffer was
    full, so the decode engine computes them again)."""

    request_id: str
    num_tokens: int
    slots: list[int] | None


class LinkSender(KVConnector):
    """The prefill engine's side of the link. `release` frees the device blocks of a request whose end it delayed;
    `held` (a hybrid KV cache's) gives the ids of the blocks to send, by default the first of the request's table."""

    name = KV_LINK

    def __init__(self, link: BlockPool, block_size: int, release: Callable[[Request], None],
                 held: Callable[[Request], list[int]] | None = None) -> None:
        self.link, self.block_size, self._release, self._held = link, block_size, release, held
        self._sends: list[tuple[int, int]] = []  # (device block, slot) for the next step
        self._ready: list[Handoff] = []  # copied by the next step
        self._awaiting: deque[tuple[Request, list[int]]] = deque()  # ended, holding their blocks until slots are free
        self.batches: list[tuple[BlockTransfers | None, list[Handoff]]] = []  # taken, with the step's copies

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """A prompt that ended (its one sample drawn) hands its blocks over before they are freed."""
        if request.status is RequestStatus.FINISHED_LENGTH and block_ids:
            held = (block_ids[: cdiv(request.num_computed_tokens, self.block_size)] if self._held is None
                    else self._held(request))
            if len(held) <= self.link.num_blocks:
                self._awaiting.append((request, held))
                return True
            self._ready.append(Handoff(request.request_id, request.num_computed_tokens, None))
        return False

    def has_pending(self) -> bool:
        return bool(self._ready or self._awaiting)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BlockTransfers | None:
        """The step's copies into the buffer, for the ended prompts that slots are free for, in order; their
        blocks are freed (this step's allocations are made: the copies run before any later step's writes)."""
        while self._awaiting:
            request, block_ids = self._awaiting[0]
            count = len(block_ids)
            if count > self.link.num_free_blocks:
                break
            self._awaiting.popleft()
            slots = [slot.block_id for slot in self.link.allocate(count)]
            self._sends += list(zip(block_ids, slots))
            self._ready.append(Handoff(request.request_id, request.num_computed_tokens, slots))
            self._release(request)
        if not self._ready:
            return None
        transfers = BlockTransfers(self._sends, []) if self._sends else None
        self.batches.append((transfers, self._ready))
        self._sends, self._ready = [], []
        return transfers

    def take_sent(self, in_flight: list[SchedulerOutput]) -> list[Handoff]:
        """The handoffs whose copies ran in a step the engine has applied (none of `in_flight`), in order."""
        pending = {id(so.kv_connector_metadata.get(self.name)) for so in in_flight if so.kv_connector_metadata}
        sent: list[Handoff] = []
        while self.batches and (self.batches[0][0] is None or id(self.batches[0][0]) not in pending):
            sent += self.batches.pop(0)[1]
        return sent

    def cancel(self, request_id: str) -> bool:
        """Drop a handoff not yet taken by a step (an abort); True if there was one."""
        for index, (request, _) in enumerate(self._awaiting):
            if request.request_id == request_id:
                del self._awaiting[index]
                self._release(request)
                return True
        for index, handoff in enumerate(self._ready):
            if handoff.request_id == request_id:
                del self._ready[index]
                if handoff.slots is not None:
                    self._sends = [(d, s) for d, s in self._sends if s not in handoff.slots]
                    free_slots(self.link, handoff.slots)
                return True
        return False


@dataclass(slots=True)
class HandoffStats:
    requests: int = 0  # admitted with their prompt's K/V from the prefill engine
    blocks: int = 0  # blocks loaded from the buffer
    recomputed: int = 0  # handed over without K/V (the buffer was full): this engine computed their prompts


class LinkReceiver(KVConnector):
    """The decode engine's side of the link."""

    name = KV_LINK

    def __init__(self, link: BlockPool) -> None:
        self.link = link
        self._arrivals: dict[str, Handoff] = {}
        self._loads: list[tuple[int, int]] = []  # (slot, device block) for this step
        self._release: deque[tuple[int, list[int]]] = deque()  # (step after which the slots are free, slots)
        self._step = 0
        self.stats = HandoffStats()

    def reset_stats(self) -> None:
        self.stats = HandoffStats()

    def expect(self, handoff: Handoff) -> None:
        self._arrivals[handoff.request_id] = handoff

    def get_num_held_tokens(self, request: Request) -> int:
        handoff = self._arrivals.get(request.request_id)
        return 0 if handoff is None else handoff.num_tokens

    def update_state_after_alloc(self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int) -> None:
        """Load the first of the request's blocks from its slots this step (it computes from the next)."""
        handoff = self._arrivals.pop(request.request_id)
        self._loads += [(slot, block.block_id) for slot, block in zip(handoff.slots, blocks)]
        self.stats.requests += 1
        self.stats.blocks += len(handoff.slots)
        self._release_later(handoff.slots)

    def begin_step(self) -> None:
        self._step += 1
        while self._release and self._release[0][0] <= self._step:
            free_slots(self.link, self._release.popleft()[1])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BlockTransfers | None:
        if not self._loads:
            return None
        transfers, self._loads = BlockTransfers([], self._loads), []
        return transfers

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        handoff = self._arrivals.pop(request.request_id, None)  # aborted before its K/V was loaded
        if handoff is not None:
            self._release_later(handoff.slots)
        return False

    def _release_later(self, slots: list[int]) -> None:
        """Free the slots once the step after this one, whose forward pass waits for their loads, is applied."""
        self._release.append((self._step + RELEASE_AFTER_STEPS, slots))


class PrefillKVCacheManager(KVCacheManager):
    """A prefill engine's KV manager: the link's sending side after the host tier."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, link: BlockPool,
                 num_host_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, enable_caching, num_host_blocks)
        self.link = link
        self.sender = LinkSender(link, block_size, self.free)
        self.connectors.append(self.sender)


class _ReceivesHandoffs:
    """A decode engine's side of the link, for either KV manager: its receiver is its last connector."""

    connectors: list[KVConnector]

    def _attach_receiver(self, link: BlockPool) -> None:
        self.link = link
        self.receiver = LinkReceiver(link)
        self.connectors.append(self.receiver)

    @property
    def handoff(self) -> HandoffStats:
        return self.receiver.stats


class DecodeKVCacheManager(_ReceivesHandoffs, KVCacheManager):
    """A decode engine's KV manager: the link's receiving side after the host tier."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, link: BlockPool,
                 num_host_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, enable_caching, num_host_blocks)
        self._attach_receiver(link)


class HybridPrefillKVCacheManager(HybridKVCacheManager):
    """A prefill engine's hybrid KV manager: sends each group's held blocks (`held_blocks`)."""

    def __init__(self, num_blocks: int, block_size: int, layout: KVGroupLayout, enable_caching: bool,
                 link: BlockPool, num_host_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, layout, enable_caching, num_host_blocks)
        self.link = link
        self.sender = LinkSender(link, block_size, self.free, self._held_block_ids)
        self.connectors.append(self.sender)

    def _held_block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self.held_blocks(request)]


class HybridDecodeKVCacheManager(_ReceivesHandoffs, HybridKVCacheManager):
    """A decode engine's hybrid KV manager: loads each group's held blocks into fresh ones (`allocate_held`)."""

    def __init__(self, num_blocks: int, block_size: int, layout: KVGroupLayout, enable_caching: bool,
                 link: BlockPool, num_host_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, layout, enable_caching, num_host_blocks)
        self._attach_receiver(link)
