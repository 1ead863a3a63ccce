"""Constrained decoding through llguidance: compile a `StructuredOutputsParams` once, match tokens, fill bitmasks.

One of the two grammar engines, `LLM(structured_outputs_backend="llguidance")`; xgrammar, the default, is
`xgrammar_backend.py` behind the same interface, and benchmarks/README.md says when to pick which: llguidance
compiles a schema 10-20x faster (many distinct per-row schemas), takes Lark, and has no dependency (no torch:
this module is what the engine layer may import on its own); xgrammar fills the per-step bitmask 4-12x faster.
llguidance works on bytes over the tokenizer's vocabulary: the allowed-token bitmask of a state has bit
`t % 32` of word `t // 32` set when token `t` may come next (`common.py`). The EOS ids are allowed
exactly where the output may end; special tokens never match text. Where the grammar forces text, only its
canonical tokenization is allowed.

Kinds:
- json: llguidance's JSON-schema grammar, strict (a keyword it does not implement is an error, not ignored).
  Whitespace is fixed, not flexible: one line laid out as `json.dumps` does (`", "` between items, `": "` after
  keys). Flexible whitespace lets a small model wander into endless newlines; this layout is the one models
  write most. A schema can still ask for other layouts with llguidance's `x-guidance` key
  (e.g. `{"whitespace_flexible": true}`), which takes precedence over these defaults.
  Properties beyond the listed ones are allowed (after them) unless `additionalProperties` says otherwise. A
  `date` is checked against month lengths but not leap years (`2023-02-29` passes).
- json_object: any JSON object (schema `{"type": "object"}`), same layout.
- regex: the whole output matches (Rust `regex` syntax: no look-around, no backreferences).
- choice: exactly one of the strings.
- grammar: Lark in llguidance's dialect; text with `::=` and no Lark `start:` rule is read as GBNF and converted.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from batchllm.engine.structured.common import (
    JSON_SEPARATORS,
    AcceptedTokens,
    BitmaskRows,
    CompileCache,
    GrammarError,
    check_out,
    tokenizer_size,
)
from batchllm.structured_outputs import StructuredOutputsParams

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": JSON_SEPARATORS[0],
               "key_separator": JSON_SEPARATORS[1]}
_PARALLEL_MIN_ROWS = 8  # fewer rows: one call each is as fast as the thread pool
_executor: LLExecutor | None = None
_executor_lock = threading.Lock()


@dataclass(frozen=True)
class CompiledGrammar:
    key: tuple[str, str]
    grammar: str  # llguidance's grammar text
    template: LLMatcher  # in its start state, never advanced: matchers are copies, sharing its lexer caches


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        rows = BitmaskRows(tokenizer_size(tokenizer), vocab_size, eos_token_ids)
        backend = copy.copy(tokenizer.backend_tokenizer)  # a fast tokenizer's Rust side, serialized for llguidance
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer_size = rows.tokenizer_size
        self.vocab_size = vocab_size
        self.eos_token_ids = rows.eos_token_ids
        self.bitmask_width = rows.width
        self._ll_tokenizer = LLTokenizer(backend.to_str(), n_vocab=self.tokenizer_size,
                                         eos_token=sorted(rows.eos_token_ids))
        self._eos_row = rows.eos_row
        self._clear_tail = rows.clean  # bits of the last word past the tokenizer's ids
        self._cache: CompileCache[CompiledGrammar] = CompileCache()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The validated grammar of `params`, compiled once per distinct constraint; raises GrammarError."""
        return self._cache.get(params.key, lambda: self._compile(params))

    def new_matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        return GrammarMatcher(self, self.compile(params).template.deep_copy())

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        grammar = _llguidance_grammar(params)
        template = LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"structured outputs: the {params.kind} constraint is rejected by the grammar "
                               f"engine (llguidance): {template.get_error()}")
        return CompiledGrammar(params.key, grammar, template)


def _llguidance_grammar(params: StructuredOutputsParams) -> str:
    kind, spec = params.key
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":  # Lark string literals take JSON escapes
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    if kind == "grammar":
        if "::=" in spec:
            try:
                spec = any_to_lark(spec)  # unchanged when it is Lark already
            except Exception as error:  # GbnfToLarkError and whatever the converter trips on
                raise GrammarError(f"structured outputs: the grammar constraint is not valid GBNF: {error}") from None
        return LLMatcher.grammar_from_lark(spec)
    raise GrammarError(f"structured outputs: unknown constraint kind {kind!r}")


class GrammarMatcher:
    """One request's position in its grammar. A rejected token leaves the state as it was."""

    def __init__(self, compiler: GrammarCompiler, matcher: LLMatcher) -> None:
        self._compiler = compiler
        self._matcher = matcher
        self._accepted = AcceptedTokens()

    def accept_token(self, token_id: int) -> bool:
        m = self._matcher
        if token_id in self._compiler.eos_token_ids:
            if m.is_stopped():  # ended (or stopped by an error, when EOS is all its bitmask allows): not counted
                self._accepted.add(counted=False)
                return True
            if not m.is_accepting() or not m.consume_token(token_id):
                return False
            self._accepted.add()
            return True
        if not 0 <= token_id < self._compiler.tokenizer_size or m.is_stopped():
            return False
        if m.try_consume_tokens([token_id]) != 1:  # unlike consume_token, a refusal is no error state
            return False
        self._accepted.add()
        return True

    def rollback(self, num_tokens: int) -> None:
        counted = self._accepted.take_back(num_tokens)
        if counted and not self._matcher.rollback(counted):
            raise RuntimeError(f"llguidance could not roll back {counted} tokens: {self._matcher.get_error()}")

    def fill_bitmask(self, out: np.ndarray) -> None:
        check_out(out, (self._compiler.bitmask_width,))
        if self.is_terminated:
            out[:] = self._compiler._eos_row
        else:
            self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
            self._compiler._clear_tail(out)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()  # also true in an error state (a resource limit hit mid-way)

    @property
    def can_finish(self) -> bool:
        """EOS is allowed now: bit set in the bitmask exactly when this holds (except in an error state)."""
        m = self._matcher
        return not m.is_error() and (m.is_accepting() or m.is_stopped())

    @property
    def error(self) -> str | None:
        """llguidance's error, when a limit stopped the matcher mid-way (never for a rejected token)."""
        return self._matcher.get_error() if self._matcher.is_error() else None


def fill_bitmasks(matchers: Sequence[GrammarMatcher], out: np.ndarray) -> None:
    """Row i of `out` (int32 [len(matchers), bitmask_width]) gets matchers[i]'s bitmask; the matchers come from
    one GrammarCompiler. Many rows are filled in parallel by llguidance's thread pool, without the GIL."""
    if not matchers:
        return
    compiler = matchers[0]._compiler
    check_out(out, (len(matchers), compiler.bitmask_width))
    live = [(m._matcher, i) for i, m in enumerate(matchers) if not m._matcher.is_stopped()]
    if len(live) < len(matchers):
        out[[i for i, m in enumerate(matchers) if m._matcher.is_stopped()]] = compiler._eos_row
    if len(live) >= _PARALLEL_MIN_ROWS:
        _get_executor().unsafe_compute_mask_ptr(live, out.ctypes.data, out.shape[1] * 4, out.shape[0])
    else:
        for matcher, i in live:
            matcher.unsafe_compute_mask_ptr(out[i].ctypes.data, out.shape[1] * 4)
    if live:
        compiler._clear_tail(out)


def _get_executor() -> LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = LLExecutor()  # llguidance's default: 80% of the CPUs, at most 32 threads
        return _executor
