"""OpenAI chat content parts → HF chat-template messages and the image sources, in order."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from batchllm.multimodal.messages import split_chat_images

PIL_IMAGE = Image.fromarray(np.zeros((4, 4, 3), np.uint8))


def test_each_part_form_and_the_order_of_images_across_messages():
    messages = [
        {"role": "system", "content": "You describe images."},
        {"role": "user", "content": [
            {"type": "text", "text": "First:"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image_url", "image_url": "file:///tmp/b.png"},
        ]},
        {"role": "assistant", "content": "Two images."},
        {"role": "user", "content": [
            {"type": "image", "image": b"\x89PNG..."},
            {"type": "text", "text": "and"},
            {"type": "image", "image": PIL_IMAGE},
            {"type": "image", "image": Path("/tmp/e.png")},
        ], "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    original = copy.deepcopy(messages)
    rewritten, sources = split_chat_images(messages)
    assert rewritten == [
        {"role": "system", "content": "You describe images."},
        {"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "image"}, {"type": "image"}]},
        {"role": "assistant", "content": "Two images."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                     {"type": "image"}], "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    assert sources[:3] == ["data:image/png;base64,AAAA", "file:///tmp/b.png", b"\x89PNG..."]
    assert sources[3] is PIL_IMAGE and sources[4] == Path("/tmp/e.png") and len(sources) == 5
    # The input is left as it was, and the output shares no message or part dict with it.
    assert messages == original
    assert messages[3]["content"][2]["image"] is PIL_IMAGE
    assert all(new is not old for new, old in zip(rewritten, messages))


def test_text_only_messages_pass_through_with_no_images():
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "yo"}]}]
    rewritten, sources = split_chat_images(messages)
    assert rewritten == messages and sources == []


@pytest.mark.parametrize(("messages", "words"), [
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                                   {"type": "audio", "audio": b""}]}],
     "messages[0].content[2]: unknown part type 'audio'"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": ["just a string"]}],
     "messages[1].content[0]: a content part must be a dict, got str"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0]: an image_url part needs a url"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]: an image_url part needs a url"),
    ([{"role": "user", "content": [{"type": "image"}]}], "messages[0].content[0]: an image part needs 'image'"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]: a text part needs 'text'"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0]: a content part needs a 'type'"),
    ([{"role": "user", "content": 7}], "messages[0].content must be a string or a list of parts, got int"),
    (["user: hi"], "messages[0] must be a dict, got str"),
    ({"role": "user"}, "messages must be a list of dicts, got dict"),
])
def test_malformed_parts_name_the_message_and_part(messages, words):
    with pytest.raises(ValueError) as caught:
        split_chat_images(messages)
    assert words in str(caught.value)
