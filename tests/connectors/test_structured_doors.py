"""Structured outputs through every door: `generate(structured_outputs= / schema_column= / parse_json=)`,
OpenAI batch `response_format`, the CLI flags and the job manifests.

Most tests run on `FakeEngine`: the default model's real tokenizer and the real grammar compiler (so
constraint checks give llguidance's own verdicts and messages), with canned completions instead of a model,
recording the sampling parameters each row reached the engine with. The `slow` ones at the end run the
real default model and check its outputs against the schemas with `jsonschema`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm import SamplingParams, StructuredOutputsParams
from batchllm.connectors.cells import RowError
from batchllm.connectors.constraints import SchemaColumn, parsed_json_text, response_format_constraint
from batchllm.connectors.jobs.manifest import ManifestMismatch
from batchllm.connectors.jobs.openai_batch import sampling_params as body_params
from batchllm.connectors.options import params_dict, resolve_options
from batchllm.engine.structured.llguidance_backend import GrammarCompiler, GrammarError
from batchllm.engine.structured.manager import INCOMPLETE
from batchllm.entrypoints.cli.main import main
from batchllm.outputs import CompletionOutput, RequestOutput
from tests.connectors.jobs import read_shards

REVIEW = {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "verdict": {"type": "string", "enum": ["good", "bad"]}},
          "required": ["stars", "verdict"], "additionalProperties": False}
COLOR = {"type": "string", "enum": ["red", "blue"]}
UNCOMPILABLE = {"type": "string", "pattern": "(?=a)b"}  # look-ahead: no grammar engine here implements it
LENGTH = "<cut>"  # a prompt containing it gets a completion cut short by max_tokens, as the engine reports one


@dataclass
class Reply:
    text: str
    finish_reason: str = "stop"
    error: str | None = None


def canned(params: SamplingParams, prompt: str) -> Reply:
    """What the fake engine answers: a fixed text for each kind of constraint (valid for REVIEW / COLOR)."""
    constraint = params.structured_outputs
    if LENGTH in prompt:
        return Reply('{"stars": 4, "ver', "length", INCOMPLETE.format(reason="length"))
    if constraint is None:
        return Reply("plain text")
    if constraint.kind == "json_object":
        return Reply('{"ok": true}')
    if constraint.kind == "json":
        schema = json.loads(constraint.spec)
        return Reply('"red"' if schema.get("type") == "string" else '{"stars": 4, "verdict": "good"}')
    if constraint.kind == "choice":
        return Reply(json.loads(constraint.spec)[0])
    return Reply("42")


class FakeEngine:
    """What the connectors use of an `LLM`, without a model. A row whose constraint does not compile is
    rejected the way the engine rejects it (finish_reason "error" and the grammar engine's message)."""

    def __init__(self, tokenizer, model_path: Path, compiler: GrammarCompiler) -> None:
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.max_model_len = 2048
        self.max_num_seqs = 8
        self.compiler = compiler
        self.checked: list[StructuredOutputsParams] = []
        self.rows: list[SamplingParams] = []  # the params of each row that reached the engine, in order

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        self.checked.append(params)
        self.compiler.compile(params)

    def admission_order(self, token_lists, loras=None):
        return list(range(len(token_lists)))

    def has_unfinished(self):
        return False  # `stream` answers each row as it takes it

    def stream(self, requests, *, max_in_flight=None, stop=None):
        for item in requests:
            if stop is not None and stop():
                return
            if item is None:
                continue
            key, token_ids, params, *_ = item  # a fourth element: the row's adapter (None here)
            self.rows.append(params)
            prompt = self.tokenizer.decode(token_ids)
            reply, error = canned(params, prompt), None
            if params.structured_outputs is not None:
                try:
                    self.compiler.compile(params.structured_outputs)
                except GrammarError as exc:
                    reply, error = Reply("", "error", str(exc)), str(exc)
            ids = self.tokenizer(reply.text, add_special_tokens=False)["input_ids"]
            completions = [CompletionOutput(i, reply.text, ids, finish_reason=reply.finish_reason,
                                            error=reply.error or error) for i in range(params.n)]
            yield key, RequestOutput(str(key), None, list(token_ids), completions,
                                     error=next((c.error for c in completions if c.error), None))


@pytest.fixture(scope="module")
def parts():
    from batchllm.model.config import ModelConfig, read_hf_config
    from batchllm.model.loader import resolve_model_path
    from batchllm.tokenizer import load_tokenizer, resolve_eos_token_ids

    path = resolve_model_path(None)
    tokenizer = load_tokenizer(path)
    vocab_size = ModelConfig.from_hf_dict(read_hf_config(path)).vocab_size
    return tokenizer, path, GrammarCompiler(tokenizer, vocab_size, resolve_eos_token_ids(path, tokenizer))


@pytest.fixture
def fake(parts, monkeypatch):
    engine = FakeEngine(*parts)
    monkeypatch.setattr("batchllm.connectors.replicas.data_parallel.get_llm", lambda *args: engine)
    return engine


def _generate(data, **options):
    return batchllm.generate(data, use_tqdm=False, temperature=0, max_tokens=16, **options)


# -- options: what is wrong for the whole call fails before the engine is asked for ---------------------------


@pytest.fixture
def no_engine(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the engine was requested although the call is invalid")

    monkeypatch.setattr("batchllm.connectors.replicas.data_parallel.get_llm", fail)


@pytest.mark.parametrize("options, message", [
    ({"schema_column": "schema", "structured_outputs": StructuredOutputsParams(regex="a+")},
     re.escape("schema_column='schema' (a JSON schema per row) and a call-wide structured_outputs= (regex) exclude "
               "each other")),
    ({"parse_json": True}, "parse_json=True needs a JSON constraint.*got no constraint"),
    ({"parse_json": True, "structured_outputs": StructuredOutputsParams(choice=["a", "b"])},
     "parse_json=True needs a JSON constraint.*got a choice constraint"),
    ({"schema_column": "nope"}, r"unknown column 'nope' \(schema_column=\)"),
    ({"schema_column": ""}, "schema_column must be a non-empty string"),
    ({"parse_json": "yes", "schema_column": "schema"}, "parse_json must be True or False"),
])
def test_call_errors(no_engine, options, message):
    frame = pd.DataFrame({"q": ["a"], "schema": [None]})
    with pytest.raises(ValueError, match=message):
        _generate(frame, prompt_column="q", **options)


def test_the_parsed_column_is_prefixed_and_may_not_overwrite_an_input_column(no_engine):
    frame = pd.DataFrame({"q": ["a"], "parsed": [1], "answer_parsed": [2]})
    with pytest.raises(ValueError, match="already has column 'parsed'"):
        _generate(frame, prompt_column="q", structured_outputs=StructuredOutputsParams(json_object=True),
                  parse_json=True)
    with pytest.raises(ValueError, match="already has column 'answer_parsed'"):
        _generate(frame, prompt_column="q", structured_outputs=StructuredOutputsParams(json_object=True),
                  parse_json=True, output_column="answer")
    # Without parse_json there is no `parsed` column, so nothing clashes.
    options = resolve_options(prompt_column="q", output_column="answer",
                              sampling_fields={"structured_outputs": StructuredOutputsParams(json=COLOR)})
    assert options.check_input_columns(["q", "parsed", "answer_parsed"]) == ["q"]


def test_identity_has_the_constraint_only_when_set():
    assert "structured_outputs" not in params_dict(SamplingParams())
    constraint = StructuredOutputsParams(json=REVIEW)
    assert params_dict(SamplingParams(structured_outputs=constraint))["structured_outputs"] == {
        "kind": "json", "spec": json.dumps(REVIEW, separators=(",", ":"))}
    plain = resolve_options(prompt_column="q").describe()
    assert "schema_column" not in plain and "parse_json" not in plain
    with_column = resolve_options(prompt_column="q", schema_column="s", parse_json=True).describe()
    assert (with_column["schema_column"], with_column["parse_json"]) == ("s", True)


# -- schema column values ---------------------------------------------------------------------------------------


def test_schema_values_and_one_params_per_distinct_schema():
    base = SamplingParams(max_tokens=7, temperature=0)
    column = SchemaColumn("schema", base)
    from_dict = column.params(REVIEW)
    # The same schema as text, however laid out: one SamplingParams. (Key order is part of a schema: it orders
    # the generated fields.)
    assert column.params(json.dumps(REVIEW)) is from_dict and column.params(json.dumps(REVIEW, indent=2)) is from_dict
    reordered = column.params(json.dumps(dict(reversed(list(REVIEW.items())))))
    assert reordered is not from_dict and reordered.structured_outputs != from_dict.structured_outputs
    assert from_dict.structured_outputs == StructuredOutputsParams(json=REVIEW)
    assert (from_dict.max_tokens, from_dict.temperature) == (7, 0) and base.structured_outputs is None
    for missing in (None, float("nan"), pd.NA, np.nan):
        assert column.params(missing) is base
    # A Parquet / Arrow list cell read through pandas arrives as a numpy array inside the dict.
    assert column.params({**COLOR, "enum": np.array(["red", "blue"])}).structured_outputs == \
        StructuredOutputsParams(json=COLOR)
    assert column.params(StructuredOutputsParams(regex="[0-9]+")).structured_outputs.kind == "regex"


@pytest.mark.parametrize("value, message", [
    ("{nope", "schema column 'schema' holds text that is not valid JSON (Expecting property name"),
    ("", "holds text that is not valid JSON"),
    ("[1, 2]", "schema column 'schema' holds JSON list text; a JSON schema is an object"),
    ('"x"', "holds JSON str text"),
    (42, "schema column 'schema' must hold a JSON schema (an object or its JSON text) or null, got int"),
    ([{"type": "string"}], "got list"),
])
def test_malformed_schema_values(value, message):
    with pytest.raises(RowError) as error:
        SchemaColumn("schema", SamplingParams()).params(value)
    assert message in str(error.value)


def test_each_row_reaches_the_engine_with_its_own_schema(fake):
    schemas = [REVIEW, json.dumps(COLOR), None, "{nope", 7, json.dumps(REVIEW), UNCOMPILABLE]
    frame = pd.DataFrame({"q": [f"question {i}" for i in range(7)], "schema": schemas}, index=list("abcdefg"))
    out = _generate(frame, prompt_column="q", schema_column="schema")
    assert fake.checked == []  # nothing call-wide to check
    assert [p.structured_outputs for p in fake.rows] == [StructuredOutputsParams(json=REVIEW),
                                                         StructuredOutputsParams(json=COLOR), None,
                                                         StructuredOutputsParams(json=REVIEW),
                                                         StructuredOutputsParams(json=UNCOMPILABLE)]
    assert fake.rows[0] is fake.rows[3]  # one SamplingParams per distinct schema, whatever form it came in
    assert all(p.max_tokens == 16 and p.temperature == 0 for p in fake.rows)
    assert out.generated_text.tolist()[:3] == ['{"stars": 4, "verdict": "good"}', '"red"', "plain text"]
    errors = out.error.tolist()
    assert errors[3] == ("row 3: schema column 'schema' holds text that is not valid JSON (Expecting property name "
                         "enclosed in double quotes: line 1 column 2 (char 1))")
    assert errors[4].startswith("row 4: schema column 'schema' must hold a JSON schema")
    assert "the json constraint is rejected by the grammar engine (llguidance)" in errors[6]
    assert "look-around" in errors[6]  # llguidance's own words
    assert out.finish_reason.tolist()[3:5] == ["error", "error"] and out.finish_reason.iloc[6] == "error"
    assert out.generated_text.isna().tolist() == [False, False, False, True, True, False, True]


def test_a_call_wide_constraint_is_compiled_before_generation(fake):
    bad = StructuredOutputsParams(regex="(?<=a)b")
    with pytest.raises(GrammarError, match="(?s)regex constraint is rejected by the grammar engine.*look-around"):
        _generate(["a", "b"], structured_outputs=bad)
    assert fake.checked == [bad] and fake.rows == []  # nothing generated

    good = StructuredOutputsParams(choice=["yes", "no"])
    out = batchllm.generate(["a", "b"], sampling_params=SamplingParams(max_tokens=3, structured_outputs=good),
                            use_tqdm=False)
    assert fake.checked == [bad, good]
    assert [p.structured_outputs for p in fake.rows] == [good, good] and fake.rows[0].max_tokens == 3
    assert [row["generated_text"] for row in out] == ["yes", "yes"]


# -- parse_json ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, finish_reason, error, expected", [
    ('{"b": 1, "a": [1.5, "é", null]}', "stop", None, '{"b":1,"a":[1.5,"é",null]}'),  # keys keep their order
    ('  "red"\n', "stop", None, '"red"'),
    ('{"b": 1', "length", INCOMPLETE.format(reason="length"), None),
    ('{"b": 1}', "length", None, None),  # cut short, even if it happens to parse
    ('{"b": 1}', "stop", "a note", None),
    ("{nope", "stop", None, None),
    ("NaN", "stop", None, None),
    ('{"x": Infinity}', "stop", None, None),
    (None, "error", "failed", None),
    ("[" * 100_000 + "]" * 100_000, "stop", None, None),  # deeper than Python's stack: not parsed, no crash
])
def test_parsed_json_text(text, finish_reason, error, expected):
    assert parsed_json_text(text, finish_reason, error) == expected


def test_parse_json_pandas_gives_objects_arrow_gives_canonical_text(fake):
    frame = pd.DataFrame({"q": ["one", f"two {LENGTH}", "three", "four"],
                          "schema": [REVIEW, REVIEW, None, COLOR]})
    out = _generate(frame, prompt_column="q", schema_column="schema", parse_json=True)
    assert out.parsed.dtype == object
    assert out.parsed.tolist() == [{"stars": 4, "verdict": "good"}, None, None, "red"]
    assert [json.loads(t) if p is not None else None for t, p in zip(out.generated_text, out.parsed)] == \
        out.parsed.tolist()
    # The row cut short keeps its text and finish_reason, with the engine's note as its error.
    assert (out.generated_text[1], out.finish_reason[1]) == ('{"stars": 4, "ver', "length")
    assert out.error[1] == INCOMPLETE.format(reason="length") and pd.isna(out.error[0])
    jsonschema.validate(out.parsed[0], REVIEW)

    table = pa.Table.from_pandas(frame.assign(schema=[json.dumps(s) if s else None for s in frame.schema]))
    arrow = _generate(table, prompt_column="q", schema_column="schema", parse_json=True, output_column="answer")
    assert arrow.schema.field("answer_parsed").type == pa.string()
    assert arrow.column("answer_parsed").to_pylist() == ['{"stars":4,"verdict":"good"}', None, None, '"red"']

    rows = _generate([{"q": "x"}], prompt_column="q", structured_outputs=StructuredOutputsParams(json_object=True),
                     parse_json=True)
    assert rows[0]["parsed"] == {"ok": True}


def test_parse_json_with_n_samples_gives_a_list_per_row(fake):
    frame = pd.DataFrame({"q": ["one", "two"], "schema": [COLOR, "[]"]})
    out = _generate(frame, prompt_column="q", schema_column="schema", parse_json=True, n=2)
    assert out.parsed.tolist() == [["red", "red"], None]
    arrow = _generate(pa.Table.from_pandas(frame.assign(schema=[json.dumps(COLOR), None])), prompt_column="q",
                      schema_column="schema", parse_json=True, n=2)
    assert arrow.schema.field("parsed").type == pa.list_(pa.string())
    assert arrow.column("parsed").to_pylist() == [['"red"', '"red"'], None]  # the unconstrained row: null


def test_ray_numpy_batches_carry_parsed_json_as_text(fake, monkeypatch):
    ray_module = pytest.importorskip("batchllm.ray")
    monkeypatch.setattr(ray_module, "get_llm", lambda *args: fake)
    predictor = ray_module.LLMPredictor(prompt_column="q", schema_column="schema", parse_json=True, max_tokens=8)
    out = predictor({"q": np.array(["one", "two"]), "schema": np.array([json.dumps(REVIEW), None], dtype=object)})
    assert out["parsed"].tolist() == ['{"stars":4,"verdict":"good"}', None]


# -- OpenAI batch response_format -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ({"type": "json_schema", "json_schema": {"name": "review", "schema": REVIEW, "strict": True}},
     StructuredOutputsParams(json=REVIEW)),
    ({"type": "json_schema", "json_schema": {"schema": COLOR, "strict": False, "description": "a color"}},
     StructuredOutputsParams(json=COLOR)),
    ({"type": "json_object"}, StructuredOutputsParams(json_object=True)),
    ({"type": "text"}, None),
])
def test_response_format(value, expected):
    assert response_format_constraint(value) == expected


@pytest.mark.parametrize("value, message", [
    ("json_object", "response_format must be an object with a type, got str"),
    ({"type": "regex"}, "response_format type 'regex' is not supported; the types are text, json_object and "
                        "json_schema"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object holding the schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}},
     "response_format.json_schema.schema must be a JSON schema object, got none"),
    ({"type": "json_schema", "json_schema": {"schema": "{}"}}, "schema must be a JSON schema object, got str"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "guided": 1}},
     "response_format.json_schema has unsupported field guided"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be a boolean"),
    ({"type": "json_object", "json_schema": {"schema": {}}}, "response_format has unsupported field json_schema"),
    ({"type": "text", "extra": 1}, "response_format has unsupported field extra"),
])
def test_bad_response_formats(value, message):
    with pytest.raises(RowError) as error:
        response_format_constraint(value)
    assert message in str(error.value)


def test_a_line_without_response_format_takes_the_jobs_default():
    default = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    body = {"messages": []}
    assert body_params(body, default, True).structured_outputs == default.structured_outputs
    assert body_params({**body, "response_format": None}, default, True).structured_outputs == \
        default.structured_outputs
    assert body_params({**body, "response_format": {"type": "text"}}, default, True).structured_outputs is None
    own = body_params({**body, "response_format": {"type": "json_object"}}, default, True)
    assert own.structured_outputs == StructuredOutputsParams(json_object=True)
    with pytest.raises(RowError, match="unsupported parameter: guided_json"):
        body_params({**body, "guided_json": REVIEW}, default, True)


def _chat(custom_id, content, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": content}], **body}})


def _answers(path: Path) -> dict[str, dict]:
    return {a["custom_id"]: a for a in map(json.loads, path.read_text().splitlines())}


def test_jsonl_response_formats_reach_the_engine(fake, tmp_path):
    schema_format = {"type": "json_schema", "json_schema": {"name": "review", "schema": REVIEW, "strict": True}}
    lines = [_chat("schema", "Rate it.", response_format=schema_format),
             _chat("object", "Any object.", response_format={"type": "json_object"}),
             _chat("text", "Free text.", response_format={"type": "text"}),
             _chat("default", "No format."),
             _chat("bad", "Bad.", response_format={"type": "grammar"}),
             _chat("cut", f"Too long {LENGTH}", response_format=schema_format),
             _chat("uncompilable", "x", response_format={"type": "json_schema", "json_schema": {
                 "schema": UNCOMPILABLE}})]
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    default = StructuredOutputsParams(choice=["maybe", "never"])
    result = batchllm.run_job(requests, results, use_tqdm=False, max_tokens=8, structured_outputs=default)
    assert fake.checked == [default]  # the job's default, compiled before anything ran
    assert [p.structured_outputs for p in fake.rows] == [
        StructuredOutputsParams(json=REVIEW), StructuredOutputsParams(json_object=True), None, default,
        StructuredOutputsParams(json=REVIEW), StructuredOutputsParams(json=UNCOMPILABLE)]
    answers = _answers(results)
    content = {key: answers[key]["response"]["body"]["choices"][0]["message"]["content"]
               for key in ("schema", "object", "text", "default", "cut")}
    assert content == {"schema": '{"stars": 4, "verdict": "good"}', "object": '{"ok": true}', "text": "plain text",
                       "default": "maybe", "cut": '{"stars": 4, "ver'}
    jsonschema.validate(json.loads(content["schema"]), REVIEW)
    # Cut short: answered as OpenAI does, the partial content with finish_reason "length"; not an error line.
    assert answers["cut"]["error"] is None
    assert answers["cut"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert answers["bad"]["response"] is None and answers["bad"]["error"] == {
        "code": "invalid_request", "message": "line 5: response_format type 'grammar' is not supported; the types "
                                              "are text, json_object and json_schema"}
    assert answers["uncompilable"]["error"]["code"] == "invalid_request"  # refused before any token
    assert "rejected by the grammar engine (llguidance)" in answers["uncompilable"]["error"]["message"]
    assert result.error_rows == 3  # the job's summary counts the note on "cut"; the output has two error lines
    header, *records = map(json.loads, Path(str(results) + ".manifest.jsonl").read_text().splitlines())
    assert header["fingerprint"]["defaults"]["structured_outputs"] == default.describe()
    assert sum(r["error_rows"] for r in records) == 2  # error lines: a retry_errors run re-answers exactly those

    with pytest.raises(ManifestMismatch, match="defaults.structured_outputs"):
        batchllm.run_job(requests, results, use_tqdm=False, max_tokens=8)


def test_jsonl_default_constraint_that_does_not_compile_fails_the_job_before_generation(fake, tmp_path):
    (tmp_path / "requests.jsonl").write_text(_chat("a", "x") + "\n")
    with pytest.raises(GrammarError, match="look-around"):
        batchllm.run_job(tmp_path / "requests.jsonl", tmp_path / "out.jsonl", use_tqdm=False,
                         structured_outputs=StructuredOutputsParams(regex="(?!x)y"))
    assert fake.rows == [] and not (tmp_path / "out.jsonl").exists()
    with pytest.raises(ValueError, match="schema_column= does not apply to an OpenAI batch file"):
        batchllm.run_job(tmp_path / "requests.jsonl", tmp_path / "out.jsonl", schema_column="s")


# -- Parquet jobs and their manifests -------------------------------------------------------------------------


def _table_input(tmp_path: Path) -> Path:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"q": ["one", "two", "three", f"four {LENGTH}"],
                             "schema": [json.dumps(REVIEW), None, "{nope", json.dumps(REVIEW)]}), path)
    return path


def test_parquet_job_with_a_schema_column_and_parse_json(fake, tmp_path):
    source, output = _table_input(tmp_path), tmp_path / "out"
    result = batchllm.run_job(source, output, prompt_column="q", schema_column="schema", parse_json=True,
                              rows_per_shard=3, use_tqdm=False, max_tokens=8)
    table = read_shards(output).sort_by([("q", "ascending")]).to_pylist()
    by_q = {row["q"]: row for row in table}
    assert by_q["one"]["parsed"] == '{"stars":4,"verdict":"good"}' and by_q["two"]["parsed"] is None
    assert by_q["two"]["generated_text"] == "plain text"
    assert by_q["three"]["error"].startswith("schema column 'schema' holds text that is not valid JSON")
    assert by_q[f"four {LENGTH}"]["finish_reason"] == "length" and by_q[f"four {LENGTH}"]["parsed"] is None
    assert result.error_rows == 2  # the malformed schema, and the note on the row cut short
    assert [p.structured_outputs for p in fake.rows] == [StructuredOutputsParams(json=REVIEW), None,
                                                         StructuredOutputsParams(json=REVIEW)]
    assert pq.read_schema(output / "part-00000.parquet").field("parsed").type == pa.string()
    header = json.loads((output / "_manifest.jsonl").read_text().splitlines()[0])["fingerprint"]["options"]
    assert (header["schema_column"], header["parse_json"]) == ("schema", True)
    assert "structured_outputs" not in header["sampling_params"]

    again = batchllm.run_job(source, output, prompt_column="q", schema_column="schema", parse_json=True,
                             rows_per_shard=3, use_tqdm=False, max_tokens=8)
    assert again.resumed_rows == 4 and again.written_rows == 0
    with pytest.raises(ManifestMismatch, match="options.schema_column: was \"schema\", now null"):
        batchllm.run_job(source, output, prompt_column="q", rows_per_shard=3, use_tqdm=False, max_tokens=8)


def test_parquet_job_resumed_with_another_constraint_is_refused(fake, tmp_path):
    source, output = _table_input(tmp_path), tmp_path / "out"
    options = {"prompt_column": "q", "rows_per_shard": 2, "use_tqdm": False, "max_tokens": 8}
    batchllm.run_job(source, output, structured_outputs=StructuredOutputsParams(json=COLOR), **options)
    assert {p.structured_outputs for p in fake.rows} == {StructuredOutputsParams(json=COLOR)}
    assert batchllm.run_job(source, output, structured_outputs=StructuredOutputsParams(json=COLOR),
                            **options).resumed_rows == 4
    with pytest.raises(ManifestMismatch, match="options.sampling_params.structured_outputs.spec"):
        batchllm.run_job(source, output, structured_outputs=StructuredOutputsParams(json=REVIEW), **options)
    with pytest.raises(ManifestMismatch, match="options.sampling_params.structured_outputs: was"):
        batchllm.run_job(source, output, **options)

    plain = tmp_path / "plain"
    batchllm.run_job(source, plain, **options)  # a job without a constraint: its manifest has no such key
    assert "structured_outputs" not in (plain / "_manifest.jsonl").read_text()


# -- the CLI ----------------------------------------------------------------------------------------------------


def _cli(tmp_path: Path, *flags: str) -> int:
    return main(["run", str(_table_input(tmp_path)), str(tmp_path / "out"), "--prompt-column", "q",
                 "--max-tokens", "8", "--no-progress", *flags])


@pytest.mark.parametrize("flags, message", [
    (["--json-schema", "missing.json"], "argument --json-schema: cannot read the JSON schema file 'missing.json'"),
    (["--json-schema", "{not-json}"], "argument --json-schema:"),
    (["--choice", "a,,b"], "argument --choice: expected comma-separated non-empty strings"),
    (["--choice", '["a", 3]'], "argument --choice: a JSON array of choices must hold non-empty strings"),
    (["--choice", '["a",'], "argument --choice: '[\"a\",' starts like a JSON array but is not valid JSON"),
    (["--regex", ""], "argument --regex: regex must be a non-empty string"),
    (["--regex", "a", "--choice", "a,b"], "argument --choice: not allowed with argument --regex"),
    (["--schema-column", "schema", "--regex", "a"], "not allowed with argument --schema-column"),
])
def test_cli_constraint_flags_are_checked_by_the_parser(tmp_path, capsys, no_engine, flags, message):
    with pytest.raises(SystemExit) as exit:
        _cli(tmp_path, *flags)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_cli_json_schema_file_that_is_not_a_schema(tmp_path, capsys, no_engine):
    (tmp_path / "bad.json").write_text("{oops")
    (tmp_path / "list.json").write_text("[1]")
    for name, message in (("bad.json", "is not valid JSON: Expecting property name"),
                          ("list.json", "holds a JSON list; a JSON schema is an object")):
        with pytest.raises(SystemExit) as exit:
            _cli(tmp_path, "--json-schema", str(tmp_path / name))
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert "argument --json-schema:" in err and message in err


def test_cli_errors_that_need_the_options_exit_2(tmp_path, capsys, no_engine):
    assert _cli(tmp_path, "--parse-json", "--regex", "a+") == 2
    assert "--parse-json needs a JSON constraint: --json-schema FILE or --schema-column NAME" in \
        capsys.readouterr().err
    (tmp_path / "requests.jsonl").write_text(_chat("a", "x") + "\n")
    assert main(["run", str(tmp_path / "requests.jsonl"), str(tmp_path / "out.jsonl"), "--schema-column", "s"]) == 2
    assert "--schema-column / --parse-json do not apply to an OpenAI batch file" in capsys.readouterr().err


def test_cli_constraints_reach_the_job(fake, tmp_path, capsys):
    schema_file = tmp_path / "review.json"
    schema_file.write_text(json.dumps(REVIEW))
    assert _cli(tmp_path, "--json-schema", str(schema_file), "--parse-json") == 0
    assert fake.checked == [StructuredOutputsParams(json=REVIEW)]
    out = read_shards(tmp_path / "out")
    assert out.column("parsed").to_pylist()[0] == '{"stars":4,"verdict":"good"}'
    header = json.loads((tmp_path / "out" / "_manifest.jsonl").read_text().splitlines()[0])
    assert header["fingerprint"]["options"]["sampling_params"]["structured_outputs"]["kind"] == "json"

    fake.rows.clear()
    assert main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "choice"), "--prompt-column", "q",
                 "--choice", "yes,no,maybe", "--no-progress"]) == 0
    assert {p.structured_outputs for p in fake.rows} == {StructuredOutputsParams(choice=["yes", "no", "maybe"])}
    fake.rows.clear()
    assert main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "commas"), "--prompt-column", "q",
                 "--choice", '["Paris, France", "Rome"]', "--no-progress"]) == 0
    assert {p.structured_outputs for p in fake.rows} == {StructuredOutputsParams(choice=["Paris, France", "Rome"])}
    assert main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "column"), "--prompt-column", "q",
                 "--schema-column", "schema", "--parse-json", "--no-progress"]) == 0
    assert read_shards(tmp_path / "column").column("parsed").to_pylist()[0] == '{"stars":4,"verdict":"good"}'

    assert main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "regex"), "--prompt-column", "q",
                 "--regex", "(?<=x)y", "--no-progress"]) == 2  # compiled before anything runs
    err = capsys.readouterr().err
    assert "error: structured outputs: the regex constraint is rejected by the grammar engine" in err
    assert "look-around" in err


def test_cli_constraint_is_the_default_of_an_openai_batch_file(fake, tmp_path):
    schema_file = tmp_path / "color.json"
    schema_file.write_text(json.dumps(COLOR))
    (tmp_path / "requests.jsonl").write_text("\n".join([_chat("plain", "x"), _chat(
        "own", "y", response_format={"type": "json_object"})]) + "\n")
    assert main(["run", str(tmp_path / "requests.jsonl"), str(tmp_path / "out.jsonl"), "--json-schema",
                 str(schema_file), "--no-progress"]) == 0
    assert [p.structured_outputs for p in fake.rows] == [StructuredOutputsParams(json=COLOR),
                                                         StructuredOutputsParams(json_object=True)]
    answers = _answers(tmp_path / "out.jsonl")
    assert answers["plain"]["response"]["body"]["choices"][0]["message"]["content"] == '"red"'


def test_a_pydantic_model_is_a_call_wide_schema(fake):
    pydantic = pytest.importorskip("pydantic")

    class Review(pydantic.BaseModel):
        verdict: str
        stars: int

    out = _generate(pd.DataFrame({"review": ["Great."]}), prompt_column="review", chat=False,
                    structured_outputs=StructuredOutputsParams(json=Review), parse_json=True)
    assert fake.checked == [StructuredOutputsParams(json=Review.model_json_schema())]
    assert list(json.loads(fake.checked[0].spec)["properties"]) == ["verdict", "stars"]  # the model's field order
    assert out.parsed.tolist() == [{"stars": 4, "verdict": "good"}]


# -- the real model ---------------------------------------------------------------------------------------------
# Whichever grammar engine the LLM is built with: the messages are checked only as far as every backend's agree.

E2E_REVIEW = {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                               "verdict": {"type": "string", "enum": ["good", "bad"]}},
              "required": ["stars", "verdict"], "additionalProperties": False}


@pytest.mark.slow
def test_real_model_schema_column_outputs_validate(llm):
    frame = pd.DataFrame({"review": ["The soup was cold and bland.", "Best pizza in town!", "Meh."],
                          "schema": [json.dumps(E2E_REVIEW), {"type": "string", "enum": ["yes", "no"]},
                                     UNCOMPILABLE]})
    out = batchllm.generate(frame, prompt_column="review", chat=True, schema_column="schema", parse_json=True,
                            max_tokens=40, temperature=0, use_tqdm=False)
    assert out.finish_reason.tolist() == ["stop", "stop", "error"]
    assert out.parsed[0] == json.loads(out.generated_text[0]) and out.parsed[1] == json.loads(out.generated_text[1])
    jsonschema.validate(out.parsed[0], E2E_REVIEW)
    assert out.parsed[1] in ("yes", "no")
    assert "json constraint is rejected by the grammar engine" in out.error[2] and out.parsed[2] is None
    assert out.error[:2].isna().all()


@pytest.mark.slow
def test_real_model_jsonl_response_formats_validate(llm, tmp_path):
    lines = [_chat("schema", "Review: great food.", max_tokens=40, temperature=0, response_format={
                 "type": "json_schema", "json_schema": {"name": "review", "schema": E2E_REVIEW, "strict": True}}),
             _chat("object", 'Return a JSON object with one key, "n", holding a small number.', max_tokens=24,
                   temperature=0, response_format={"type": "json_object"}),
             _chat("cut", "Review: awful.", max_tokens=3, temperature=0, response_format={
                 "type": "json_schema", "json_schema": {"name": "review", "schema": E2E_REVIEW}})]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    batchllm.run_job(tmp_path / "requests.jsonl", tmp_path / "out.jsonl", use_tqdm=False)
    answers = _answers(tmp_path / "out.jsonl")
    choice = {key: answers[key]["response"]["body"]["choices"][0] for key in answers}
    jsonschema.validate(json.loads(choice["schema"]["message"]["content"]), E2E_REVIEW)
    assert isinstance(json.loads(choice["object"]["message"]["content"]), dict)
    assert [choice[key]["finish_reason"] for key in ("schema", "object", "cut")] == ["stop", "stop", "length"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["cut"]["message"]["content"])


@pytest.mark.slow
def test_real_model_cli_choice_and_call_wide_error(llm, tmp_path, capsys):
    path = tmp_path / "in.csv"
    pd.DataFrame({"q": ["Is the sky blue? Answer yes or no.", "Is fire cold? Answer yes or no."]}).to_csv(path,
                                                                                                          index=False)
    assert main(["run", str(path), str(tmp_path / "out"), "--prompt-column", "q", "--chat", "--choice", "yes,no",
                 "--max-tokens", "4", "--no-progress"]) == 0
    out = read_shards(tmp_path / "out")
    assert set(out.column("generated_text").to_pylist()) <= {"yes", "no"}
    assert out.column("finish_reason").to_pylist() == ["stop", "stop"]
    with pytest.raises(ValueError, match="json constraint is rejected"):
        batchllm.generate(["x"], structured_outputs=StructuredOutputsParams(json=UNCOMPILABLE), use_tqdm=False)


@pytest.mark.slow
def test_data_parallel_pool_compiles_call_wide_constraints_on_a_replica():
    from batchllm.connectors.options import resolve_options
    from batchllm.connectors.replicas.pool import ReplicaPool
    from batchllm.connectors.tables.mapper import map_columns

    with ReplicaPool(2) as pool:
        with pytest.raises(ValueError, match="json constraint is rejected by the grammar engine"):
            pool.check_structured_outputs(StructuredOutputsParams(json=UNCOMPILABLE))
        pool.check_structured_outputs(StructuredOutputsParams(json=E2E_REVIEW))
        options = resolve_options(prompt_column="q", schema_column="schema", parse_json=True,
                                  sampling_fields={"max_tokens": 8, "temperature": 0})
        columns = {"q": ["Yes or no?", "Anything."], "schema": [{"type": "string", "enum": ["yes", "no"]},
                                                                json.dumps(UNCOMPILABLE)]}
        text, finish, _, _, error, parsed = (a.to_pylist() for a in map_columns(columns, 2, options, pool, False))
        assert finish == ["stop", "error"] and json.loads(parsed[0]) in ("yes", "no") and parsed[1] is None
        assert error[0] is None and "json constraint is rejected by the grammar engine" in error[1]
        assert pool.failures == []
