"""The grammar engines' wrappers (batchllm.engine.structured.llguidance_backend: llguidance,
batchllm.engine.structured.xgrammar_backend: xgrammar) against independent references; most tests run on both
(the `backend` fixture).

A matcher is driven along a random path: fill the bitmask, pick a random allowed token (seeded), accept it,
until a token budget, then steer towards the end (EOS where allowed, else closing punctuation). The decoded
text is then checked by a reference that knows nothing of either engine: json.loads + jsonschema.validate
(with format checking), re.fullmatch, membership in the choice list, a hand-written parser for the Lark grammar.
Every step also checks the bitmask contract: EOS allowed exactly when can_finish, no id the tokenizer lacks.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pydantic
import pytest

from batchllm.engine.structured import llguidance_backend as grammar_module
from batchllm.engine.structured.common import GrammarError
from batchllm.structured_outputs import StructuredOutputsParams

BACKENDS = {"llguidance": "batchllm.engine.structured.llguidance_backend",
            "xgrammar": "batchllm.engine.structured.xgrammar_backend"}
USE_LLGUIDANCE = 'pass LLM(structured_outputs_backend="llguidance")'


class _Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=16)
    city: str = pydantic.Field(max_length=12)
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class _Order(pydantic.BaseModel):
    id: int = pydantic.Field(ge=1, le=10_000)
    status: str = pydantic.Field(pattern=r"^(open|closed)$")
    ship_to: _Address
    notes: str | None = None
    quantities: list[int] = pydantic.Field(min_length=1, max_length=3)


# The suite, also compiled by benchmarks/structured_backends.py.
SCHEMAS: dict[str, dict] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
            "id": {"type": "string", "format": "uuid"},
        },
        "required": ["name", "age", "address"],
    },
    "array_bounds": {"type": "array", "items": {"type": "integer", "minimum": -10, "maximum": 10},
                     "minItems": 2, "maxItems": 5},
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M"]},
                       "level": {"enum": [1, 2, None]}, "version": {"const": "v1"}},
        "required": ["color", "size", "level", "version"], "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                       "n": {"type": "integer", "minimum": 100, "maximum": 999},
                       "p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        "required": ["x", "n", "p"], "additionalProperties": False,
    },
    "string_formats": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"},
                       "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
                       "word": {"type": "string", "minLength": 2, "maxLength": 8}},
        "required": ["day", "code", "word"], "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}, {"type": "null"}]},
                       "items": {"type": "array", "items": {"anyOf": [{"type": "boolean"}, {"type": "number"}]},
                                 "maxItems": 3}},
        "required": ["value"], "additionalProperties": False,
    },
    "refs": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"},
                       "via": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2}},
        "required": ["start", "end"], "additionalProperties": False,
    },
    "recursive_tree": {
        "$defs": {"node": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
            "required": ["name"], "additionalProperties": False}},
        "$ref": "#/$defs/node",
    },
    "optional_only": {
        "type": "object",
        "properties": {"flag": {"type": "boolean"}, "label": {"type": "string", "maxLength": 10},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "additionalProperties": False,
    },
    "pydantic_order": _Order.model_json_schema(),
}

REGEXES = [r"\d{3}-\d{4}", r"(cat|dog)s?", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,2}",
           r"[a-z]{1,10}@[a-z]{1,8}\.(com|org)", r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?"]
CHOICES = ["yes", "no", "maybe so", 'say "hi"', "back\\slash", "ünïcode ✓", "no way"]
ARITH_LARK = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
LIST_GBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c]+\n'
PADDING = 69  # model vocab = tokenizer + 69: ids the grammar engines never see
EOS_IDS = (2, 0)  # <|im_end|> (the model's) and <|endoftext|>


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from batchllm.model.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def compiler_of(tokenizer):
    """backend module → its GrammarCompiler over the tokenizer, built once."""
    built = {}

    def get(module):
        if module not in built:
            built[module] = module.GrammarCompiler(tokenizer, len(tokenizer) + PADDING, EOS_IDS)
        return built[module]

    return get


@pytest.fixture(scope="module", params=list(BACKENDS))
def backend(request):
    """The wrapper module of one grammar engine."""
    return importlib.import_module(BACKENDS[request.param])


@pytest.fixture
def compiler(compiler_of, backend):
    return compiler_of(backend)


@pytest.fixture(scope="module")
def closers(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Tokens made only of closing characters (of a string, an array, an object, a parenthesis), and those of
    them with a quote."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    ids = [i for i, p in enumerate(pieces) if p and set(p) <= set('"]})')]
    return np.array(ids), np.array([i for i in ids if '"' in pieces[i]])


# Neither engine checks a date against the calendar (llguidance lets 4579-02-29 through, xgrammar 2024-02-30 too):
# the reference checks the form and the ranges of month and day, which both enforce.
FORMATS = jsonschema.FormatChecker()
FORMATS.checks("date")(lambda text: not isinstance(text, str) or re.fullmatch(
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", text) is not None)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def walk(compiler, matcher, tokenizer, closers, seed, budget=40, cap=400) -> str:
    """Drive `matcher` to its end along a random allowed path; returns the decoded text (EOS excluded).
    Past `budget` tokens, EOS wherever allowed, else mostly closing tokens: half the time one with a quote
    (inside a string, where a bracket is just another character, only a quote closes)."""
    rng = np.random.default_rng(seed)
    row = np.zeros(compiler.bitmask_width, dtype=np.int32)
    tokens: list[int] = []
    for _ in range(cap):
        matcher.fill_bitmask(row)
        allowed = allowed_ids(row)
        assert allowed.size and allowed.max() < len(tokenizer)
        eos_allowed = np.isin(EOS_IDS, allowed)
        assert eos_allowed.all() == eos_allowed.any() == matcher.can_finish
        others = allowed[~np.isin(allowed, EOS_IDS)]
        if matcher.can_finish and (len(tokens) >= budget or not others.size):
            token = int(rng.choice(EOS_IDS))
        else:
            pool = others
            if len(tokens) >= budget:
                closing, quoted = np.intersect1d(others, closers[0]), np.intersect1d(others, closers[1])
                pool = quoted if quoted.size and rng.random() < 0.5 else closing if closing.size else others
            token = int(rng.choice(pool))
        assert matcher.accept_token(token)
        if token in EOS_IDS:
            assert matcher.is_terminated and matcher.can_finish
            return tokenizer.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"no end after {cap} tokens: {tokenizer.decode(tokens)!r}")


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_paths_validate(name, compiler, tokenizer, closers):
    schema = SCHEMAS[name]
    params = StructuredOutputsParams(json=schema)
    for seed in range(3):
        text = walk(compiler, compiler.new_matcher(params), tokenizer, closers, seed)
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
        assert "\n" not in text  # the fixed one-line layout


def test_pydantic_class_and_json_object(compiler, tokenizer, closers):
    text = walk(compiler, compiler.new_matcher(StructuredOutputsParams(json=_Order)), tokenizer, closers, 7)
    _Order.model_validate_json(text)
    for seed in range(3):
        text = walk(compiler, compiler.new_matcher(StructuredOutputsParams(json_object=True)), tokenizer, closers,
                    seed)
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_paths_fullmatch(pattern, compiler, tokenizer, closers):
    params = StructuredOutputsParams(regex=pattern)
    for seed in range(4):
        text = walk(compiler, compiler.new_matcher(params), tokenizer, closers, seed, budget=8)
        assert re.fullmatch(pattern, text), text


def test_choice_paths(compiler, tokenizer, closers):
    params = StructuredOutputsParams(choice=CHOICES)
    seen = {walk(compiler, compiler.new_matcher(params), tokenizer, closers, seed, budget=2) for seed in range(12)}
    assert seen <= set(CHOICES) and len(seen) > 2


def _parse_arith(text: str) -> None:
    """A recursive-descent parser for ARITH_LARK; raises ValueError when `text` is not in the language."""
    pos = 0

    def expr():
        nonlocal pos
        term()
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            term()

    def term():
        nonlocal pos
        if text.startswith("(", pos):
            pos += 1
            expr()
            if not text.startswith(")", pos):
                raise ValueError(f"expected ')' at {pos} in {text!r}")
            pos += 1
            return
        digits = re.match(r"[0-9]{1,3}", text[pos:])
        if not digits:
            raise ValueError(f"expected a number at {pos} in {text!r}")
        pos += digits.end()

    expr()
    if pos != len(text):
        raise ValueError(f"trailing text at {pos} in {text!r}")


def test_gbnf_paths(compiler, tokenizer, closers):
    for seed in range(4):
        text = walk(compiler, compiler.new_matcher(StructuredOutputsParams(grammar=LIST_GBNF)), tokenizer, closers,
                    seed, budget=12)
        assert re.fullmatch(r"\[[a-c]+(,[a-c]+)*\]", text), text


def test_lark_paths_llguidance(compiler_of, tokenizer, closers):
    compiler = compiler_of(grammar_module)  # xgrammar takes no Lark: see test_lark_is_refused_by_xgrammar
    for seed in range(4):
        text = walk(compiler, compiler.new_matcher(StructuredOutputsParams(grammar=ARITH_LARK)), tokenizer, closers,
                    seed, budget=16)
        _parse_arith(text)  # no %ignore in the grammar: no whitespace either
    with pytest.raises(ValueError):
        _parse_arith("(1+2")  # the reference itself rejects


def test_lark_is_refused_by_xgrammar(compiler_of):
    compiler = compiler_of(importlib.import_module(BACKENDS["xgrammar"]))
    with pytest.raises(GrammarError, match=re.escape(USE_LLGUIDANCE)) as info:
        compiler.compile(StructuredOutputsParams(grammar=ARITH_LARK))
    assert "GBNF" in str(info.value) and "grammar constraint" in str(info.value)


def test_forbidden_tokens_are_refused_and_leave_the_state(compiler, tokenizer):
    matcher = compiler.new_matcher(StructuredOutputsParams(regex=r"(cat|dog)s?"))
    before = np.zeros(compiler.bitmask_width, dtype=np.int32)
    matcher.fill_bitmask(before)
    allowed = set(allowed_ids(before))
    forbidden = [t for t in tokenizer.encode(" hello world xyz", add_special_tokens=False) if t not in allowed]
    assert forbidden
    for token in [*forbidden, EOS_IDS[0], len(tokenizer), len(tokenizer) + PADDING, -1]:
        assert not matcher.accept_token(token)
    after = np.zeros_like(before)
    matcher.fill_bitmask(after)
    assert np.array_equal(before, after) and not matcher.can_finish and not matcher.is_terminated
    (cat,) = tokenizer.encode("cat", add_special_tokens=False)
    assert matcher.accept_token(cat) and matcher.can_finish and not matcher.is_terminated
    (s,) = tokenizer.encode("s", add_special_tokens=False)
    assert matcher.accept_token(s) and matcher.is_terminated and matcher.can_finish
    assert not matcher.accept_token(cat)  # nothing may follow but EOS
    matcher.fill_bitmask(after)
    assert set(allowed_ids(after)) == set(EOS_IDS)


def test_rollback_restores_the_bitmask(compiler, tokenizer):
    matcher = compiler.new_matcher(StructuredOutputsParams(json=SCHEMAS["refs"]))
    rng = np.random.default_rng(1)
    tokens, masks = [], []
    while not matcher.is_terminated:  # a random path to the closing brace, which ends this schema
        row = np.zeros(compiler.bitmask_width, dtype=np.int32)
        matcher.fill_bitmask(row)
        masks.append(row)
        allowed = allowed_ids(row)
        tokens.append(int(rng.choice(allowed[~np.isin(allowed, EOS_IDS)])))
        assert matcher.accept_token(tokens[-1])
    assert matcher.can_finish and len(tokens) > 8
    assert matcher.accept_token(EOS_IDS[0])  # an EOS after the end
    row = np.zeros(compiler.bitmask_width, dtype=np.int32)
    matcher.rollback(1)  # that EOS: the schema is still complete
    matcher.fill_bitmask(row)
    assert matcher.is_terminated and set(allowed_ids(row)) == set(EOS_IDS)
    n = len(tokens)
    for back in (2, 2, n - 4):
        matcher.rollback(back)
        n -= back
        matcher.fill_bitmask(row)
        assert np.array_equal(row, masks[n]) and not matcher.is_terminated
    assert n == 0 and not matcher.can_finish
    with pytest.raises(ValueError):
        matcher.rollback(1)
    assert matcher.accept_token(tokens[0])  # still usable


def test_rollback_of_an_eos_taken_before_the_end(compiler, tokenizer):
    matcher = compiler.new_matcher(StructuredOutputsParams(regex=r"(cat|dog)s?"))
    (cat,) = tokenizer.encode("cat", add_special_tokens=False)
    assert matcher.accept_token(cat) and matcher.accept_token(EOS_IDS[1]) and matcher.is_terminated
    matcher.rollback(1)
    assert not matcher.is_terminated and matcher.can_finish
    (s,) = tokenizer.encode("s", add_special_tokens=False)
    assert matcher.accept_token(s) and matcher.is_terminated


def test_fill_bitmasks_matches_single_fills(backend, compiler, tokenizer, closers):
    params = [StructuredOutputsParams(json=SCHEMAS[name]) for name in SCHEMAS] + [
        StructuredOutputsParams(regex=REGEXES[0]), StructuredOutputsParams(choice=CHOICES)]
    matchers = [compiler.new_matcher(p) for p in params for _ in range(2)]
    rng = np.random.default_rng(0)
    row = np.zeros(compiler.bitmask_width, dtype=np.int32)
    for i, matcher in enumerate(matchers):  # advance each a different number of tokens; some to the end
        for _ in range(i % 7 if i % 5 else 1000):
            matcher.fill_bitmask(row)
            allowed = allowed_ids(row)
            if matcher.is_terminated:
                break
            others = allowed[~np.isin(allowed, EOS_IDS)]
            assert matcher.accept_token(int(rng.choice(others)) if others.size else EOS_IDS[0])
    assert any(m.is_terminated for m in matchers)
    for rows in (matchers, matchers[:3]):  # llguidance: its thread pool, then one by one
        batch = np.full((len(rows), compiler.bitmask_width), -1, dtype=np.int32)
        backend.fill_bitmasks(rows, batch)
        for matcher, got in zip(rows, batch):
            matcher.fill_bitmask(row)
            assert np.array_equal(got, row)
            if matcher.is_terminated:
                assert set(allowed_ids(got)) == set(EOS_IDS)
    with pytest.raises(ValueError):
        backend.fill_bitmasks(matchers, np.zeros((len(matchers), compiler.bitmask_width - 1), dtype=np.int32))
    backend.fill_bitmasks([], np.zeros((0, compiler.bitmask_width), dtype=np.int32))


def test_bitmask_width_and_padding(backend, compiler, tokenizer):
    assert compiler.bitmask_width == -(-len(tokenizer) // 32)  # the model's padding ids have no bits
    start = np.zeros((1, compiler.bitmask_width), dtype=np.int32)
    backend.fill_bitmasks([compiler.new_matcher(StructuredOutputsParams(json_object=True))], start)
    allowed = allowed_ids(start[0])
    assert allowed.size and allowed.max() < len(tokenizer)
    assert all(tokenizer.decode([t]).startswith("{") for t in allowed)  # no leading whitespace either
    with pytest.raises(ValueError, match="smaller"):
        backend.GrammarCompiler(tokenizer, len(tokenizer) - 1, EOS_IDS)


LLGUIDANCE_REJECTS = [
    (StructuredOutputsParams(regex="a(b"), "unclosed group"),
    (StructuredOutputsParams(regex=r"(a)\1"), "backreferences are not supported"),
    (StructuredOutputsParams(json={"type": "object", "dependentSchemas": {"a": {}}}), "Unimplemented keys"),
    (StructuredOutputsParams(json={"type": "string", "format": "no-such-format"}), "Unknown format"),
    (StructuredOutputsParams(json={"type": "wrong"}), "Invalid type"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "unknown name"),
    (StructuredOutputsParams(grammar='root ::= "unterminated'), "Unexpected end of input"),
]
# The engine's own errors, then the keywords that xgrammar would accept and ignore
# (engine/structured/xgrammar_backend.py);
# `llguidance` marks those llguidance enforces, whose message says to switch.
XGRAMMAR_REJECTS = [
    (StructuredOutputsParams(regex="a(b"), "The parenthesis is not closed"),
    (StructuredOutputsParams(regex=r"(a)\1"), "Backreference is not supported"),
    (StructuredOutputsParams(json={"type": "wrong"}), 'Unsupported type "wrong"'),
    (StructuredOutputsParams(grammar="root ::= missing"), 'Rule "missing" is not defined'),
    (StructuredOutputsParams(grammar='root ::= "unterminated'), "in string literal"),
    (StructuredOutputsParams(json={"type": "object", "dependentSchemas": {"a": {}}}),
     "at #: `dependentSchemas` is not implemented by xgrammar"),
    (StructuredOutputsParams(json={"type": "string", "format": "no-such-format"}),
     "format 'no-such-format' is not implemented"),
    (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "`uniqueItems` is not implemented"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)y"}}}),
     "at #/properties/a: look-around in a `pattern`"),
    (StructuredOutputsParams(json={"allOf": [{"type": "integer"}, {"minimum": 5}]}), "`allOf` of one schema only"),
    (StructuredOutputsParams(json={"$defs": {"n": {"type": "integer"}}, "type": "array",
                                   "items": {"$ref": "#/$defs/n", "maximum": 9}}),
     "at #/items: xgrammar ignores `maximum` beside `$ref`"),
    (StructuredOutputsParams(json={"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]}),
     "ignores `type` beside `anyOf`"),
    (StructuredOutputsParams(json={"minimum": 3}), "ignores `minimum` in a schema without a `type`"),
    (StructuredOutputsParams(json={"type": "number", "multipleOf": 0.5}), "`multipleOf` only as an integer step"),
    (StructuredOutputsParams(json={"type": "object", "x-guidance": {"whitespace_flexible": True}}),
     "`x-guidance` is llguidance's option"),
]
_SWITCH = ("allOf", "beside", "without a", "multipleOf", "x-guidance")  # the XGRAMMAR_REJECTS llguidance enforces


def _check_rejected(compiler, params, engine_text) -> str:
    for call in (compiler.compile, compiler.new_matcher):
        with pytest.raises(GrammarError, match=re.escape(engine_text)) as info:
            call(params)
        assert f"the {params.kind} constraint" in str(info.value)
        assert isinstance(info.value, ValueError)
    return str(info.value)


@pytest.mark.parametrize("params, engine_text", LLGUIDANCE_REJECTS)
def test_rejected_constraints_raise_grammar_error_llguidance(params, engine_text, compiler_of):
    _check_rejected(compiler_of(grammar_module), params, engine_text)


@pytest.mark.parametrize("params, engine_text", XGRAMMAR_REJECTS)
def test_rejected_constraints_raise_grammar_error_xgrammar(params, engine_text, compiler_of):
    message = _check_rejected(compiler_of(importlib.import_module(BACKENDS["xgrammar"])), params, engine_text)
    assert "rejected by the grammar engine (xgrammar)" in message
    assert (USE_LLGUIDANCE in message) == any(word in engine_text for word in _SWITCH), message


@pytest.mark.parametrize("schema, violation", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ({"not": {"type": "string"}}, '"a"'),
    ({"type": "string", "pattern": "(?=a)b"}, '"b"'),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 9}, "10"),
    ({"type": "integer", "anyOf": [{"minimum": 5}]}, '"s"'),
    ({"minimum": 3}, "1"),
    ({"type": "number", "multipleOf": 0.5}, "0.3"),
])
def test_xgrammar_ignores_what_the_wrapper_rejects(schema, violation, compiler_of):
    """The reason for XGRAMMAR_REJECTS' keyword checks: xgrammar itself compiles each of these schemas and then
    lets a violating output through. When this fails, xgrammar enforces the keyword now: drop its check."""
    import xgrammar as xgr

    raw = compiler_of(importlib.import_module(BACKENDS["xgrammar"]))._xgr_compiler("json")  # xgrammar's, unchecked
    grammar = raw.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "),
                                      strict_mode=False)
    matcher = xgr.GrammarMatcher(grammar)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(violation), schema)
    assert matcher.accept_string(violation) and matcher.is_completed()


def test_compile_cache(compiler, monkeypatch):
    calls = []
    real = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda p: calls.append(p.key) or real(p))
    schema = {"type": "object", "properties": {"cached": {"type": "integer"}, "b": {"type": "string"}}}
    same = '{"type": "object", "properties": {"cached": {"type": "integer"}, "b": {"type": "string"}}}'
    first = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiler.compile(StructuredOutputsParams(json=same)) is first  # another form, the same key
    compiler.new_matcher(StructuredOutputsParams(json=schema))
    compiler.new_matcher(StructuredOutputsParams(json=same))
    bad = StructuredOutputsParams(regex="cache(")
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.new_matcher(bad)
    assert calls == [("json", first.key[1]), bad.key]


def test_matchers_of_one_grammar_are_independent(backend, compiler, tokenizer):
    params = StructuredOutputsParams(choice=["alpha", "beta"])
    one, two = compiler.new_matcher(params), compiler.new_matcher(params)
    assert one.accept_token(tokenizer.encode("alpha", add_special_tokens=False)[0])
    fresh = compiler.new_matcher(params)
    rows = np.zeros((2, compiler.bitmask_width), dtype=np.int32)
    backend.fill_bitmasks([two, fresh], rows)
    assert np.array_equal(rows[0], rows[1]) and not two.can_finish


def test_special_tokens_are_never_allowed(compiler, tokenizer):
    """Inside a JSON string any text may come, but not a special token (xgrammar on its own would allow
    `<|im_start|>` there, spelling its text); the EOS ids only where the string may end, which it may not."""
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} - set(EOS_IDS)
    assert special
    matcher = compiler.new_matcher(StructuredOutputsParams(json={"type": "string"}))
    (quote,) = tokenizer.encode('"', add_special_tokens=False)
    assert matcher.accept_token(quote)
    row = np.zeros(compiler.bitmask_width, dtype=np.int32)
    matcher.fill_bitmask(row)
    allowed = set(allowed_ids(row))
    assert len(allowed) > 40_000 and not allowed & (special | set(EOS_IDS))
    assert not any(matcher.accept_token(t) for t in special)


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 20}, {"type": "string", "minLength": 1},
                                    {"type": "string"}, {"type": "object"}])
def test_json_never_allows_a_raw_control_character(schema, compiler, tokenizer):
    """JSON strings escape control characters and our layout has no whitespace but spaces, so no token holding
    one may come (xgrammar on its own lets one into a string with a length bound)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    control = {i for i, text in enumerate(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))
               if any(ord(ch) < 0x20 for ch in text) and pieces[i]}
    assert len(control) > 100
    matcher = compiler.new_matcher(StructuredOutputsParams(json=schema))
    prefix = '"a' if schema["type"] == "string" else '{"a'
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        assert matcher.accept_token(token)
    row = np.zeros(compiler.bitmask_width, dtype=np.int32)
    matcher.fill_bitmask(row)
    allowed = set(allowed_ids(row))
    assert len(allowed) > 40_000 and not allowed & control
    assert not any(matcher.accept_token(t) for t in sorted(control)[:20])


def test_modules_import_neither_torch_nor_the_other_engine():
    # Load the modules with stand-in parent packages, so batchllm/__init__ (which imports torch) stays out.
    root = Path(grammar_module.__file__).resolve().parents[3]
    code = f"""
import importlib, sys, types
for name, path in [("batchllm", "batchllm"), ("batchllm.engine", "batchllm/engine")]:
    module = types.ModuleType(name); module.__path__ = [{str(root)!r} + "/" + path]; sys.modules[name] = module
structured = importlib.import_module("batchllm.engine.structured.manager")
manager = structured.StructuredOutputManager(None, 100, [0], backend="xgrammar")
assert not {{"torch", "xgrammar", "llguidance", "transformers"}} & set(sys.modules), sorted(sys.modules)
importlib.import_module("batchllm.engine.structured.llguidance_backend")
assert not {{"torch", "xgrammar", "transformers"}} & set(sys.modules), sorted(sys.modules)
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backend_names_are_checked():
    from batchllm.engine.structured.manager import GRAMMAR_BACKENDS, StructuredOutputManager

    assert set(GRAMMAR_BACKENDS) == set(BACKENDS) and GRAMMAR_BACKENDS == BACKENDS
    with pytest.raises(ValueError, match="backend must be one of 'xgrammar', 'llguidance', got 'outlines'"):
        StructuredOutputManager(None, 100, [0], backend="outlines")
