"""The adaptive speculation policy: per step, how many drafts each decoding row verifies.

Cost model: a step that runs T query tokens costs `overhead_tokens + T` token units (`overhead_tokens`: the fixed
cost of a forward pass, reading the weights, in tokens), plus `verify_overhead_tokens` when it verifies drafts
(what a verification step costs beyond its tokens: no CUDA graph, the rejection sampler, the drained
asynchronous loop, the proposer's own passes). Every decoding row yields one token for sure; its j-th draft
yields `a ** j` more expected tokens (a: the row's acceptance rate; all j must be accepted) for one unit.
Slots are added greedily, best gain first, while the gain exceeds the step's current tokens per unit E / C,
since exactly then does adding one raise E / C; gains fall with j within a row, so for a verifying step the
greedy choice is optimal, and the plan is kept only if it beats not verifying at all. With nothing accepted
the rates fall, no slot pays, and the policy turns itself off. A new request starts from the acceptance of
the requests before it, so a job whose drafts are all rejected stops drafting for its new rows too.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStats:
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_spec_steps: int = 0  # row-steps that verified at least one draft
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, num_positions: int) -> SpecStats:
        return cls(drafted_per_position=[0] * num_positions, accepted_per_position=[0] * num_positions)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


class SpeculationPolicy:
    def __init__(self, num_speculative_tokens: int, overhead_tokens: float, verify_overhead_tokens: float = 0.0,
                 prior_drafted: float = 2.0, prior_accepted: float = 1.6, decay: float = 0.8,
                 global_decay: float = 0.98, adaptive: bool = True) -> None:
        self.k = num_speculative_tokens
        self.overhead_tokens = overhead_tokens
        self.verify_overhead_tokens = verify_overhead_tokens
        self.prior_drafted = prior_drafted
        self.decay, self.global_decay = decay, global_decay
        self._global = (prior_accepted, prior_drafted)  # decayed over every request's drafts
        self.adaptive = adaptive
        self.stats = SpecStats.empty(num_speculative_tokens)
        # request → decayed (accepted, drafted), starting from the prior, which decays like any evidence: a row
        # whose drafts are all rejected sees its rate fall to 0, not to a floor that would keep it drafting.
        self._counts: dict[str, tuple[float, float]] = {}

    def _prior(self) -> tuple[float, float]:
        """A new request's counts: the engine-wide acceptance, weighted like `prior_drafted` drafts."""
        accepted, drafted = self._global
        return (self.prior_drafted * accepted / drafted if drafted else 0.0), self.prior_drafted

    def rate(self, request_id: str) -> float:
        accepted, drafted = self._counts.get(request_id) or self._prior()
        return accepted / drafted if drafted else 0.0

    def plan(self, rows: list[tuple[str, int]], num_other_tokens: int = 0) -> list[int]:
        """Drafts per row (same order) for `rows` of (request id, most drafts it may take)."""
        if not self.adaptive:
            return [min(max_k, self.k) for _, max_k in rows]
        ks = [0] * len(rows)
        base_tokens, base_cost = float(len(rows)), self.overhead_tokens + len(rows) + num_other_tokens
        tokens, cost = base_tokens, base_cost + self.verify_overhead_tokens
        rates = [self.rate(request_id) for request_id, _ in rows]
        heap = [(-rate, i) for i, rate in enumerate(rates) if rows[i][1] > 0 and rate * cost > tokens]
        heapq.heapify(heap)
        while heap:
            negative_gain, i = heap[0]
            gain = -negative_gain
            if gain * cost <= tokens:
                break
            ks[i] += 1
            tokens += gain
            cost += 1
            if ks[i] < min(rows[i][1], self.k):
                heapq.heapreplace(heap, (-gain * rates[i], i))
            else:
                heapq.heappop(heap)
        if tokens * base_cost <= base_tokens * cost:
            return [0] * len(rows)  # verifying does not pay for its fixed cost
        return ks

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """`num_accepted` of the row's `num_drafted` drafts (a prefix) were accepted."""
        accepted, drafted = self._counts.get(request_id) or self._prior()
        self._counts[request_id] = (accepted * self.decay + num_accepted, drafted * self.decay + num_drafted)
        if num_drafted:
            g_accepted, g_drafted = self._global
            self._global = (g_accepted * self.global_decay + num_accepted, g_drafted * self.global_decay + num_drafted)
        stats = self.stats
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        stats.num_spec_steps += num_drafted > 0
        for j in range(num_drafted):
            stats.drafted_per_position[j] += 1
        for j in range(num_accepted):
            stats.accepted_per_position[j] += 1

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)
