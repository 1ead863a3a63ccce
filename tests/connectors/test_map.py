"""`batchllm.generate` on the real default model: every input kind round-trips with greedy text equal to
`LLM.generate` on the same prompts, and bad rows get errors without disturbing the good ones."""

from __future__ import annotations

import datasets
import pandas as pd
import pyarrow as pa
import pytest

import batchllm
from batchllm import SamplingParams
from batchllm.connectors.engine_cache import get_llm
from tests.connectors.helpers import GREEDY, reference_texts

PROMPTS = ["The capital of France is", "Two plus two equals", "The color of the sky is"]
OUTPUTS = ["generated_text", "finish_reason", "prompt_tokens", "completion_tokens", "error"]


@pytest.fixture(scope="module")
def expected(llm):
    return reference_texts(llm, PROMPTS)


def test_dataframe_keeps_index_order_and_input(llm, expected):
    frame = pd.DataFrame({"q": PROMPTS, "n": [1, 2, 3]}, index=pd.Index(["c", "a", "c"], name="key"))
    out = frame.pipe(batchllm.generate, prompt_column="q", use_tqdm=False, **GREEDY)
    assert out.index.equals(frame.index) and list(out.columns) == ["q", "n", *OUTPUTS]
    assert list(frame.columns) == ["q", "n"]  # the caller's frame is untouched
    assert out.generated_text.tolist() == expected
    assert out.prompt_tokens.tolist() == [len(llm.tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert out.completion_tokens.dtype == "Int32" and out.error.isna().all()
    assert set(out.finish_reason) <= {"stop", "length"}
    assert get_llm() is llm  # built once per process, reused by every call


def test_arrow_table_and_record_batch(llm, expected):
    table = pa.table({"q": PROMPTS, "n": [1, 2, 3]}).replace_schema_metadata({"source": "test"})
    out = batchllm.generate(table, prompt_column="q", use_tqdm=False, **GREEDY)
    assert isinstance(out, pa.Table) and out.column_names == ["q", "n", *OUTPUTS]
    assert out.schema.metadata == {b"source": b"test"}
    assert out.schema.field("prompt_tokens").type == pa.int32()
    assert out.column("generated_text").to_pylist() == expected

    batch = pa.record_batch({"q": PROMPTS})
    out = batchllm.generate(batch, prompt_column="q", llm=llm, use_tqdm=False, **GREEDY)
    assert isinstance(out, pa.RecordBatch) and out.column("generated_text").to_pylist() == expected


def test_hf_dataset_honours_its_indices_mapping(expected):
    dataset = datasets.Dataset.from_dict({"q": PROMPTS, "i": [0, 1, 2]}).select([2, 0, 1]).with_format("numpy")
    out = batchllm.generate(dataset, prompt_column="q", use_tqdm=False, **GREEDY)
    assert isinstance(out, datasets.Dataset) and out.format["type"] == "numpy"
    assert out.column_names == ["q", "i", *OUTPUTS]
    rows = out.with_format(None)
    assert rows["i"] == [2, 0, 1]
    assert rows["generated_text"] == [expected[2], expected[0], expected[1]]


def test_list_of_strings_and_list_of_dicts(expected):
    out = batchllm.generate(PROMPTS, use_tqdm=False, **GREEDY)
    assert [row["prompt"] for row in out] == PROMPTS
    assert [row["generated_text"] for row in out] == expected

    rows = [{"id": i, "subject": p.split(" is")[0]} for i, p in enumerate(PROMPTS)]
    rows[1] = {"id": 1}  # this row lacks the column the template names
    out = batchllm.generate(rows, prompt_template="{subject} is", output_column="answer", use_tqdm=False, **GREEDY)
    assert [row["id"] for row in out] == [0, 1, 2] and rows[1] == {"id": 1}
    assert set(out[0]) == {"id", "subject", "answer", "answer_finish_reason", "answer_prompt_tokens",
                           "answer_completion_tokens", "answer_error"}
    assert [out[0]["answer"], out[2]["answer"]] == [expected[0], expected[2]]
    assert out[1]["answer"] is None and "column 'subject' is null" in out[1]["answer_error"]


def test_bad_rows_get_errors_and_good_rows_are_unchanged(llm, expected):
    over_long = "word " * (llm.max_model_len + 10)
    prompts = [PROMPTS[0], None, float("nan"), PROMPTS[1], 42, "", over_long, PROMPTS[2]]
    out = batchllm.generate(pd.DataFrame({"q": prompts}), prompt_column="q", use_tqdm=False, **GREEDY)
    assert out.generated_text[[0, 3, 7]].tolist() == expected
    assert out.error[[0, 3, 7]].isna().all()
    errors = out.error.tolist()
    assert "is null" in errors[1] and "is null" in errors[2]
    assert "must be a string, got int" in errors[4] and "is empty" in errors[5]
    assert "over the budget" in errors[6] and "truncate='left'" in errors[6]
    bad = out.iloc[[1, 2, 4, 5, 6]]
    assert bad.generated_text.isna().all() and (bad.finish_reason == "error").all()
    assert bad.completion_tokens.isna().all()
    assert bad.prompt_tokens.iloc[-1] > llm.max_model_len  # the over-long prompt was counted


def test_bad_messages_among_good_ones(llm):
    hello = [{"role": "user", "content": "Say hello."}]
    thanks = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say thanks."}]
    reference = [o.outputs[0].text for o in llm.chat([hello, thanks], SamplingParams(**GREEDY), use_tqdm=False)]
    cells = [hello, "not a list", [{"role": "user"}], [], thanks, [{"content": "no role"}]]
    out = batchllm.generate(pd.DataFrame({"m": cells}), messages_column="m", use_tqdm=False, **GREEDY)
    assert out.generated_text[[0, 4]].tolist() == reference
    assert out.error[[0, 4]].isna().all()
    assert [e.split(":")[0] for e in out.error[[1, 2, 3, 5]]] == [
        "messages must be a list of {role, content} objects, got str", "message 0 has no content",
        "messages are empty", "message 0 has no role"]


def test_n_and_logprobs_give_list_columns(llm, expected):
    out = batchllm.generate(pa.table({"q": PROMPTS[:2]}), prompt_column="q", n=2, logprobs=2, use_tqdm=False,
                            **GREEDY)
    schema = out.schema
    assert schema.field("generated_text").type == pa.list_(pa.string())
    assert schema.field("completion_tokens").type == pa.list_(pa.int32())
    assert pa.types.is_list(schema.field("logprobs").type.value_type)
    texts = out.column("generated_text").to_pylist()
    assert texts == [[expected[0]] * 2, [expected[1]] * 2]  # greedy: both samples agree
    reference = llm.generate(PROMPTS[0], SamplingParams(logprobs=2, **GREEDY), use_tqdm=False)[0].outputs[0]
    steps = out.column("logprobs").to_pylist()[0][0]
    assert [s["token_id"] for s in steps] == reference.token_ids
    for step, token_id, alternatives in zip(steps, reference.token_ids, reference.logprobs):
        assert step["logprob"] == pytest.approx(alternatives[token_id].logprob, abs=1e-4)  # batch shapes differ
        assert len(step["top_logprobs"]) == 2 and step["top_logprobs"][0]["token_id"] == token_id  # greedy: rank 1


def test_a_table_is_tokenized_in_chunks_while_the_engine_runs(llm, expected, monkeypatch):
    """Chunks of two rows, each but the first tokenized only once the engine has stepped: admission pauses
    for them, and every row still comes back once, in place, with the facade's text or its own error."""
    import threading

    from batchllm.connectors import prompts as prompts_module
    from batchllm.entrypoints import tokenize_ahead

    monkeypatch.setattr(tokenize_ahead, "FIRST_CHUNK_ROWS", 2)
    monkeypatch.setattr(tokenize_ahead, "MAX_CHUNK_ROWS", 2)
    stepped, calls = threading.Event(), []
    step, encode = llm.engine.step, prompts_module.PromptEncoder.encode

    def step_and_tell():
        finished = step()
        stepped.set()
        return finished

    def late_encode(self, prompts, max_tokens):
        calls.append(len(prompts))
        if len(calls) > 1:
            assert stepped.wait(timeout=60), "the engine never stepped while a chunk was pending"
        return encode(self, prompts, max_tokens)

    monkeypatch.setattr(llm.engine, "step", step_and_tell)
    monkeypatch.setattr(prompts_module.PromptEncoder, "encode", late_encode)
    over_long = "word " * (llm.max_model_len + 10)
    prompts = [PROMPTS[2], None, over_long, PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    out = batchllm.generate(pd.DataFrame({"q": prompts}), prompt_column="q", llm=llm, use_tqdm=False, **GREEDY)
    assert calls == [2, 2, 1]  # five rendered rows in text order, in three chunks
    assert out.generated_text[[0, 3, 4, 5]].tolist() == [expected[2], expected[0], expected[1], expected[0]]
    assert out.error[[0, 3, 4, 5]].isna().all()
    assert "is null" in out.error[1] and "over the budget" in out.error[2]
    assert out.prompt_tokens[2] > llm.max_model_len and not llm.engine.has_unfinished()


def test_a_tokenizer_that_transformers_mutates_per_call_is_not_shared_with_a_worker(llm, expected, monkeypatch):
    """With truncation set on the Rust tokenizer, a call clears it (a write): the rows are tokenized at once, on
    the caller's thread, so no worker writes while the engine detokenizes."""
    from batchllm.connectors import prompts as prompts_module
    from batchllm.entrypoints import tokenize_ahead

    monkeypatch.setattr(tokenize_ahead, "FIRST_CHUNK_ROWS", 1)  # streamed, the rows would go one by one
    monkeypatch.setattr(tokenize_ahead, "MAX_CHUNK_ROWS", 1)
    calls = []
    encode = prompts_module.PromptEncoder.encode

    def counted_encode(self, prompts, max_tokens):
        calls.append(len(prompts))
        return encode(self, prompts, max_tokens)

    monkeypatch.setattr(prompts_module.PromptEncoder, "encode", counted_encode)
    backend = llm.tokenizer.backend_tokenizer
    backend.enable_truncation(max_length=llm.max_model_len)
    try:
        out = batchllm.generate(PROMPTS, llm=llm, use_tqdm=False, **GREEDY)
    finally:
        backend.no_truncation()
    assert calls == [3] and [row["generated_text"] for row in out] == expected
