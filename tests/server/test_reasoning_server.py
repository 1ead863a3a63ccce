"""`reasoning_content` in the server's chat answers and SSE deltas (as OpenAI-compatible clients read it), with the
qwen3 parser over SmolLM2's greedy continuation of a few-shot prompt that ends inside an open `<think>` (the chat
template renders the message's text alone). Reference: the facade's raw tokens, split in the test by a regex."""

from __future__ import annotations

import json
import re

import pytest

from batchllm import LLM, SamplingParams
from batchllm.entrypoints.server.app import build_app
from batchllm.entrypoints.server.engine_loop import EngineLoop
from tests.server.conftest import openai_client, serving

THINKING = "Q: 1+1\n<think>one plus one</think> 2\nQ: 2+3\n<think>two plus three</think> 5\nQ: 4+4\n<think>"
MESSAGES = [{"role": "user", "content": THINKING}]
FIELDS = {"max_tokens": 12, "temperature": 0, "stop": ["\nQ"]}


@pytest.fixture(scope="module")
def served():
    llm = LLM(num_kv_blocks=96, max_num_seqs=8, reasoning_parser="qwen3", device="cpu")
    llm.tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    [reference] = llm.chat(MESSAGES, SamplingParams(**FIELDS), use_tqdm=False)
    raw = llm.tokenizer.decode(reference.outputs[0].token_ids, skip_special_tokens=True)
    raw = raw[:raw.rfind(reference.outputs[0].stop_reason)]
    match = re.fullmatch(r"(.*?)</think>(.*)", raw, re.DOTALL)
    assert match is not None and match.group(2).strip(), raw  # the model closed its section and answered
    loop = EngineLoop(llm)
    with serving(build_app(loop)) as base_url:
        yield {"client": openai_client(base_url), "model": llm.model_path.name, "split": match.groups()}
    loop.shutdown(5)


def test_chat_message_has_reasoning_content(served):
    response = served["client"].chat.completions.create(model=served["model"], messages=MESSAGES, **FIELDS)
    message = response.choices[0].message
    assert (message.reasoning_content, message.content) == served["split"]
    assert response.choices[0].finish_reason == "stop"


def test_streamed_deltas_carry_reasoning_then_answer(served):
    chunks = served["client"].chat.completions.create(model=served["model"], messages=MESSAGES, stream=True,
                                                      **FIELDS)
    kinds, reasoning, answer = [], "", ""
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            part_reasoning = getattr(delta, "reasoning_content", None) or ""
            reasoning, answer = reasoning + part_reasoning, answer + (delta.content or "")
            assert "think>" not in part_reasoning + (delta.content or "")
            kinds += ["reasoning"] * bool(part_reasoning) + ["answer"] * bool(delta.content)
    assert (reasoning, answer) == served["split"]
    assert kinds.index("answer") > 1 and "reasoning" not in kinds[kinds.index("answer"):]  # streamed, in order


def test_cut_off_reasoning_streams_as_reasoning(served):
    whole = served["client"].chat.completions.create(model=served["model"], messages=MESSAGES, max_tokens=2,
                                                     temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.content == "" and whole.choices[0].message.reasoning_content
    chunks = served["client"].chat.completions.create(model=served["model"], messages=MESSAGES, max_tokens=2,
                                                      temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        whole.choices[0].message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == ""


def test_response_format_constrains_the_answer(served):
    response = served["client"].chat.completions.create(model=served["model"], messages=MESSAGES, max_tokens=24,
                                                        temperature=0, response_format={"type": "json_object"})
    message = response.choices[0].message
    assert message.reasoning_content == served["split"][0]  # the reasoning ran unconstrained
    assert isinstance(json.loads(message.content), dict), message.content


def test_completions_carry_reasoning_content(served):
    """/v1/completions on the raw prompt: the same split, whole and streamed (`reasoning_content` per choice)."""
    client, model = served["client"], served["model"]
    whole = client.completions.create(model=model, prompt=THINKING, **FIELDS).choices[0]
    assert (whole.reasoning_content, whole.text) == served["split"]
    reasoning = answer = ""
    for chunk in client.completions.create(model=model, prompt=THINKING, stream=True, **FIELDS):
        for choice in chunk.choices:
            reasoning += getattr(choice, "reasoning_content", None) or ""
            answer += choice.text
    assert (reasoning, answer) == served["split"]
