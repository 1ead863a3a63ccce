"""Constrained decoding through xgrammar, `LLM`'s default grammar engine, behind `llguidance_backend.py`'s interface.

xgrammar precomputes token masks when it compiles, so the per-step bitmask fill, which is on the engine's
critical path, costs 4-12x less per row than llguidance's (benchmarks/README.md); compiling costs 10-20x more.
It imports torch, so the engine imports this module only for a constrained request (`manager.py`).
The contract is that of `llguidance_backend.py`: bitmask rows in the layout of `common.py` (xgrammar writes that
layout, into a torch view of our numpy array: no copy), no id the tokenizer lacks, EOS exactly where the
grammar may end, only EOS once the grammar has ended, a refused token leaves the state as it was. xgrammar
gets our vocabulary without the special tokens but EOS (it would match `<|im_start|>` as its text inside a
JSON string) and, for JSON, without the tokens holding a control character (none belongs in JSON of this
layout, yet xgrammar 0.2.9 lets one into a string with minLength / maxLength: invalid JSON).

Kinds:
- json: xgrammar's JSON-schema grammar in the layout of `llguidance_backend.py` (one line, `", "` and `": "`; properties
  beyond the listed ones allowed after them, unless `additionalProperties` says otherwise, as llguidance does).
  Keywords xgrammar accepts but does not enforce are rejected, so no schema is half-enforced: `not`,
  `if`/`then`/`else`, `dependentRequired`/`dependentSchemas`, `contains`, `uniqueItems`,
  `unevaluatedProperties`, formats it lacks, look-around in a `pattern` (llguidance rejects these too); and,
  with a message saying llguidance enforces them: `multipleOf` other than an integer step on an integer,
  `allOf` of several schemas, validation keywords beside `$ref` / `anyOf` / `oneOf` / `allOf`, type-specific
  keywords without a `type`, llguidance's `x-guidance`. `oneOf` is matched as `anyOf`.
- json_object: any JSON object (schema `{"type": "object"}`), same layout.
- regex: the whole output matches (xgrammar's dialect: no look-around, backreferences, `\\b`, `\\p{..}` or
  inline flags).
- choice: exactly one of the strings.
- grammar: GBNF / EBNF in xgrammar's dialect (`root ::= ...`). Lark text (no `::=`) is rejected with a hint:
  `LLM(structured_outputs_backend="llguidance")` takes Lark.

Where both engines take a constraint, what each lets through differs at the edges (all of it valid JSON,
outputs of a schema validate with either). xgrammar is stricter: no `-0` integer, no escape sequence at all in
a string with minLength / maxLength, a `pattern` matched whole (llguidance and JSON Schema: anywhere), `enum`
/ `const` objects and arrays only in compact form (`{"k":[1]}`). llguidance is stricter: no DEL (0x7F) in a
string, no surrogate-pair escapes, and only the canonical tokenization of text the grammar forces (`{"name`
as `{"` + `name`, where xgrammar also takes `{` + `"` + `n` ...), so even greedy outputs can differ. Neither
checks a `date` against the calendar: llguidance takes `2023-02-29`, xgrammar also `2023-04-31`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch  # xgrammar's bitmask argument is a torch tensor (xgrammar imports torch itself anyway)
import xgrammar as xgr

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

_USE_LLGUIDANCE = 'pass LLM(structured_outputs_backend="llguidance")'


@dataclass(frozen=True)
class CompiledGrammar:
    key: tuple[str, str]
    grammar: xgr.CompiledGrammar
    refused: frozenset[int]  # token ids its vocabulary leaves out (xgrammar refuses them, and logs each time)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._rows = BitmaskRows(tokenizer_size(tokenizer), vocab_size, eos_token_ids)
        self.tokenizer_size = self._rows.tokenizer_size
        self.vocab_size = vocab_size
        self.eos_token_ids = self._rows.eos_token_ids
        self.bitmask_width = self._rows.width
        stop = sorted(self.eos_token_ids)
        base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.tokenizer_size, stop_token_ids=stop)
        # xgrammar leaves out the tokens its vocabulary spells as "": give it our vocabulary without the special
        # tokens (but EOS), which it would match as their text (`<|im_start|>` inside a JSON string), and, for
        # JSON, without the tokens holding a control character: none can be in JSON of our layout (whitespace
        # is fixed, strings escape them), yet xgrammar lets one into a string with minLength / maxLength.
        special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        special = frozenset(special - self.eos_token_ids)
        control = {i for i, b in enumerate(base.decoded_vocab[:self.tokenizer_size]) if b and min(b) < 0x20}
        self._refused = {"json": special | (control - self.eos_token_ids), "other": special}
        self._vocabulary = (tokenizer.get_vocab(), base.vocab_type, base.add_prefix_space, stop)
        self._xgr: dict[str, xgr.GrammarCompiler] = {}  # "json" / "other" → xgrammar's, built on first use
        self._batch: xgr.BatchGrammarMatcher | None = None  # built on the first fill
        self._cache: CompileCache[CompiledGrammar] = CompileCache()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The validated grammar of `params`, compiled once per distinct constraint; raises GrammarError."""
        return self._cache.get(params.key, lambda: self._compile(params))

    def new_matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        compiled = self.compile(params)
        return GrammarMatcher(self, xgr.GrammarMatcher(compiled.grammar), compiled.refused)

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        kind, spec = params.key
        rejected = f"structured outputs: the {kind} constraint is rejected by the grammar engine (xgrammar): "
        layout = {"any_whitespace": False, "separators": JSON_SEPARATORS, "strict_mode": False}
        vocabulary = "json" if kind in ("json", "json_object") else "other"
        compiler = self._xgr_compiler(vocabulary)
        try:
            if kind == "json":
                problem = _unenforced(json.loads(spec))
                if problem:
                    raise GrammarError(rejected + problem)
                grammar = compiler.compile_json_schema(spec, **layout)
            elif kind == "json_object":
                grammar = compiler.compile_json_schema('{"type": "object"}', **layout)
            elif kind == "regex":
                grammar = compiler.compile_regex(spec)
            elif kind == "choice":  # EBNF string literals take JSON's escapes
                grammar = compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec)))
            elif kind == "grammar":
                if "::=" not in spec:
                    raise GrammarError(rejected + "xgrammar reads GBNF / EBNF grammars (`root ::= ...`), and this "
                                       f"one has no `::=` rule (Lark?); for a Lark grammar, {_USE_LLGUIDANCE}")
                grammar = compiler.compile_grammar(spec)
            else:
                raise GrammarError(f"structured outputs: unknown constraint kind {kind!r}")
        except GrammarError:
            raise
        except Exception as error:  # RuntimeError (mostly) with the message of xgrammar's parser or converter
            raise GrammarError(rejected + _engine_message(error)) from None
        return CompiledGrammar(params.key, grammar, self._refused[vocabulary])

    def _xgr_compiler(self, vocabulary: str) -> xgr.GrammarCompiler:
        if vocabulary not in self._xgr:
            tokens, vocab_type, add_prefix_space, stop = self._vocabulary
            refused = self._refused[vocabulary]
            encoded = [""] * self.tokenizer_size  # as TokenizerInfo.from_huggingface builds it, less `refused`
            for token, i in tokens.items():
                if i < self.tokenizer_size and i not in refused:
                    encoded[i] = token
            info = xgr.TokenizerInfo(encoded, vocab_type=vocab_type, vocab_size=self.tokenizer_size,
                                     stop_token_ids=stop, add_prefix_space=add_prefix_space)
            self._xgr[vocabulary] = xgr.GrammarCompiler(info, cache_enabled=False)  # our cache keeps them all
        return self._xgr[vocabulary]

    def _batch_matcher(self) -> xgr.BatchGrammarMatcher:
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()  # "auto": half the hardware threads
        return self._batch


class GrammarMatcher:
    """One request's position in its grammar. A rejected token leaves the state as it was."""

    def __init__(self, compiler: GrammarCompiler, matcher: xgr.GrammarMatcher, refused: frozenset[int]) -> None:
        self._compiler = compiler
        self._matcher = matcher
        self._refused = refused
        self._accepted = AcceptedTokens()
        self._ended: bool | None = None  # the grammar allows nothing but EOS now; None: not known yet

    def accept_token(self, token_id: int) -> bool:
        m, compiler = self._matcher, self._compiler
        if token_id in compiler.eos_token_ids:
            if m.is_terminated():  # xgrammar accepts one stop token; more are accepted here, not counted
                self._accepted.add(counted=False)
                return True
            if not m.is_completed() or not m.accept_token(token_id):
                return False
            self._accepted.add()
            return True
        if not 0 <= token_id < compiler.tokenizer_size or token_id in self._refused or m.is_terminated():
            return False  # checked here: xgrammar logs a warning for each of these
        if not m.accept_token(token_id):
            return False
        self._accepted.add()
        self._ended = None
        return True

    def rollback(self, num_tokens: int) -> None:
        counted = self._accepted.take_back(num_tokens)
        if counted:
            self._matcher.rollback(counted)
        self._ended = None

    def fill_bitmask(self, out: np.ndarray) -> None:
        check_out(out, (self._compiler.bitmask_width,))
        if self._matcher.is_terminated():
            out[:] = self._compiler._rows.eos_row
        else:
            self._matcher.fill_next_token_bitmask(torch.from_numpy(out))
            self._compiler._rows.clean(out)

    @property
    def is_terminated(self) -> bool:
        """EOS was accepted, or the grammar has ended: nothing but EOS may follow (xgrammar itself says
        terminated only after a stop token, so the ended state is read off the bitmask, once per state)."""
        m = self._matcher
        if m.is_terminated():
            return True
        if self._ended is None:
            self._ended = False
            if m.is_completed():
                row = np.empty(self._compiler.bitmask_width, dtype=np.int32)
                self.fill_bitmask(row)
                self._ended = np.array_equal(row, self._compiler._rows.eos_row)
        return self._ended

    @property
    def can_finish(self) -> bool:
        """EOS is allowed now: bit set in the bitmask exactly when this holds."""
        m = self._matcher
        return m.is_terminated() or m.is_completed()

    @property
    def error(self) -> str | None:
        """Always None: xgrammar has no error state that stops a matcher mid-way (llguidance's limits)."""
        return None


def fill_bitmasks(matchers: Sequence[GrammarMatcher], out: np.ndarray) -> None:
    """Row i of `out` (int32 [len(matchers), bitmask_width]) gets matchers[i]'s bitmask; the matchers come from
    one GrammarCompiler. Many rows are filled in parallel by xgrammar's batch matcher, on its own threads."""
    if not matchers:
        return
    compiler = matchers[0]._compiler
    check_out(out, (len(matchers), compiler.bitmask_width))
    live, rows = [], []
    for i, matcher in enumerate(matchers):
        if matcher._matcher.is_terminated():
            out[i] = compiler._rows.eos_row
        else:
            live.append(matcher._matcher)
            rows.append(i)
    if not live:
        return
    indices = None if len(live) == len(out) else rows  # one batched call even for a row: no slower than a single
    compiler._batch_matcher().batch_fill_next_token_bitmask(live, torch.from_numpy(out), indices)  # no copy
    compiler._rows.clean(out)


# JSON-schema keywords xgrammar (0.2.9) accepts and ignores: a schema using one would let a violating output
# through. Checked one by one, each with an instance it should refuse.
_NOT_ENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
                 "minContains", "maxContains")
_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                      "uri-reference", "uri-template", "json-pointer", "relative-json-pointer", "uuid"})
# Beside `$ref` / `anyOf` / `oneOf` / `allOf`, xgrammar ignores every keyword but these.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$id", "$anchor", "$defs", "definitions", "discriminator"})
_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
# Without a `type` (nor anything xgrammar infers one from), xgrammar ignores these.
_TYPED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
          "pattern", "format", "minItems", "maxItems", "required", "minProperties", "maxProperties")
_TYPE_SOURCES = ("type", "enum", "const", *_COMBINATORS, "properties", "patternProperties", "additionalProperties",
                 "items", "prefixItems")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def _unenforced(schema: Any, path: str = "#", typed: bool = False) -> str | None:
    """Where and why `schema` uses something xgrammar would not enforce; None when it enforces everything.
    `typed`: the schema applies to strings only (`propertyNames`), so it needs no `type`."""
    if not isinstance(schema, dict):
        return None
    problem = _local_problem(schema, typed)
    if problem:
        return f"at {path}: {problem}"
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if (found := _unenforced(sub, f"{path}/{key}/{name}")) is not None:
                    return found
    for key in ("items", "prefixItems", "additionalProperties", "propertyNames", "additionalItems",
                "unevaluatedItems", "anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        for index, sub in enumerate(subs) if isinstance(subs, list) else [(None, subs)]:
            where = f"{path}/{key}" if index is None else f"{path}/{key}/{index}"
            if (found := _unenforced(sub, where, key == "propertyNames")) is not None:
                return found
    return None


def _local_problem(schema: dict, typed: bool) -> str | None:
    for key in _NOT_ENFORCED:
        if key in schema:
            return f"`{key}` is not implemented by xgrammar"
    if schema.get("uniqueItems") is True:
        return "`uniqueItems` is not implemented by xgrammar"
    if schema.get("unevaluatedProperties", True) is not True:
        return "`unevaluatedProperties` is not implemented by xgrammar"
    if "format" in schema and schema["format"] not in _FORMATS:
        return f"format {schema['format']!r} is not implemented by xgrammar (it has {', '.join(sorted(_FORMATS))})"
    patterns = [schema.get("pattern"), *(schema.get("patternProperties") or {})]
    if any(isinstance(p, str) and _LOOKAROUND.search(p) for p in patterns):
        return "look-around in a `pattern` is not implemented by xgrammar"
    llguidance_has_it = f"; llguidance implements it: {_USE_LLGUIDANCE}"
    if "x-guidance" in schema:
        return f"`x-guidance` is llguidance's option{llguidance_has_it}"
    step = schema.get("multipleOf")
    if step is not None and not (schema.get("type") == "integer" and isinstance(step, int)):
        return f"xgrammar implements `multipleOf` only as an integer step of an integer{llguidance_has_it}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"xgrammar implements `allOf` of one schema only{llguidance_has_it}"
    combinator = next((k for k in _COMBINATORS if k in schema), None)
    if combinator is not None:
        beside = sorted(k for k in schema if k != combinator and k not in _ANNOTATIONS)
        if beside:
            return (f"xgrammar ignores {', '.join(f'`{k}`' for k in beside)} beside `{combinator}` (move them into "
                    f"each branch or the referenced schema){llguidance_has_it}")
    if not typed and not any(k in schema for k in _TYPE_SOURCES):
        typed = [k for k in _TYPED if k in schema]
        if typed:
            return f"xgrammar ignores `{typed[0]}` in a schema without a `type` (add one){llguidance_has_it}"
    return None


def _engine_message(error: Exception) -> str:
    """xgrammar's message without its log prefix (`[12:00:00] /project/cpp/regex_converter.cc:94: `)."""
    text = " ".join(str(error).split())
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text) or type(error).__name__
