"""The engine's side of speculative decoding: which rows draft how many tokens this step, and the bookkeeping
after verification.

Before each step the scheduler asks `plan` for the running rows: a row that is decoding (its prompt
computed, no token in flight) gets `k` drafts from the adaptive policy (`policy.py`), capped by its
max_tokens and the model length. With the n-gram proposer the drafts are looked up here, on the host;
device proposers (a draft model, EAGLE, Medusa) drafted them at the end of the row's previous step
(`Request.draft_token_ids`) and are asked for `k` more as the step's lookahead. Rows under a grammar do
not speculate: their drafts would need the matcher advanced through them. On CUDA the adaptive policy plans
nothing while more rows run than verification steps replay from CUDA graphs (`max_verify_rows`).

Asynchronous loop: drafts need the row's tokens, which a step in flight has not returned yet. The engine
therefore waits for the step in flight (`needs_known_tokens`) while speculation pays, and otherwise only
every `PROBE_INTERVAL` steps, to find out whether it has started to (never while more than `max_verify_rows`
rows run: nothing could be planned). Speculation stops paying when the policy plans no draft, or when the
proposer has found none for `PROBE_INTERVAL` steps in a row (an n-gram lookup misses now and then even where
the output copies its input: one miss must not cost the next steps).
"""

from __future__ import annotations

from batchllm.engine.request import Request
from batchllm.engine.speculative.config import NGRAM, SpeculativeConfig
from batchllm.engine.speculative.ngram import NgramProposer
from batchllm.engine.speculative.policy import SpecStats, SpeculationPolicy

PROBE_INTERVAL = 8


class Speculator:
    def __init__(self, config: SpeculativeConfig, overhead_tokens: float, max_model_len: int,
                 verify_overhead_tokens: float = 0.0, max_verify_rows: int | None = None) -> None:
        """`max_verify_rows`: the adaptive policy plans no draft while more rows run (on CUDA, past the rows
        that verification steps replay from a graph, verifying costs more than any acceptance repays)."""
        self.config = config
        self.max_verify_rows = max_verify_rows
        self.max_model_len = max_model_len
        self.policy = SpeculationPolicy(config.num_speculative_tokens, overhead_tokens, verify_overhead_tokens,
                                        adaptive=config.adaptive)
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == NGRAM else None)
        self.active = True  # whether speculation pays: the engine then keeps every row's tokens known
        self._steps_since_probe = 0
        self._misses = 0  # consecutive plans whose rows the policy let draft, but no proposal came

    @property
    def stats(self) -> SpecStats:
        return self.policy.stats

    def reset_stats(self) -> None:
        self.policy.stats = SpecStats.empty(self.config.num_speculative_tokens)

    @property
    def wants_observation(self) -> bool:
        """Whether a device proposer should run over this step's tokens. While the adaptive policy has turned
        speculation off it skips them: its K/V there stays stale, which can only lower a later acceptance."""
        return self.active or not self.config.adaptive

    def too_many_rows(self, num_running: int) -> bool:
        """Whether the adaptive policy plans nothing at this batch size (`max_verify_rows`)."""
        return self.config.adaptive and self.max_verify_rows is not None and num_running > self.max_verify_rows

    def needs_known_tokens(self, num_running: int) -> bool:
        """Whether the next step should be planned with every row's tokens known (asynchronous loop); never
        while too many rows run for anything to be planned, so a large batch keeps the loop overlapped."""
        if self.too_many_rows(num_running):
            return False
        self._steps_since_probe += 1
        if self.active or self._steps_since_probe >= PROBE_INTERVAL:
            self._steps_since_probe = 0
            return True
        return False

    def plan(self, running: list[Request]) -> None:
        """Set `draft_token_ids` (to verify this step) and `num_lookahead` (device proposers: drafts to make at
        the end of it) on the rows that speculate; clear them on the others."""
        rows, candidates = [], []
        k_max = self.config.num_speculative_tokens
        for request in running:
            request.num_lookahead = 0
            if (request.num_pending_tokens or request.matcher is not None or not request.known_to_runner
                    or request.num_computed_tokens != len(request.token_ids) - 1):
                request.draft_token_ids = []
                continue
            room = self.max_model_len - len(request.token_ids) - 1
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - request.num_output_tokens - 1)
            rows.append(request)
            candidates.append((request.request_id, max(0, min(k_max, room))))
        drafted = wanted = False
        plan = [0] * len(rows) if self.too_many_rows(len(running)) else self.policy.plan(candidates) if rows else ()
        for request, k in zip(rows, plan):
            wanted |= k > 0
            if self.ngram is not None:
                request.draft_token_ids = self.ngram.propose(request.request_id, request.token_ids, k) if k else []
            else:
                del request.draft_token_ids[k:]
                request.num_lookahead = k
            drafted |= bool(request.draft_token_ids) or request.num_lookahead > 0
        if rows:  # rows with a token in flight say nothing about whether drafting pays
            self._misses = 0 if drafted or not wanted else self._misses + 1
            self.active = wanted and self._misses < PROBE_INTERVAL

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.policy.record(request.request_id, num_drafted, num_accepted)

    def forget(self, request: Request) -> None:
        self.policy.forget(request.request_id)
        if self.ngram is not None:
            self.ngram.forget(request.request_id)
