"""Reasoning outputs through the LLM facade, the table doors and the jobs, with the default model and the qwen3
parser. SmolLM2 does not think, so the prompts are few-shot think-tag patterns ending inside an open `<think>` that
it continues greedily ("four plus four</think> 10"). The reference is the raw decoded tokens, split in the test with
a regular expression: the prompt opened the section, so reasoning runs to the first `</think>` and the answer is
what follows; a prompt that opens nothing gives no reasoning and the whole text as answer."""

from __future__ import annotations

import json
import re

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm import LLM, SamplingParams
from batchllm.structured_outputs import StructuredOutputsParams

THINKING = "Q: 1+1\n<think>one plus one</think> 2\nQ: 2+3\n<think>two plus three</think> 5\nQ: 4+4\n<think>"
PLAIN = "The capital of France is"
FIELDS = {"max_tokens": 12, "temperature": 0, "stop": ["\nQ"]}
# Renders a conversation as its messages' text alone, so a chat prompt ends inside the open `<think>` as well.
RAW_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def llm():
    llm = LLM(num_kv_blocks=96, max_num_seqs=8, reasoning_parser="qwen3", device="cpu")
    llm.tokenizer.chat_template = RAW_TEMPLATE
    return llm


def expected_split(llm, output, prompt_opens_reasoning: bool) -> tuple[str | None, str]:
    raw = llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)
    if output.finish_reason == "stop" and isinstance(output.stop_reason, str):
        raw = raw[:raw.rfind(output.stop_reason)]
    if not prompt_opens_reasoning:
        return None, raw
    match = re.fullmatch(r"(.*?)</think>(.*)", raw, re.DOTALL)
    return (raw, "") if match is None else (match.group(1), match.group(2))


def test_llm_outputs_split_reasoning_and_answer(llm):
    thinking, plain = llm.generate([THINKING, PLAIN], SamplingParams(**FIELDS), use_tqdm=False)
    completion = thinking.outputs[0]
    assert completion.reasoning and "</think>" not in completion.reasoning + completion.text
    assert (completion.reasoning, completion.text) == expected_split(llm, completion, True)
    assert completion.text.strip()  # the model answered after closing the section
    assert (plain.outputs[0].reasoning, plain.outputs[0].text) == expected_split(llm, plain.outputs[0], False)
    assert plain.outputs[0].reasoning is None


def test_reasoning_cut_off_by_max_tokens(llm):
    [output] = llm.generate([THINKING], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "length"
    assert completion.text == ""
    assert completion.reasoning == llm.tokenizer.decode(completion.token_ids) != ""


def test_pandas_door_adds_a_reasoning_column(llm):
    frame = pd.DataFrame({"q": [THINKING, PLAIN]})
    result = batchllm.generate(frame, prompt_column="q", llm=llm, use_tqdm=False, **FIELDS)
    reference = llm.generate([THINKING, PLAIN], SamplingParams(**FIELDS), use_tqdm=False)
    assert list(result.columns) == ["q", "generated_text", "finish_reason", "prompt_tokens", "completion_tokens",
                                    "error", "reasoning"]
    assert result["generated_text"].tolist() == [r.outputs[0].text for r in reference]
    assert result["reasoning"].iloc[0] == reference[0].outputs[0].reasoning
    assert pd.isna(result["reasoning"].iloc[1])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_structured_outputs_constrain_the_answer_only(llm, backend):
    """The reasoning is the unconstrained one (a grammar from the first token would have forced "yes" / "no"
    there); the answer after `</think>` is the grammar's."""
    [free] = llm.generate([THINKING], SamplingParams(**FIELDS), use_tqdm=False)
    constrained = LLM(num_kv_blocks=32, max_num_seqs=2, reasoning_parser="qwen3", device="cpu",
                      structured_outputs_backend=backend)
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    [output] = constrained.generate([THINKING], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.reasoning == free.outputs[0].reasoning
    assert completion.text in ("yes", "no") and completion.error is None
    # A prompt that closed the section (Qwen3's enable_thinking=False) is constrained from the first token.
    [closed] = constrained.generate([PLAIN + "<think>\n\n</think>\n\n"], params, use_tqdm=False)
    assert closed.outputs[0].reasoning is None and closed.outputs[0].text in ("yes", "no")
    frame = batchllm.generate(pd.DataFrame({"q": [THINKING], "s": ['{"type": "integer"}']}), prompt_column="q",
                              schema_column="s", llm=constrained, use_tqdm=False, max_tokens=12, temperature=0)
    assert frame["reasoning"].iloc[0] == free.outputs[0].reasoning
    assert frame["generated_text"].iloc[0].isdigit(), frame["generated_text"].iloc[0]


def test_parquet_job_output_has_the_reasoning_column(llm, tmp_path):
    pq.write_table(pa.table({"q": [THINKING, PLAIN]}), tmp_path / "in.parquet")
    batchllm.run_job(tmp_path / "in.parquet", tmp_path / "out", prompt_column="q", llm=llm, use_tqdm=False, **FIELDS)
    table = pq.read_table(tmp_path / "out").to_pandas()
    reference = llm.generate([THINKING, PLAIN], SamplingParams(**FIELDS), use_tqdm=False)
    assert table["generated_text"].tolist() == [r.outputs[0].text for r in reference]
    assert table["reasoning"].iloc[0] == reference[0].outputs[0].reasoning
    assert pd.isna(table["reasoning"].iloc[1])


def test_openai_batch_job_has_reasoning_content(llm, tmp_path):
    body = {"max_tokens": 12, "temperature": 0, "stop": ["\nQ"]}
    lines = [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": THINKING}], **body}},
             {"custom_id": "plain", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": PLAIN}], **body}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm=llm, use_tqdm=False)
    answers = {a["custom_id"]: a["response"]["body"]["choices"][0]["message"]
               for a in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    reference = llm.chat([[{"role": "user", "content": THINKING}], [{"role": "user", "content": PLAIN}]],
                         SamplingParams(**FIELDS), use_tqdm=False)
    thinking = reference[0].outputs[0]
    assert answers["chat"] == {"role": "assistant", "content": thinking.text, "reasoning_content": thinking.reasoning}
    assert thinking.reasoning
    assert answers["plain"] == {"role": "assistant", "content": reference[1].outputs[0].text}


def test_ray_predictor_numpy_batches_keep_the_reasoning_column(llm):
    np = pytest.importorskip("numpy")
    pytest.importorskip("ray")
    from batchllm.connectors.engine_cache import clear_engine_cache
    from batchllm.ray import LLMPredictor

    predictor = LLMPredictor(prompt_column="q", engine_kwargs={"reasoning_parser": "qwen3", "num_kv_blocks": 96,
                                                               "device": "cpu"}, **FIELDS)
    try:
        out = predictor({"q": np.array([THINKING, PLAIN])})
    finally:
        clear_engine_cache()
    reference = llm.generate([THINKING, PLAIN], SamplingParams(**FIELDS), use_tqdm=False)
    assert out["generated_text"].tolist() == [r.outputs[0].text for r in reference]
    assert out["reasoning"][0] == reference[0].outputs[0].reasoning and out["reasoning"][1] is None
