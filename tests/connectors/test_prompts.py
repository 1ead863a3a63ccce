"""Row → prompt rules on the real tokenizer (no model): per-row errors, chat rendering, truncation."""

from __future__ import annotations

import numpy as np
import pytest

from batchllm.connectors.messages import check_messages
from batchllm.connectors.options import resolve_options
from batchllm.connectors.prompts import PromptEncoder, encode_rows
from batchllm.model.loader import resolve_model_path
from batchllm.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def _encode(tokenizer, columns, max_model_len=64, truncate="error", max_tokens=4, **spec):
    options = resolve_options(truncate=truncate, sampling_fields={"max_tokens": max_tokens}, **spec)
    encoder = PromptEncoder(tokenizer, max_model_len, truncate)
    return encode_rows(columns, len(next(iter(columns.values()))), options, encoder)


def test_text_prompts_tokenize_like_the_facade(tokenizer):
    prompts = ["Hello there", "The capital of France is"]
    encoded = _encode(tokenizer, {"q": prompts}, prompt_column="q")
    assert [e.token_ids for e in encoded] == [tokenizer(p)["input_ids"] for p in prompts]
    assert all(e.error is None for e in encoded)


@pytest.mark.parametrize("value, message", [
    (None, "is null"), (float("nan"), "is null"), (np.float64("nan"), "is null"), (7, "must be a string, got int"),
    (["a"], "must be a string, got list"), ("", "is empty"), ("  \n", "is empty"),
])
def test_bad_prompt_values_are_row_errors(tokenizer, value, message):
    good, bad = _encode(tokenizer, {"q": ["fine", value]}, prompt_column="q")
    assert good.error is None
    assert bad.token_ids is None and message in bad.error and "'q'" in bad.error


def test_messages_render_with_the_chat_template(tokenizer):
    conversation = [{"role": "user", "content": "Hi"}]
    expected = tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    as_array = np.array([{"role": "user", "content": "Hi", "name": None}], dtype=object)  # how pandas holds it
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    encoded = _encode(tokenizer, {"m": [conversation, as_array, as_parts]}, messages_column="m")
    assert [e.token_ids for e in encoded] == [expected] * 3


@pytest.mark.parametrize("messages, message", [
    ("hello", "must be a list"), ({"role": "user"}, "must be a list"), ([], "empty"), (None, "null"),
    (["hello"], "message 0 must be an object"), ([{"content": "x"}], "no role"),
    ([{"role": "user"}], "no content"), ([{"role": "user", "content": 3}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content"),
])
def test_malformed_messages_are_row_errors(messages, message):
    with pytest.raises(ValueError, match=message):
        check_messages(messages)


def test_template_rows(tokenizer):
    columns = {"city": ["Paris", None, "Rome"], "meta": [{"lang": "fr"}, {"lang": "x"}, {}]}
    encoded = _encode(tokenizer, columns, prompt_template="{city} ({meta[lang]})")
    assert encoded[0].token_ids == tokenizer("Paris (fr)")["input_ids"]
    assert "column 'city' is null" in encoded[1].error
    assert "KeyError" in encoded[2].error  # the row's struct lacks the key the template names


def test_callable_template_may_return_messages_or_fail(tokenizer):
    def template(row):
        if row["n"] == 2:
            raise KeyError("boom")
        return "text prompt" if row["n"] == 0 else [{"role": "user", "content": "chat prompt"}]

    text, chat, failed = _encode(tokenizer, {"n": [0, 1, 2]}, prompt_template=template)
    assert text.token_ids == tokenizer("text prompt")["input_ids"]
    assert tokenizer.decode(chat.token_ids).endswith("chat prompt<|im_end|>\n<|im_start|>assistant\n")
    assert "raised KeyError" in failed.error


def test_chat_flag_wraps_the_text_as_a_user_message(tokenizer):
    (encoded,) = _encode(tokenizer, {"q": ["Hi"]}, prompt_column="q", chat=True)
    assert tokenizer.decode(encoded.token_ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_truncation_policies(tokenizer):
    text = " ".join(["word"] * 40)
    ids = tokenizer(text)["input_ids"]
    budget = 32 - 4  # max_model_len - max_tokens
    assert len(ids) > budget
    (error,) = _encode(tokenizer, {"q": [text]}, max_model_len=32, prompt_column="q")
    assert f"{len(ids)} tokens, over the budget of {budget}" in error.error and error.num_tokens == len(ids)
    (left,) = _encode(tokenizer, {"q": [text]}, max_model_len=32, truncate="left", prompt_column="q")
    (right,) = _encode(tokenizer, {"q": [text]}, max_model_len=32, truncate="right", prompt_column="q")
    assert left.error is None and left.token_ids == ids[-budget:]
    assert right.error is None and right.token_ids == ids[:budget]
    (no_room,) = _encode(tokenizer, {"q": ["hi"]}, max_model_len=32, max_tokens=32, prompt_column="q")
    assert "leaves no room" in no_room.error


def test_each_distinct_conversation_is_rendered_once(tokenizer, monkeypatch):
    calls = []
    render = tokenizer.apply_chat_template

    def counting(conversation, **kwargs):
        calls.append(conversation)
        return render(conversation, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting)
    questions = ["Is it red?", "Is it blue?", "Is it red?", "Is it red?", "Is it blue?"]
    encoded = _encode(tokenizer, {"q": questions}, max_model_len=256, prompt_column="q", chat=True)
    assert len(calls) == 2
    expected = [render([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True) for q in questions]
    assert [e.token_ids for e in encoded] == [tokenizer(t, add_special_tokens=False)["input_ids"] for t in expected]
