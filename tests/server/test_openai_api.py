"""The OpenAI-compatible server with the official `openai` client, against `LLM.generate` / `LLM.chat` run on the
same engine before the server started (greedy: the same tokens and text; seeded: the same samples)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import pytest

from batchllm import LLM, SamplingParams
from batchllm.entrypoints.server.app import build_app
from batchllm.entrypoints.server.engine_loop import EngineLoop
from batchllm.structured_outputs import StructuredOutputsParams
from tests.server.conftest import openai_client, serving, wait_until

PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):"]
CHATS = [[{"role": "user", "content": "Name a prime number."}], [{"role": "user", "content": "Say hi to Bob."}]]
MAX_TOKENS = 8
SHORT = 4  # the 64 concurrent streams: one wave of 64 rows, few steps
STOP = ["\n\nThe", "answer"]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
SEEDED = dict(n=2, temperature=0.9, seed=7, max_tokens=MAX_TOKENS)
PRIME_SCHEMA = {"type": "object", "properties": {"prime": {"type": "integer"}}, "required": ["prime"],
                "additionalProperties": False}
JSON_TOKENS = 24


@pytest.fixture(scope="module")
def served():
    llm = LLM(max_num_seqs=64, num_kv_blocks=256)
    ref = {
        "text": llm.generate(PROMPTS, GREEDY, use_tqdm=False),
        "short": llm.generate(PROMPTS, SamplingParams(max_tokens=SHORT, temperature=0), use_tqdm=False),
        "logprobs": llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2),
                                 use_tqdm=False)[0],
        "stop": llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=STOP),
                             use_tqdm=False)[0],
        "seeded": llm.generate(PROMPTS[1], SamplingParams(**SEEDED), use_tqdm=False)[0],
        "ids": llm.generate([[504, 3575, 282, 4649, 314]], GREEDY, use_tqdm=False)[0],
        "chat": llm.chat(CHATS, GREEDY, use_tqdm=False),
        "chat_logprobs": llm.chat(CHATS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=3),
                                  use_tqdm=False)[0],
        "json": llm.chat(CHATS[0], SamplingParams(max_tokens=JSON_TOKENS, temperature=0,
                                                  structured_outputs=StructuredOutputsParams(json=PRIME_SCHEMA)),
                         use_tqdm=False)[0],
    }
    assert ref["stop"].outputs[0].stop_reason in STOP, "the stop test needs a prompt whose output hits a stop string"
    loop = EngineLoop(llm)
    with serving(build_app(loop)) as base_url:
        yield {"llm": llm, "loop": loop, "url": base_url, "ref": ref, "model": llm.model_path.name,
               "client": openai_client(base_url)}
    loop.shutdown(5)


def _complete(served, stream: bool, **kwargs):
    """(texts by choice index, finish reasons, usage or None) of one /v1/completions call."""
    client, texts, reasons, usage = served["client"], {}, {}, None
    response = client.completions.create(model=served["model"], stream=stream, **kwargs)
    if not stream:
        return ({c.index: c.text for c in response.choices}, {c.index: c.finish_reason for c in response.choices},
                response.usage)
    for chunk in response:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


def _chat(served, stream: bool, **kwargs):
    client, texts, reasons, usage = served["client"], {}, {}, None
    response = client.chat.completions.create(model=served["model"], stream=stream, **kwargs)
    if not stream:
        return ({c.index: c.message.content for c in response.choices},
                {c.index: c.finish_reason for c in response.choices}, response.usage)
    for chunk in response:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_generate(served, stream):
    for prompt, ref in zip(PROMPTS, served["ref"]["text"]):
        texts, reasons, usage = _complete(served, stream, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          stream_options={"include_usage": True} if stream else None)
        assert texts == {0: ref.outputs[0].text}
        assert reasons == {0: ref.outputs[0].finish_reason}
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids),
                                                                   len(ref.outputs[0].token_ids))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_several_prompts_with_n_2_number_their_choices(served, stream):
    texts, reasons, _ = _complete(served, stream, prompt=PROMPTS[:2], n=2, max_tokens=MAX_TOKENS, temperature=0)
    refs = served["ref"]["text"]
    assert texts == {i * 2 + j: refs[i].outputs[0].text for i in range(2) for j in range(2)}
    assert set(reasons) == set(texts)


def test_token_id_prompt(served):
    texts, _, usage = _complete(served, False, prompt=[504, 3575, 282, 4649, 314], max_tokens=MAX_TOKENS,
                                temperature=0)
    ref = served["ref"]["ids"]
    assert texts == {0: ref.outputs[0].text}
    assert usage.prompt_tokens == 5 and usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_completion_logprobs_equal_generate_streamed_or_not(served):
    ref = served["ref"]["logprobs"].outputs[0]
    ref_tokens = [served["llm"].tokenizer.decode([t]) for t in ref.token_ids]
    ref_logprobs = [step[t].logprob for t, step in zip(ref.token_ids, ref.logprobs)]
    client = served["client"]
    whole = client.completions.create(model=served["model"], prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                      temperature=0, logprobs=2).choices[0].logprobs
    assert whole.tokens == ref_tokens
    assert whole.token_logprobs == pytest.approx(ref_logprobs)
    assert all(len(top) == 2 for top in whole.top_logprobs)
    assert whole.text_offset == [sum(len(t) for t in ref_tokens[:i]) for i in range(len(ref_tokens))]
    tokens, logprobs, offsets = [], [], []
    for chunk in client.completions.create(model=served["model"], prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0, logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, offsets) == (whole.tokens, whole.text_offset)
    assert logprobs == pytest.approx(whole.token_logprobs)


def test_chat_logprobs_equal_llm_chat(served):
    ref = served["ref"]["chat_logprobs"].outputs[0]
    response = served["client"].chat.completions.create(model=served["model"], messages=CHATS[0],
                                                        max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                                        top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert [c.token for c in content] == [served["llm"].tokenizer.decode([t]) for t in ref.token_ids]
    assert [c.logprob for c in content] == pytest.approx([s[t].logprob for t, s in zip(ref.token_ids, ref.logprobs)])
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)


def test_stop_strings_are_cut_and_never_streamed(served):
    ref = served["ref"]["stop"].outputs[0]
    texts, reasons, _ = _complete(served, False, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=STOP)
    assert texts == {0: ref.text} and reasons == {0: "stop"}
    pieces = [c.choices[0].text for c in served["client"].completions.create(
        model=served["model"], prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=STOP, stream=True)]
    assert "".join(pieces) == ref.text
    assert not any(s in "".join(pieces[:i + 1]) for s in STOP for i in range(len(pieces)))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_seeded_samples_equal_generate(served, stream):
    ref = served["ref"]["seeded"]
    texts, _, _ = _complete(served, stream, prompt=PROMPTS[1], **SEEDED)
    assert texts == {c.index: c.text for c in ref.outputs}
    assert ref.outputs[0].text != ref.outputs[1].text, "sample j must use seed + j"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_response_format_json_schema_gives_valid_json_equal_to_llm_chat(served, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "prime", "schema": PRIME_SCHEMA}}
    texts, reasons, _ = _chat(served, stream, messages=CHATS[0], max_tokens=JSON_TOKENS, temperature=0,
                              response_format=response_format)
    ref = served["ref"]["json"].outputs[0]
    assert reasons == {0: "stop"}, "the reference must finish its JSON within JSON_TOKENS"
    jsonschema.validate(json.loads(texts[0]), PRIME_SCHEMA)
    assert texts == {0: ref.text}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equals_llm_chat(served, stream):
    for messages, ref in zip(CHATS, served["ref"]["chat"]):
        texts, reasons, usage = _chat(served, stream, messages=messages, max_tokens=MAX_TOKENS, temperature=0, n=2,
                                      stream_options={"include_usage": True} if stream else None)
        assert texts == {0: ref.outputs[0].text, 1: ref.outputs[0].text}
        assert reasons == {0: ref.outputs[0].finish_reason, 1: ref.outputs[0].finish_reason}
        assert usage.prompt_tokens == len(ref.prompt_token_ids)
        assert usage.completion_tokens == 2 * len(ref.outputs[0].token_ids)


def test_64_concurrent_streams_all_complete_and_free_every_block(served):
    refs = served["ref"]["short"]

    def one(i: int) -> str:
        chunks = served["client"].completions.create(model=served["model"], prompt=PROMPTS[i % len(PROMPTS)],
                                                     max_tokens=SHORT, temperature=0, stream=True)
        return "".join(chunk.choices[0].text for chunk in chunks)  # the client ends at [DONE]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        texts = list(pool.map(one, range(64), timeout=180))
    assert texts == [refs[i % len(PROMPTS)].outputs[0].text for i in range(64)]
    loop = served["loop"]
    assert loop.wait_idle(30)
    pool_state = loop.run_on_engine_thread(lambda: (served["llm"].engine.scheduler.kv_cache.pool.num_free_blocks,
                                                    served["llm"].engine.scheduler.kv_cache.pool.num_blocks))
    free, total = pool_state.result(timeout=30)
    assert free == total, "KV blocks leaked"


def test_a_client_that_disconnects_mid_stream_aborts_its_request(served):
    loop = served["loop"]
    body = {"model": served["model"], "prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{served['url']}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [line for line, _ in zip((x for x in lines if x.startswith("data:")), range(3))]
            assert len(received) == 3
            assert loop.snapshot.num_running == 1
    # 2000 tokens take minutes on the CPU: back to 0 within seconds means it was aborted, not finished
    wait_until(lambda: loop.snapshot.num_running == 0 and loop.snapshot.num_used_blocks == 0, 20,
               "the disconnected request to be aborted")


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi", ', 400, None),
    ("unknown field", "/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("wrong type", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("n too large", "/v1/completions", {"prompt": "hi", "n": 10000}, 400, "n"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10 ** 9]}, 400, "prompt"),
    ("prompt over max_model_len", "/v1/completions", {"prompt": "hello " * 5000}, 400, "prompt"),
    ("prompt + max_tokens over max_model_len", "/v1/chat/completions",
     {"messages": CHATS[0], "max_tokens": 4090}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": CHATS[0], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("bad response_format", "/v1/chat/completions", {"messages": CHATS[0], "response_format": {"type": "yaml"}},
     400, "response_format"),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    ("unknown route", "/v1/engines", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(served, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{served['url']}{path}", content=content, headers={"Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if "max_model_len" in path or "over max_model_len" in response.text:
        assert error["code"] == "context_length_exceeded"


def test_embeddings_need_an_embed_server(served):
    response = httpx.post(f"{served['url']}/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert response.status_code == 400
    assert "started without --task embed" in response.json()["error"]["message"]


def test_context_length_error_code(served):
    response = httpx.post(f"{served['url']}/v1/completions", json={"prompt": "hello " * 5000}, timeout=30)
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_models_lists_the_base_model(served):
    models = served["client"].models.list()
    assert [m.id for m in models.data] == [served["model"]]
    assert served["model"] == served["llm"].model_path.name


def test_api_key_is_required_on_v1_routes_only(served):
    with serving(build_app(served["loop"], api_key="sesame")) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        answer = openai_client(url, api_key="sesame").completions.create(
            model=served["model"], prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert answer.choices[0].text == served["ref"]["text"][0].outputs[0].text


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_health_and_metrics(served):
    url = served["url"]
    assert httpx.get(f"{url}/health").status_code == 200
    before = httpx.get(f"{url}/metrics").text
    for name in ("batchllm_requests_running", "batchllm_requests_waiting", "batchllm_kv_cache_usage",
                 "batchllm_generated_tokens_total", "batchllm_prompt_tokens_total",
                 "batchllm_time_to_first_token_seconds_count", "batchllm_inter_token_latency_seconds_count",
                 "batchllm_e2e_request_latency_seconds_count"):
        assert any(line.startswith(name) for line in before.splitlines()), name
    ref = served["ref"]["text"][0]
    served["client"].completions.create(model=served["model"], prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                        temperature=0)
    after = httpx.get(f"{url}/metrics").text
    generated = len(ref.outputs[0].token_ids)
    assert _metric(after, "batchllm_generated_tokens_total") == _metric(before, "batchllm_generated_tokens_total") \
        + generated
    assert _metric(after, "batchllm_prompt_tokens_total") == _metric(before, "batchllm_prompt_tokens_total") \
        + len(ref.prompt_token_ids)
    for name in ("batchllm_time_to_first_token_seconds_count", "batchllm_e2e_request_latency_seconds_count"):
        assert _metric(after, name) == _metric(before, name) + 1
    assert _metric(after, "batchllm_inter_token_latency_seconds_count") == \
        _metric(before, "batchllm_inter_token_latency_seconds_count") + generated - 1
