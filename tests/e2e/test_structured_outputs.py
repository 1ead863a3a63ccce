"""Structured outputs end to end, with both grammar engines: on the real default model, and where the point is
equality with HF transformers under each engine's own matcher, on a tiny random Llama of the default tokenizer
whose EOS logit is scaled up so that it ends some rows by choice (the masking, not the real weights, is compared).

Engines: xgrammar (`LLM`'s default) with synchronous and asynchronous scheduling, and llguidance
(`structured_outputs_backend="llguidance"`) with the CPU's default, synchronous scheduling. References that share
no code with batchllm's grammar wrappers: `jsonschema` (with a format checker) for the JSON rows, Python's `re`
for the regex rows and for hand-written equivalents of the grammars, HF transformers' `generate` with a logits
processor that runs its own matcher of the engine under test (llguidance or xgrammar, used directly), and the
engine's own unconstrained, unpreempted or single-row outputs.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from batchllm import LLM, SamplingParams
from batchllm.engine.structured.common import GrammarError
from batchllm.structured_outputs import StructuredOutputsParams
from tests.tiny_models import TINY_LLAMA, write_tiny_llama

MAX_TOKENS = 48
EOS = 2  # the default model's generation_config.json
# The JSON layout the engine documents (engine/structured/common.py): one line, as `json.dumps` writes it, in each
# engine's own terms. xgrammar's strict_mode=False: properties beyond the listed ones, unless
# additionalProperties forbids them, as llguidance (and JSON Schema) allow.
LLGUIDANCE_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
XGRAMMAR_LAYOUT = {"any_whitespace": False, "separators": (", ", ": "), "strict_mode": False}

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}
# name → (what the instruction asks for, schema). Several list their properties out of alphabetical order.
SCHEMAS = {
    "nested": ("a person's first and last name and their city", {
        "type": "object", "properties": {
            "person": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 12},
                                                        "last": {"type": "string", "maxLength": 12}},
                       "required": ["first", "last"], "additionalProperties": False},
            "city": {"type": "string", "maxLength": 16}},
        "required": ["person", "city"], "additionalProperties": False}),
    "array": ("two or three colors", {
        "type": "object", "properties": {
            "colors": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False}),
    "enum": ("a mood and its level", {
        "type": "object", "properties": {"mood": {"enum": ["happy", "sad", "angry"]},
                                         "level": {"type": "string", "enum": ["low", "high"]}},
        "required": ["mood", "level"], "additionalProperties": False}),
    "ranges": ("an adult's age and a score between 0 and 1", {
        "type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                                         "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        "required": ["age", "score"], "additionalProperties": False}),
    "pattern_date": ("a product code and a delivery date", {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                         "day": {"type": "string", "format": "date"}},
        "required": ["code", "day"], "additionalProperties": False}),
    "anyof": ("a value", {
        "type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 100},
                                                             {"type": "boolean"},
                                                             {"type": "string", "maxLength": 5}]}},
        "required": ["value"], "additionalProperties": False}),
    "ref": ("a line from a start point to an end point", {
        "$defs": {"point": POINT}, "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False}),
    "optional": ("a user with an id", {
        "type": "object", "properties": {"id": {"type": "integer"}, "nick": {"type": "string", "maxLength": 10},
                                         "email": {"type": "string", "maxLength": 20}},
        "required": ["id"], "additionalProperties": False}),
}
# Thinking first: "reasoning" comes before "answer" in the output only if the schema's order is kept.
ORDER_SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 60},
                                                 "answer": {"type": "integer"}},
                "required": ["reasoning", "answer"], "additionalProperties": False}
CHOICES = ["Paris", "London", "Berlin", "Rome"]
REGEX = r"(Yes|No)\. [A-Z][a-z]{1,12}( [a-z]{1,12}){0,4}\."
GBNF = '''
root ::= greeting ", " name "!"
greeting ::= "Hello" | "Hi" | "Good morning"
name ::= [A-Z] [a-z]{1,10}
'''
GREETING_REGEX = r"(Hello|Hi|Good morning), [A-Z][a-z]{1,10}!"  # the language of GBNF and of LARK
LARK = r'''
start: greeting ", " name "!"
greeting: "Hello" | "Hi" | "Good morning"
name: /[A-Z][a-z]{1,10}/
'''  # llguidance's dialect only: xgrammar rejects it (see INVALID)
# Rejected by both engines when compiled: a regex that does not parse, an unknown format, a look-ahead, a keyword
# neither implements, a Lark rule that does not exist (xgrammar: Lark at all). A keyword nobody knows is ignored
# (see the per-row test).
INVALID = {
    "regex": StructuredOutputsParams(regex="("),
    "format": StructuredOutputsParams(json={"type": "string", "format": "nosuch"}),
    "lookahead": StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^(?=x)x+$"}}, "required": ["a"]}),
    "unimplemented": StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"},
                                                   "uniqueItems": True}),
    "lark": StructuredOutputsParams(grammar="start: foo"),
}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _greedy(constraint: StructuredOutputsParams | None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)


def _json(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema)


# (scheduling, grammar engine) of the shared engines: the default backend in both modes, llguidance once.
CONFIGS = [(False, "xgrammar"), (True, "xgrammar"), (False, "llguidance")]


@pytest.fixture(scope="module", params=CONFIGS, ids=["sync-xgrammar", "async-xgrammar", "sync-llguidance"])
def config(request) -> tuple[bool, str]:
    return request.param


@pytest.fixture(scope="module")
def backend(config) -> str:
    return config[1]


@pytest.fixture(scope="module")
def llm(config):
    async_scheduling, backend = config
    if backend == "xgrammar":  # the default: built without naming it
        return LLM(async_scheduling=async_scheduling)
    return LLM(async_scheduling=async_scheduling, structured_outputs_backend=backend)


# ---------------------------------------------------------------------------------------------------------
# 1 + 2: one call with every kind of constraint and unconstrained rows beside them


def _suite_rows(backend: str) -> dict[str, tuple[list[dict], SamplingParams, str]]:
    """row name → (conversation, params, kind to check)."""
    rows = {}
    for name, (what, schema) in SCHEMAS.items():
        rows[f"greedy/{name}"] = (_user(f"Reply in JSON with {what}."), _greedy(_json(schema)), "json")
    for seed, name in ((11, "nested"), (12, "ref")):
        what, schema = SCHEMAS[name]
        rows[f"sampled/{name}"] = (_user(f"Reply in JSON with {what}."),
                                   SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS,
                                                  structured_outputs=_json(schema)), "json")
    rows["length"] = (_user("Reply in JSON with a person's first and last name and their city."),
                      _greedy(_json(SCHEMAS["nested"][1]), max_tokens=6), "json")
    rows["order"] = (_user("What is 7 times 6? Reply in JSON, explaining first."), _greedy(_json(ORDER_SCHEMA)),
                     "json")
    rows["choice"] = (_user("What is the capital of France?"),
                      _greedy(StructuredOutputsParams(choice=CHOICES)), "choice")
    rows["regex"] = (_user("Is the sea salty? Answer yes or no, then one short sentence."),
                     _greedy(StructuredOutputsParams(regex=REGEX)), "regex")
    rows["grammar"] = (_user("Greet a person named Anna."), _greedy(StructuredOutputsParams(grammar=GBNF)), "grammar")
    if backend == "llguidance":
        rows["lark"] = (_user("Greet a person named Tom."), _greedy(StructuredOutputsParams(grammar=LARK)), "grammar")
    rows["json_object"] = (_user("Describe a cat as a small JSON object with its name and age."),
                           _greedy(StructuredOutputsParams(json_object=True)), "json_object")
    # Unconstrained rows; the first has the same conversation as the choice row, so they share its prompt.
    rows["plain/capital"] = (_user("What is the capital of France?"), _greedy(None, 16), "plain")
    rows["plain/story"] = (_user("Tell me a very short story about a dog."), _greedy(None, 24), "plain")
    return rows


@pytest.fixture(scope="module")
def suite(llm, backend):
    rows = _suite_rows(backend)
    outputs = llm.chat([m for m, _, _ in rows.values()], [p for _, p, _ in rows.values()], use_tqdm=False)
    return {name: (row, out) for (name, row), out in zip(rows.items(), outputs)}


def _check_key_order(value, schema: dict, defs: dict) -> None:
    """Every object's keys come in the order its schema lists them (absent optional keys skipped)."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    if isinstance(value, dict) and "properties" in schema:
        properties = schema["properties"]
        assert list(value) == [k for k in properties if k in value], (value, list(properties))
        for key, item in value.items():
            _check_key_order(item, properties[key], defs)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _check_key_order(item, schema["items"], defs)


def _schema_of(params: SamplingParams) -> dict:
    return json.loads(params.structured_outputs.spec)


def test_every_kind_of_constraint_is_satisfied(suite):
    stopped = {"json": 0, "choice": 0, "regex": 0, "grammar": 0, "json_object": 0}
    for name, ((_, params, kind), out) in suite.items():
        if kind == "plain":
            continue
        completion = out.outputs[0]
        text, reason = completion.text, completion.finish_reason
        assert reason in ("stop", "length"), (name, reason, completion.error)
        if reason == "length":
            assert len(completion.token_ids) == params.max_tokens, name
            assert completion.error is not None and "incomplete" in completion.error, (name, completion.error)
            assert "length" in completion.error, completion.error
            continue
        assert completion.error is None, (name, completion.error)
        stopped[kind] += 1
        if kind == "json":
            value = json.loads(text)
            schema = _schema_of(params)
            jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
            _check_key_order(value, schema, schema.get("$defs", {}))
        elif kind == "json_object":
            assert isinstance(json.loads(text), dict), text
        elif kind == "choice":
            assert text in CHOICES, text
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "grammar":
            assert re.fullmatch(GREETING_REGEX, text), text
    assert all(stopped.values()), f"some kind never finished, so it was never validated: {stopped}"
    # Greedy output is deterministic: every greedy schema row is short enough to finish.
    for name in SCHEMAS:
        assert suite[f"greedy/{name}"][1].outputs[0].finish_reason == "stop", suite[f"greedy/{name}"][1].outputs[0]


def test_a_truncated_row_carries_the_incomplete_note(suite):
    completion = suite["length"][1].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 6
    assert completion.error and "incomplete" in completion.error and "(length)" in completion.error
    assert suite["length"][1].error == completion.error
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)
    assert completion.text.startswith('{"person": {'), completion.text  # the constraint held while it ran


def test_output_keys_follow_the_schema_order(suite):
    completion = suite["order"][1].outputs[0]
    assert completion.finish_reason == "stop", completion
    value = json.loads(completion.text)
    assert list(value) == ["reasoning", "answer"], value
    jsonschema.validate(value, ORDER_SCHEMA)
    nested = json.loads(suite["greedy/nested"][1].outputs[0].text)
    assert list(nested) == ["person", "city"], nested


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(llm, suite):
    names = [name for name, ((_, _, kind), _) in suite.items() if kind == "plain"]
    alone = llm.chat([suite[name][0][0] for name in names], [suite[name][0][1] for name in names], use_tqdm=False)
    for name, out in zip(names, alone):
        mixed = suite[name][1].outputs[0]
        assert mixed.token_ids == out.outputs[0].token_ids, name
        assert mixed.text == out.outputs[0].text
    # The unconstrained capital row is not the choice row's output: it wrote more than a bare city name.
    assert suite["plain/capital"][1].outputs[0].text not in CHOICES


# ---------------------------------------------------------------------------------------------------------
# 3 + 4: greedy constrained output equals HF transformers masked by the engine's own matcher, and preemption with
# a 16-token budget changes nothing; on a tiny model, HF's reference of the same checkpoint

HF_MAX_NEW = 32
HF_QUESTIONS = ["Name three fruits.", "Describe a person named Alice who is 30 years old."]
HF_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False}
HF_REGEX = r"[A-Z][A-Za-z ,.']*"  # open-ended: EOS competes with more text after every token


def _hf_rows(tokenizer) -> list[tuple[list[int], str, str]]:
    """(prompt ids, kind, spec): 2 prompts × (a JSON schema, a regex)."""
    rows = []
    for question in HF_QUESTIONS:
        text = tokenizer.apply_chat_template(_user(question), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows += [(ids, "json", json.dumps(HF_SCHEMA)), (ids, "regex", HF_REGEX)]
    return rows


def _params(kind: str, spec: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=spec) if kind == "json" else StructuredOutputsParams(regex=spec)


# The tiny model's EOS (untied) output row times this: EOS wins on some regex rows within a few tokens, as the
# real model's does, while the JSON rows still end by their grammar.
EOS_SCALE = 3.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    directory = write_tiny_llama(tmp_path_factory.mktemp("tiny-eos"), **{**TINY_LLAMA, "tie_word_embeddings": False})
    weights = load_file(directory / "model.safetensors")
    weights["lm_head.weight"][EOS] *= EOS_SCALE
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def tiny_llm(config, tiny_model):
    async_scheduling, backend = config
    return LLM(tiny_model, device="cpu", async_scheduling=async_scheduling, structured_outputs_backend=backend)


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def hf_rows(hf_tokenizer):
    return _hf_rows(hf_tokenizer)


def _unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    """A bitmask row (bit t % 32 of word t // 32) as one bool per token id."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little").astype(bool)[:vocab]


class _LLGuidanceRow:
    """llguidance's own matcher: the allowed tokens after the output so far, EOS only where it may end."""

    def __init__(self, engine: dict, kind: str, spec: str) -> None:
        import llguidance

        grammar = (llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=LLGUIDANCE_LAYOUT) if kind == "json"
                   else llguidance.LLMatcher.grammar_from_regex(spec))
        self.matcher = llguidance.LLMatcher(engine["tokenizer"], grammar)
        assert not self.matcher.is_error(), self.matcher.get_error()

    def consume(self, token: int) -> None:
        assert self.matcher.consume_token(token), self.matcher.get_error()

    def allowed(self, vocab: int) -> np.ndarray:
        allowed = np.zeros(vocab, dtype=bool)
        if not self.matcher.is_stopped():
            allowed[:] = _unpack(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32), vocab)
        allowed[EOS] = self.matcher.is_accepting() or self.matcher.is_stopped()
        return allowed


class _XGrammarRow:
    """xgrammar's own matcher, less the tokens the engine documents as refused: special tokens other than EOS
    (xgrammar would spell `<|im_start|>` inside a JSON string) and, for JSON, those holding a control character."""

    def __init__(self, engine: dict, kind: str, spec: str) -> None:
        import xgrammar

        compiler = engine["compiler"]
        grammar = (compiler.compile_json_schema(spec, **XGRAMMAR_LAYOUT) if kind == "json"
                   else compiler.compile_regex(spec))
        self.matcher = xgrammar.GrammarMatcher(grammar)
        self.bitmask = xgrammar.allocate_token_bitmask(1, engine["vocab"])
        self.refused = engine["special"] | (engine["control"] if kind == "json" else set())

    def consume(self, token: int) -> None:
        assert token not in self.refused and self.matcher.accept_token(token), token

    def allowed(self, vocab: int) -> np.ndarray:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        allowed = _unpack(self.bitmask[0].numpy(), vocab)
        allowed[list(self.refused)] = False
        allowed[EOS] = self.matcher.is_completed()
        return allowed


def _grammar_engine(backend: str, hf_tokenizer, vocab: int) -> dict:
    if backend == "llguidance":
        import llguidance.hf

        return {"row": _LLGuidanceRow, "tokenizer": llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab,
                                                                                  eos_token=EOS)}
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab, stop_token_ids=[EOS])
    special = {i for i, token in hf_tokenizer.added_tokens_decoder.items() if token.special} - {EOS}
    control = {i for i, text in enumerate(info.decoded_vocab) if text and min(text) < 0x20} - {EOS}
    return {"row": _XGrammarRow, "compiler": xgrammar.GrammarCompiler(info), "vocab": vocab, "special": special,
            "control": control}


@pytest.fixture(scope="module")
def hf_reference(tiny_model, hf_tokenizer, hf_rows):
    """backend → HF greedy generation of hf_rows, one prompt at a time, masked by that engine's own matcher;
    each computed once, when first asked for."""
    from transformers import AutoModelForCausalLM, LogitsProcessor

    class Guided(LogitsProcessor):
        def __init__(self, row, prompt_len: int, vocab: int) -> None:
            self.row, self.prompt_len, self.vocab = row, prompt_len, vocab
            self.consumed = 0
            self.ended_at = None  # output length where the grammar had ended: only EOS could follow

        def __call__(self, input_ids, scores):
            assert input_ids.shape[0] == 1 and scores.shape[-1] == self.vocab
            for token in input_ids[0, self.prompt_len + self.consumed:].tolist():
                self.row.consume(token)
                self.consumed += 1
            allowed = self.row.allowed(self.vocab)
            assert allowed.any()
            if self.ended_at is None and allowed.sum() == 1 and allowed[EOS]:
                self.ended_at = self.consumed
            return scores.masked_fill(~torch.from_numpy(allowed), float("-inf"))

    cache, model = {}, []

    def reference(backend: str) -> list[list[int]]:
        if backend in cache:
            return cache[backend]
        if not model:
            model.append(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval())
        vocab = model[0].config.vocab_size
        engine = _grammar_engine(backend, hf_tokenizer, vocab)
        outputs = []
        with torch.inference_mode():
            for ids, kind, spec in hf_rows:
                guided = Guided(engine["row"](engine, kind, spec), len(ids), vocab)
                prompt = torch.tensor([ids])
                out = model[0].generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=HF_MAX_NEW,
                                        do_sample=False, logits_processor=[guided], pad_token_id=EOS)
                generated = out[0, len(ids):].tolist()
                # batchllm keeps a sampled EOS in token_ids, but stops without one where the grammar has ended.
                if guided.ended_at is not None:
                    assert generated == generated[:guided.ended_at] + [EOS]
                    generated = generated[:guided.ended_at]
                outputs.append(generated)
        cache[backend] = outputs
        return outputs

    return reference


def _generate_rows(engine: LLM, rows) -> list[list[int]]:
    outs = engine.generate([ids for ids, _, _ in rows], [_greedy(_params(kind, spec), HF_MAX_NEW)
                                                         for _, kind, spec in rows], use_tqdm=False)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs), outs
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def constrained_greedy(tiny_llm, hf_rows):
    return _generate_rows(tiny_llm, hf_rows)


def test_constrained_greedy_equals_hf_with_the_engines_own_matcher(constrained_greedy, hf_reference, backend):
    assert constrained_greedy == hf_reference(backend)
    # Both endings are covered: a grammar that ended (JSON, no EOS) and an EOS chosen where the regex could go on.
    assert any(ids and ids[-1] == EOS for ids in constrained_greedy), constrained_greedy
    assert any(len(ids) < HF_MAX_NEW and ids[-1] != EOS for ids in constrained_greedy), constrained_greedy


@pytest.fixture(scope="module")
def preempted_greedy(tiny_model, hf_rows):
    """backend → (outputs, stats, output length of each preempted request when it was preempted) of hf_rows on
    an engine built once per backend, with asynchronous scheduling (a token in flight when its request is
    preempted): 6 blocks of 16 tokens, room for one request and a half, and a 16-token budget. Caching off, so
    the shared chat prompt does not relieve the pool. The lengths are recorded, not changed: a preemption
    after some output is what puts the matcher at stake."""
    from batchllm.engine.scheduler import Scheduler

    cache = {}

    def run(backend: str):
        if backend not in cache:
            preempted_at = []
            preempt = Scheduler._preempt

            def recording_preempt(self, request):
                preempted_at.append(request.num_output_tokens)
                preempt(self, request)

            engine = LLM(tiny_model, device="cpu", num_kv_blocks=6, max_num_batched_tokens=16,
                         enable_prefix_caching=False, async_scheduling=True, structured_outputs_backend=backend,
                         admission_policy="optimistic")
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(Scheduler, "_preempt", recording_preempt)
                outputs = _generate_rows(engine, hf_rows)
            cache[backend] = outputs, engine.stats, preempted_at
        return cache[backend]

    return run


def test_preemption_and_chunking_do_not_change_constrained_output(constrained_greedy, preempted_greedy, backend):
    outputs, stats, preempted_at = preempted_greedy(backend)
    assert outputs == constrained_greedy
    assert stats.num_preemptions == len(preempted_at) >= 1, stats
    assert max(preempted_at) >= 2, f"no request was preempted after writing output: {preempted_at}"
    assert stats.num_chunked_prefills >= 1 and stats.max_step_tokens <= 16, stats


# ---------------------------------------------------------------------------------------------------------
# 5: constraints the grammar engine rejects


@pytest.mark.parametrize("name", list(INVALID))
def test_a_call_wide_invalid_constraint_fails_before_generation(llm, backend, name, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a request reached the engine")

    monkeypatch.setattr(llm.engine, "add_request", must_not_run)
    monkeypatch.setattr(llm.engine, "step", must_not_run)
    with pytest.raises(GrammarError) as error:
        llm.chat(_user("Say something."), _greedy(INVALID[name], 8), use_tqdm=False)
    assert isinstance(error.value, ValueError)
    assert f"constraint is rejected by the grammar engine ({backend})" in str(error.value), error.value
    with pytest.raises(GrammarError):
        llm.generate(["Say something."], _greedy(INVALID[name], 8), use_tqdm=False)


def test_a_per_row_invalid_constraint_fails_that_row_alone(llm):
    messages = _user("What is the capital of France?")
    unknown_keyword = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False, "owner": "tests"}
    good = {"choice": _greedy(StructuredOutputsParams(choice=CHOICES), 8),
            "unknown_keyword": _greedy(_json(unknown_keyword), 24),
            "plain": _greedy(None, 8)}
    bad = {name: _greedy(params, 8) for name, params in INVALID.items()}
    names = ["choice", "regex", "unknown_keyword", "format", "lookahead", "plain", "unimplemented", "lark"]
    params = [{**good, **bad}[name] for name in names]
    outs = dict(zip(names, llm.chat([messages] * len(names), params, use_tqdm=False)))
    for name in bad:
        completion = outs[name].outputs[0]
        assert completion.finish_reason == "error" and completion.token_ids == [], (name, completion)
        with pytest.raises(GrammarError) as expected:
            llm.check_structured_outputs(INVALID[name])
        assert completion.error == str(expected.value) == outs[name].error, name
    assert outs["choice"].outputs[0].finish_reason == "stop" and outs["choice"].outputs[0].text in CHOICES
    city = outs["unknown_keyword"].outputs[0]
    assert city.finish_reason == "stop", city
    jsonschema.validate(json.loads(city.text), unknown_keyword)
    assert outs["plain"].outputs[0].error is None and len(outs["plain"].outputs[0].token_ids) == 8
    assert llm.stats.num_errors == len(bad), llm.stats


# ---------------------------------------------------------------------------------------------------------
# 6: prefix caching and n > 1 with constraints

SMALL_SCHEMA = {"type": "object", "properties": {"animal": {"type": "string", "maxLength": 12},
                                                 "legs": {"type": "integer", "minimum": 0, "maximum": 100}},
                "required": ["animal", "legs"], "additionalProperties": False}


# Engine behaviour that does not depend on the grammar engine: run with the default backend only.
xgrammar_only = pytest.mark.parametrize("config", CONFIGS[:2], ids=["sync-xgrammar", "async-xgrammar"], indirect=True)


@xgrammar_only
def test_identical_constrained_prompts_share_the_prefix_cache(llm):
    # A prompt no other test uses, so the first row misses and the second hits the blocks it computes.
    messages = _user("Pick an animal from a farm in the countryside and tell me how many legs it has, in JSON.")
    outs = llm.chat([messages, messages], _greedy(_json(SMALL_SCHEMA), 32), use_tqdm=False)
    first, second = (o.outputs[0] for o in outs)
    assert first.token_ids == second.token_ids and first.finish_reason == "stop", (first, second)
    jsonschema.validate(json.loads(first.text), SMALL_SCHEMA)
    prompt_len = len(outs[0].prompt_token_ids)
    assert llm.stats.prefix_cache_hits >= 16 * ((prompt_len - 1) // 16) > 0, llm.stats


@xgrammar_only
def test_seeded_samples_of_one_constrained_prompt_all_validate(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=32, structured_outputs=_json(SMALL_SCHEMA))
    out = llm.chat(_user("Name an animal and its number of legs, in JSON."), params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), SMALL_SCHEMA)
    again = llm.chat(_user("Name an animal and its number of legs, in JSON."), params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]  # seeded
