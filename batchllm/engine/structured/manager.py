"""Structured outputs in the engine: a grammar matcher per constrained request, and each step's bitmask.

A constrained request gets its matcher when it is added (a constraint the grammar engine rejects fails that
request alone). The matcher consumes exactly the request's output tokens, as they are appended
(`Request.append_token`), so preemption needs no rollback: a recomputed request keeps its tokens and its
matcher state. With asynchronous scheduling the bitmask of step N+1 is filled after step N's tokens are
applied, while step N+1's forward pass runs; the runner waits for it only to sample.

The grammar engine is a backend: xgrammar (`LLM`'s default, `xgrammar_backend.py`: the cheapest per-step bitmask)
or llguidance (`llguidance_backend.py`: compiles 10-20x faster, takes Lark grammars), behind one interface. Its
module is imported on the first constrained request, so an engine without any imports neither (xgrammar imports
torch; this package does not).

With a reasoning parser (`reasoning_parser`, set by `LLM`), each matcher sits behind a `ReasoningGate`: the grammar
constrains the answer, after the reasoning ends (`reasoning_gate.py`).
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from batchllm.engine.interfaces import GrammarBitmask, SchedulerOutput
from batchllm.engine.request import Request, RequestStatus
from batchllm.engine.structured.common import BitmaskRows, GrammarError, tokenizer_size
from batchllm.engine.structured.reasoning_gate import ReasoningGate
from batchllm.reasoning import ReasoningParser
from batchllm.structured_outputs import StructuredOutputsParams

INCOMPLETE = ("the output is incomplete: generation stopped ({reason}) before the structured-output constraint "
              "was satisfied, so it does not parse")
# structured_outputs_backend → the module with GrammarCompiler / GrammarMatcher / fill_bitmasks over that engine.
GRAMMAR_BACKENDS = {"xgrammar": "batchllm.engine.structured.xgrammar_backend",
                    "llguidance": "batchllm.engine.structured.llguidance_backend"}


def check_backend(backend: Any, argument: str = "structured_outputs_backend") -> str:
    if backend not in GRAMMAR_BACKENDS:
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, GRAMMAR_BACKENDS))}, got {backend!r}")
    return backend


class StructuredOutputManager:
    """`backend`: a key of GRAMMAR_BACKENDS. Its default here is the torch-free llguidance, so the engine layer
    alone never imports torch; `LLM` passes its `structured_outputs_backend` (default: xgrammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int],
                 backend: str = "llguidance") -> None:
        self.backend = check_backend(backend, "StructuredOutputManager backend")
        self._compiler_args = (tokenizer, vocab_size, eos_token_ids)
        self._compiler = None
        self._buffer: np.ndarray | None = None
        self.num_active = 0  # constrained requests in the engine: steps without any skip all of this
        self.reasoning_parser: ReasoningParser | None = None
        self._open_row: np.ndarray | None = None  # a reasoning row: every token of the tokenizer allowed

    @property
    def compiler(self):
        # Built on first use: engines without constrained requests never import the grammar engine, and its
        # view of the vocabulary takes a moment to build.
        if self._compiler is None:
            self._compiler = self._grammar_module().GrammarCompiler(*self._compiler_args)
        return self._compiler

    def _grammar_module(self):
        return importlib.import_module(GRAMMAR_BACKENDS[self.backend])  # imported once, then a dict lookup

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile `params` now (cached for the requests that use it); raises GrammarError."""
        self.compiler.compile(params)

    def init_request(self, request: Request) -> str | None:
        """Give a constrained request its matcher; returns the grammar engine's error if it cannot."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return None
        try:
            request.matcher = self.compiler.new_matcher(params)
        except GrammarError as error:
            return str(error)
        if self.reasoning_parser is not None:
            request.matcher = ReasoningGate(request.matcher, self.reasoning_parser, self._compiler_args[0],
                                            request.prompt_token_ids, self._reasoning_row())
        self.num_active += 1
        return None

    def finish_request(self, request: Request) -> None:
        """Note an output that ends where the grammar cannot; the request's status stays what it was."""
        if request.matcher is None:
            return
        self.num_active -= 1
        if request.status is RequestStatus.FINISHED_ABORTED:
            return  # cancelled: nobody reads its output, so no note about it
        if request.error is None and not request.matcher.can_finish:
            request.error = INCOMPLETE.format(reason=request.finish_reason)

    def constrained_ids(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> list[str]:
        if not self.num_active:
            return []
        return [s.request_id for s in output.requests if s.sample and requests[s.request_id].matcher is not None]

    def bitmask(self, request_ids: list[str], requests: Mapping[str, Request]) -> GrammarBitmask:
        """The step's bitmask, from the matchers' current state. A request that finished meanwhile (its token
        will be dropped) may sample anything."""
        fill_bitmasks = self._grammar_module().fill_bitmasks
        rows, matchers, reasoning_rows = [], [], []
        for row, request_id in enumerate(request_ids):
            request = requests.get(request_id)
            if request is not None and not request.status.finished:
                matcher = request.matcher
                if isinstance(matcher, ReasoningGate):
                    if matcher.reasoning:
                        reasoning_rows.append(row)
                        continue
                    matcher = matcher.inner
                rows.append(row)
                matchers.append(matcher)
        bitmask = self._rows_of_buffer(len(request_ids))
        if len(rows) == len(request_ids):
            fill_bitmasks(matchers, bitmask)
        else:
            bitmask.fill(-1)
            if rows:
                filled = np.empty((len(rows), bitmask.shape[1]), dtype=np.int32)
                fill_bitmasks(matchers, filled)
                bitmask[rows] = filled
            if reasoning_rows:
                bitmask[reasoning_rows] = self._reasoning_row()
        return GrammarBitmask(request_ids, bitmask)

    def _reasoning_row(self) -> np.ndarray:
        if self._open_row is None:
            tokenizer, vocab_size, eos_token_ids = self._compiler_args
            rows = BitmaskRows(tokenizer_size(tokenizer), vocab_size, eos_token_ids)
            self._open_row = np.full(rows.width, -1, dtype=np.int32)
            rows.clean(self._open_row)
        return self._open_row

    def _rows_of_buffer(self, num_rows: int) -> np.ndarray:
        """The first rows of one buffer reused every step (a step's bitmask is read, copied to the device or
        sent to the workers, before the next step fills it): megabytes a step, not allocated again."""
        if self._buffer is None or self._buffer.shape[0] < num_rows:
            self._buffer = np.empty((max(num_rows, 256), self.compiler.bitmask_width), dtype=np.int32)
        return self._buffer[:num_rows]
