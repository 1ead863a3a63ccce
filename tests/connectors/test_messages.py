"""Chat messages: the allowed roles, tool calls, content parts, and cells as pandas / numpy / pyarrow hold them."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm import SamplingParams
from batchllm.connectors.cells import RowError
from batchllm.connectors.prompts import PromptEncoder
from batchllm.model.loader import resolve_model_path
from batchllm.tokenizer import load_tokenizer
from tests.connectors.helpers import GREEDY

# A minimal tool-aware template in the style of HF's (Qwen 2.5, Llama 3.1): arguments rendered with tojson.
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response>"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    tool_aware = copy.deepcopy(tokenizer)
    tool_aware.chat_template = TOOL_TEMPLATE
    return tool_aware


def _render(tokenizer, messages) -> str:
    return PromptEncoder(tokenizer, 512, "error").render_chat(messages).text


def _reference(tokenizer, conversation) -> str:
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("role", ["developer", "function", "robot", "User"])
def test_unknown_roles_are_refused(tokenizer, role):
    with pytest.raises(RowError, match=f"message 1 has role '{role}'; the roles are system, user, assistant, tool"):
        _render(tokenizer, [{"role": "user", "content": "Hi"}, {"role": role, "content": "x"}])


def test_every_known_role_reaches_the_template(tokenizer):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = _render(tokenizer, conversation)
    assert text == _reference(tokenizer, conversation)
    assert text.count("<|im_start|>") == 5  # four turns and the generation prompt: none dropped


def test_tool_turns_fail_the_row_when_the_template_has_no_tool_support(tokenizer):
    assert "tool_calls" not in tokenizer.chat_template  # SmolLM2's template: role + content only
    with pytest.raises(RowError, match="message 1 has tool_calls, which this model's chat template does not render"):
        _render(tokenizer, TOOL_TURNS)
    with pytest.raises(RowError, match="message 1 has the role 'tool'"):
        _render(tokenizer, [TOOL_TURNS[0], {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])


def test_tool_turns_reach_a_tool_aware_template_as_hf_expects(tool_tokenizer):
    text = _render(tool_tokenizer, TOOL_TURNS)
    expected_call = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    expected = [TOOL_TURNS[0], {"role": "assistant", "content": None, "tool_calls": [expected_call]}, TOOL_TURNS[2]]
    assert text == _reference(tool_tokenizer, expected)
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in text  # arguments as an object, not a string
    assert "<tool_response id=call_1>18 C</tool_response>" in text


@pytest.mark.parametrize("message, error", [
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "tool_calls must be a list, on an assistant message"),
    ({"role": "assistant", "content": None}, "message 1 has no content"),
    ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{x"}}]},
     "tool call 'f' has arguments that are not valid JSON"),
])
def test_malformed_tool_turns_are_row_errors(tool_tokenizer, message, error):
    with pytest.raises(RowError, match=error):
        _render(tool_tokenizer, [TOOL_TURNS[0], message])


def test_non_text_content_parts_are_row_errors(tokenizer):
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(RowError, match="message 0: a content part of type 'image_url'; only text content parts"):
        _render(tokenizer, [{"role": "user", "content": parts}])


def test_numpy_and_pyarrow_cells_render_like_plain_lists(tokenizer):
    conversation = [{"role": "user", "content": "Hi there"}]
    expected = _reference(tokenizer, conversation)
    parts = np.array([{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}], dtype=object)
    as_numpy = np.array([{"role": "user", "content": parts, "tool_calls": None}], dtype=object)
    as_arrow = pa.array([[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]])[0]
    assert _render(tokenizer, as_numpy) == expected
    assert _render(tokenizer, as_arrow) == expected


def test_pandas_reads_content_parts_back_from_parquet_as_numpy_arrays(tmp_path, llm):
    conversations = [[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
                     [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                      {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
                     [{"role": "user", "content": [{"type": "image_url", "text": None}]}]]
    pq.write_table(pa.table({"m": conversations}), tmp_path / "chats.parquet")
    frame = pd.read_parquet(tmp_path / "chats.parquet")
    assert isinstance(frame["m"][0], np.ndarray) and isinstance(frame["m"][0][0]["content"], np.ndarray)

    result = batchllm.generate(frame, messages_column="m", llm=llm, use_tqdm=False, **GREEDY)

    plain = [[{"role": m["role"], "content": m["content"][0]["text"]} for m in c] for c in conversations[:2]]
    reference = [o.outputs[0].text for o in llm.chat(plain, SamplingParams(**GREEDY), use_tqdm=False)]
    assert result["error"][:2].isna().all()
    assert list(result["generated_text"][:2]) == reference
    assert "only text content parts are supported" in result["error"][2]
