"""The output length the scheduler expects of each request: what KV-aware admission keeps blocks for.

A forced output (`ignore_eos=True`, or `min_tokens == max_tokens`) runs to `max_tokens`. Any other is estimated
from the rows finished in this run: a high quantile of their output lengths times a safety margin, capped by the
request's own `max_tokens`. Real workloads mostly stop well before `max_tokens` (an EOS), so reserving `max_tokens`
for them would keep batches small for nothing. Before any row finished there is nothing to learn from, and the
estimate is optimistic (the tokens a request already has), so that the first batch fills; a guess that proves short
is caught by preemption, as under the optimistic policy. A request already past the estimate is expected to need
what it has: it is the oldest that survive preemption, so it finishes.

The quantile is taken over the most recent finished rows only, so that a run whose lengths drift follows them.
"""

from __future__ import annotations

import math
from collections import deque

from batchllm.engine.request import Request, RequestStatus

QUANTILE = 0.9  # of the finished rows' output lengths
SAFETY_MARGIN = 1.2  # times that quantile
RECENT_ROWS = 1024  # finished rows the quantile is taken over


def is_forced(request: Request) -> bool:
    """Its output runs to `max_tokens` whatever is sampled (stop strings aside, which only shorten it)."""
    params = request.sampling_params
    return params.max_tokens is not None and (params.ignore_eos or params.min_tokens >= params.max_tokens)


class OutputLengthEstimator:
    def __init__(self) -> None:
        self._recent: deque[int] = deque(maxlen=RECENT_ROWS)
        self._estimate: int | None = None  # output tokens; None until a row finished
        self._stale = False

    def reset(self) -> None:
        """A new run: forget what the last one's rows said."""
        self._recent.clear()
        self._estimate, self._stale = None, False

    def observe(self, request: Request) -> None:
        """Learn from a finished request (a forced, pooling, failed or aborted one says nothing about where outputs
        stop)."""
        if request.pooling is not None or is_forced(request) or request.status not in _LEARNED_FROM:
            return
        self._recent.append(request.num_output_tokens)
        self._stale = True

    @property
    def estimate(self) -> int | None:
        """The output tokens expected of an unforced request (before its `max_tokens` cap); None before any row
        finished."""
        if self._stale:
            lengths = sorted(self._recent)
            nearest_rank = max(1, math.ceil(QUANTILE * len(lengths)))
            self._estimate = math.ceil(lengths[nearest_rank - 1] * SAFETY_MARGIN)
            self._stale = False
        return self._estimate

    def expected_num_tokens(self, request: Request, max_model_len: int) -> int:
        """The length (prompt and output) that `request` is expected to reach. One more than the last token that
        needs K/V: an asynchronous step may compute the token after an unforeseen stop."""
        # Asked of every running request in each step that admits: plain attribute reads, no calls.
        now = len(request.token_ids) + request.num_pending_tokens
        if request.pooling is not None:
            return now
        params = request.sampling_params
        max_tokens = params.max_tokens
        if max_tokens is None:
            cap = max_model_len
        else:
            cap = min(max_model_len, request.num_prompt_tokens + max_tokens)
            if params.ignore_eos or params.min_tokens >= max_tokens:  # forced (`is_forced`)
                return max(cap, now)
        estimate = self._estimate if not self._stale else self.estimate
        if estimate is None:
            return now
        return max(now, min(cap, request.num_prompt_tokens + estimate))


_LEARNED_FROM = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
