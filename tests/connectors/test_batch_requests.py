"""OpenAI batch request lines that are not plain text chats: invalid UTF-8, unknown roles, tool calls and
content parts each get their own answer or error; the other lines are unaffected."""

from __future__ import annotations

import json

import batchllm
from batchllm import SamplingParams
from tests.connectors.helpers import GREEDY


def _chat(custom_id: str, messages: list[dict]) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": messages, "max_tokens": 4, "temperature": 0}}, ensure_ascii=False).encode()


HELLO = [{"role": "user", "content": "Say hello."}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]}]
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
LINES = [
    _chat("hello", HELLO),
    _chat("latin-1", [{"role": "user", "content": "Caf\u00e9?"}]).replace("\u00e9".encode(), b"\xe9"),
    _chat("developer", [{"role": "developer", "content": "Be brief."}, *HELLO]),
    _chat("tool-call", [*HELLO, {"role": "assistant", "content": None, "tool_calls": [CALL]}]),
    _chat("parts", PARTS),
    _chat("image", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]),
]


def test_each_line_is_answered_on_its_own(tmp_path, llm):
    (tmp_path / "requests.jsonl").write_bytes(b"\n".join(LINES) + b"\n")
    batchllm.run_job(tmp_path / "requests.jsonl", tmp_path / "results.jsonl", rows_per_shard=4, llm=llm,
                     use_tqdm=False)
    answers = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text(encoding="utf-8").splitlines()]

    errors = [answer["error"] and answer["error"]["message"] for answer in answers]
    assert errors == [
        None,
        "line 2: the line is not valid UTF-8",
        "line 3: message 0 has role 'developer'; the roles are system, user, assistant, tool",
        "line 4: message 1 has tool_calls, which this model's chat template does not render",
        None,
        "line 6: message 0: a content part of type 'image_url'; only text content parts are supported",
    ]
    assert "\ufffd" not in (tmp_path / "results.jsonl").read_text(encoding="utf-8")
    reference = llm.chat([HELLO], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    texts = {answer["custom_id"]: answer["response"]["body"]["choices"][0]["message"]["content"]
             for answer in answers if answer["response"]}
    assert texts == {"hello": reference, "parts": reference}  # text parts join into the same prompt
