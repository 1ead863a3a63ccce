"""OpenAI batch JSONL in → JSONL out: one answer per request line, errors for malformed ones, resumable."""

from __future__ import annotations

import json

import pytest

import batchllm
from batchllm import SamplingParams
from batchllm.connectors.jobs.manifest import ManifestMismatch
from tests.connectors.helpers import GREEDY


def _chat(custom_id, content, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body}})


def _completion(custom_id, prompt, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, **body}})


LINES = [
    _chat("hello", "Say hello.", max_tokens=4, temperature=0),
    _completion("paris", "The capital of France is", max_tokens=4, temperature=0, logprobs=2),
    "{not json",
    "",  # blank lines are not requests
    json.dumps({"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}),
    _chat("hello", "Again?"),
    _chat("tools", "Hi", tools=[]),
    _chat("hot", "Hi", temperature=3),
    json.dumps({"custom_id": "no-role", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"content": "x"}]}}),
    _completion("empty", ""),
    _chat("two", "Count to two.", n=2, seed=7, temperature=0.8, max_tokens=4),
]
ERRORS = {3: "invalid JSON", 5: "/v1/embeddings requests need an engine built with task='embed'",
          6: "custom_id must be a non-empty string",
          7: "custom_id 'hello' was already used on line 1", 8: "unsupported parameter: tools",
          9: "temperature must be in [0, 2]", 10: "message 0 has no role", 11: "body.prompt is empty"}


def _run(tmp_path, **options):
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    if not requests.exists():
        requests.write_text("\n".join(LINES) + "\n")
    result = batchllm.run_job(requests, results, rows_per_shard=4, use_tqdm=False, **options)
    return result, [json.loads(line) for line in results.read_text().splitlines()]


def _without_created(answers):
    for answer in answers:
        if answer["response"]:
            answer["response"]["body"].pop("created")
    return answers


def test_answers_and_errors(tmp_path, llm):
    result, answers = _run(tmp_path, max_tokens=4)
    assert result.total_rows == 11 and result.error_rows == 8
    by_line = {int(a["id"].removeprefix("batch_req_")): a for a in answers}
    assert sorted(by_line) == [1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12]  # one answer per request line

    hello = llm.chat([[{"role": "user", "content": "Say hello."}]], SamplingParams(**GREEDY), use_tqdm=False)[0]
    body = by_line[1]["response"]["body"]
    assert by_line[1]["custom_id"] == "hello" and by_line[1]["error"] is None
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == hello.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(hello.prompt_token_ids)

    paris = llm.generate("The capital of France is", SamplingParams(logprobs=2, **GREEDY), use_tqdm=False)[0]
    choice = by_line[2]["response"]["body"]["choices"][0]
    assert choice["text"] == paris.outputs[0].text and choice["finish_reason"] == paris.outputs[0].finish_reason
    assert len(choice["logprobs"]["tokens"]) == 4 and all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])

    assert [c["index"] for c in by_line[12]["response"]["body"]["choices"]] == [0, 1]
    for line, message in ERRORS.items():
        assert by_line[line]["response"] is None and message in by_line[line]["error"]["message"], line
        assert by_line[line]["error"]["code"] == "invalid_request"


def test_resume_cuts_a_torn_append_and_refuses_other_jobs(tmp_path):
    _, first = _run(tmp_path, max_tokens=4)
    results, manifest = tmp_path / "results.jsonl", tmp_path / "results.jsonl.manifest.jsonl"
    records = manifest.read_text().splitlines()
    manifest.write_text("\n".join(records[:-1]) + "\n")  # the last shard's record never made it...
    with open(results, "a") as file:
        file.write('{"id": "batch_req_99", "custom_id": "torn')  # ...and a later append was cut short
    result, again = _run(tmp_path, max_tokens=4)
    assert result.written_rows == json.loads(records[-1])["rows"]
    assert sorted(_without_created(again), key=lambda a: a["id"]) == sorted(_without_created(first),
                                                                            key=lambda a: a["id"])

    with pytest.raises(ManifestMismatch, match="defaults.max_tokens: was 4, now 8"):
        _run(tmp_path, max_tokens=8)
    manifest.unlink()
    with pytest.raises(FileExistsError, match="no batchllm manifest"):
        _run(tmp_path, max_tokens=4)
