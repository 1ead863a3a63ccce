"""The KV-connector seam (engine/kv_connector.py) with a connector written here, no host tier and no P/D link: what it
claims the scheduler does not compute, its blocks are allocated where it was told, its metadata reaches the runner
under its name, and it hears of the request's end. Numbers are worked out by hand below (block size 16).

Its "worker side" is the executor below: it writes the claimed tokens into the slots of the blocks the connector was
given, as a real load would copy their K/V. The fake model reads every token back through the block table, so a
claim loaded into the wrong blocks, or tokens skipped that nobody loaded, change the sampled tokens.
"""

from __future__ import annotations

import random

from batchllm.config import SchedulerConfig
from batchllm.engine.block_pool import KVCacheBlock
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.interfaces import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.engine.kv_connector import KVConnector
from batchllm.engine.request import Request
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams
from tests.unit.fake_executor import FakeExecutor, expected_continuation
from tests.unit.test_scheduler import BLOCK, _max_tokens_stop, _NoDetokenizer, _run

PROMPT = [random.Random(7).randrange(5, 900) for _ in range(40)]  # 2 full blocks and 8 tokens


class ClaimingConnector(KVConnector):
    """Claims the first `matched` tokens of each prompt after the device prefix (as a prefix-cache tier would), or
    `held` tokens of a request it holds whole (as a swapped-out request or a P/D handoff)."""

    name = "claiming"

    def __init__(self, matched: int = 0, held: int = 0) -> None:
        self.matched, self.held = matched, held
        self.loads: list[tuple[str, list[int], int]] = []  # (request id, device blocks, tokens), for the next step
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> int:
        self.calls.append(("matched", request.request_id, num_computed))
        return self.matched

    def get_num_held_tokens(self, request: Request) -> int:
        return self.held

    def update_state_after_alloc(self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int) -> None:
        self.held = 0  # handed over: the request's K/V is on the device now
        self.loads.append((request.request_id, [block.block_id for block in blocks], num_external_tokens))

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self.calls.append(("finished", request.request_id, list(block_ids)))
        return False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> list | None:
        loads, self.loads = self.loads, []
        return loads or None


class LoadingExecutor(FakeExecutor):
    """Writes the prompt tokens a connector claimed into the blocks it was given, before the step."""

    def __init__(self, num_blocks: int, prompts: dict[str, list[int]]) -> None:
        super().__init__(num_blocks, BLOCK, 8192)
        self.prompts = prompts

    def _execute(self, so: SchedulerOutput, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        for request_id, blocks, num_tokens in (so.kv_connector_metadata or {}).get(ClaimingConnector.name, []):
            for position, token in enumerate(self.prompts[request_id][:num_tokens]):
                self.slots[blocks[position // BLOCK] * BLOCK + position % BLOCK] = token
        return super()._execute(so, grammar)


def _engine(connector: KVConnector, caching: bool) -> tuple[EngineCore, LoadingExecutor]:
    kv = KVCacheManager(8, BLOCK, caching)
    kv.connectors.append(connector)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=8 * BLOCK), kv,
                          _max_tokens_stop)
    executor = LoadingExecutor(8, {"A": PROMPT})
    return EngineCore(scheduler, executor, _NoDetokenizer()), executor


def test_tokens_a_connector_matches_are_loaded_not_computed():
    connector = ClaimingConnector(matched=32)
    engine, executor = _engine(connector, caching=True)
    engine.add_request("A", PROMPT, SamplingParams(max_tokens=4))

    engine.step()
    # The pool is fresh and holds no prefix: the connector is asked after 0 device tokens, claims 32 (2 blocks), and
    # A gets ceil(40 / 16) = 3 fresh blocks [0, 1, 2], the first 2 for the connector's loads. A computes nothing in
    # the step that loads them.
    assert connector.calls == [("matched", "A", 0)]
    loading = executor.steps[0]
    assert loading.requests == [] and loading.kv_connector_metadata == {"claiming": [("A", [0, 1], 32)]}

    engine.step()
    computing = executor.steps[1].requests
    assert [(r.num_computed_tokens, r.token_ids, r.block_ids) for r in computing] == [(32, PROMPT[32:], [0, 1, 2])]
    assert executor.steps[1].kv_connector_metadata is None

    done = _run(engine)
    assert done["A"].output_token_ids == expected_continuation(PROMPT, 4)
    stats, kv = engine.scheduler.stats, engine.scheduler.kv_cache
    assert stats.num_prefill_tokens == 40 - 32 and stats.num_decode_tokens == 3
    assert (kv.stats.queries, kv.stats.hits) == (40, 32)
    assert connector.calls[-1] == ("finished", "A", [0, 1, 2])
    assert kv.pool.num_free_blocks == 8


def test_a_request_a_connector_holds_whole_resumes_after_its_tokens():
    # Without prefix caching the matched-token hook is never asked; the held-token hook is, first, for every admission.
    connector = ClaimingConnector(matched=32, held=40)
    engine, executor = _engine(connector, caching=False)
    engine.add_request("A", PROMPT + [901], SamplingParams(max_tokens=2))
    executor.prompts["A"] = PROMPT + [901]

    engine.step()
    # 40 held tokens and 1 to compute: ceil(41 / 16) = 3 fresh blocks, all handed to the connector.
    assert executor.steps[0].requests == []
    assert executor.steps[0].kv_connector_metadata == {"claiming": [("A", [0, 1, 2], 40)]}
    engine.step()
    assert [(r.num_computed_tokens, r.token_ids) for r in executor.steps[1].requests] == [(40, [901])]

    done = _run(engine)
    assert done["A"].output_token_ids == expected_continuation(PROMPT + [901], 2)
    assert engine.scheduler.stats.num_prefill_tokens == 1
    assert [call for call in connector.calls if call[0] == "matched"] == []
