"""`POST /v1/embeddings` on an embed server (`task="embed"`), with the official `openai` client and raw HTTP, against
HF transformers' final hidden states of the default model pooled the same way (mean, not normalized; float32, one
input at a time, within 1e-5); its errors; the Batch API's /v1/embeddings batches; a client that disconnects; the
loop's shutdown and an engine that raises, with pooling requests in flight."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json

import httpx
import numpy as np
import pytest
import torch

from batchllm import LLM, SamplingParams
from batchllm.entrypoints.server.admitted import ABORTED
from batchllm.entrypoints.server.app import build_app
from batchllm.entrypoints.server.batch_runner import BatchSettings
from batchllm.entrypoints.server.engine_loop import EngineLoop
from batchllm.entrypoints.server.request_stream import EngineDead, ServerShuttingDown
from batchllm.outputs import PoolingRequestOutput
from tests.server.conftest import openai_client, serving, wait_until

TEXTS = ["hi", "The capital of France is Paris.", "Write a short poem about lighthouses and their keepers."]
IDS = [[504, 3575, 282, 4649, 314], [1000, 2000, 3000, 4000]]
MAX_MODEL_LEN = 64
DIM = 576
SETTINGS = BatchSettings(rows_per_shard=4, flush_seconds=0.2, max_in_flight=4)


@pytest.fixture(scope="module")
def hf_pooled():
    """HF's mean-pooled final hidden states of one token list."""
    from transformers import AutoModel

    from batchllm.model.default_model import default_model_path

    model = AutoModel.from_pretrained(default_model_path(), dtype=torch.float32).eval()

    def pooled(token_ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.tensor([token_ids])).last_hidden_state[0].mean(0).numpy()

    return pooled


@pytest.fixture(scope="module")
def llm():
    # Small steps: an abort lands within one short step.
    return LLM(device="cpu", task="embed", pooling="mean", normalize=False, max_model_len=MAX_MODEL_LEN,
               max_num_batched_tokens=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def served(llm, tmp_path_factory):
    loop = EngineLoop(llm)
    app = build_app(loop, data_dir=tmp_path_factory.mktemp("data"), batch_settings=SETTINGS)
    with serving(app) as base_url:
        yield {"llm": llm, "loop": loop, "url": base_url, "model": llm.model_path.name,
               "client": openai_client(base_url)}
    loop.shutdown(5)


@pytest.fixture
def own_loop(llm):
    """A loop of its own on the module's LLM, for tests that stop it (the served loop sleeps meanwhile: no request
    reaches it)."""
    loop = EngineLoop(llm)
    yield loop
    loop.shutdown(5)
    pool = llm.engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"


def _many_inputs(count: int) -> list[list[int]]:
    """`count` distinct full-length token lists: seconds of work each few dozen on a CPU."""
    return [[(7 * i + j) % 40000 + 100 for j in range(MAX_MODEL_LEN)] for i in range(count)]


def _token_ids(served, text: str) -> list[int]:
    return served["llm"].tokenizer(text)["input_ids"]


def _close(got, expected) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_client_embeddings_equal_hf(served, hf_pooled, encoding_format):
    """The client asks for base64 when no format is given, and decodes it itself (asked for explicitly, it hands
    the base64 text over)."""
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    response = served["client"].embeddings.create(model=served["model"], input=TEXTS, **extra)
    token_lists = [_token_ids(served, t) for t in TEXTS]
    assert response.object == "list" and response.model == served["model"]
    assert [d.index for d in response.data] == [0, 1, 2] and {d.object for d in response.data} == {"embedding"}
    for data, ids in zip(response.data, token_lists):
        vector = data.embedding
        if encoding_format == "base64":
            vector = np.frombuffer(base64.b64decode(vector), dtype="<f4")
        assert len(vector) == DIM
        _close(vector, hf_pooled(ids))
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, token_lists))


def test_base64_is_little_endian_float32_on_the_wire(served, hf_pooled):  # read without the client
    body = {"model": served["model"], "input": TEXTS[1], "encoding_format": "base64", "user": "someone"}
    answer = httpx.post(f"{served['url']}/v1/embeddings", json=body, timeout=60).json()
    vector = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4")
    _close(vector, hf_pooled(_token_ids(served, TEXTS[1])))
    assert answer["usage"] == {"prompt_tokens": len(_token_ids(served, TEXTS[1])),
                               "total_tokens": len(_token_ids(served, TEXTS[1]))}


@pytest.mark.parametrize("shape", ["one list", "lists"])
def test_token_id_inputs(served, hf_pooled, shape):
    inputs = IDS[0] if shape == "one list" else IDS
    expected = [IDS[0]] if shape == "one list" else IDS
    response = served["client"].embeddings.create(model=served["model"], input=inputs, encoding_format="float",
                                                  dimensions=DIM)  # the model's own dimension is accepted
    assert len(response.data) == len(expected)
    for data, ids in zip(response.data, expected):
        _close(data.embedding, hf_pooled(ids))
    assert response.usage.prompt_tokens == sum(map(len, expected))


def test_an_input_over_max_model_len_keeps_its_first_tokens(served, hf_pooled):
    long_ids = list(range(300, 300 + MAX_MODEL_LEN + 40))
    response = served["client"].embeddings.create(model=served["model"], input=[long_ids, IDS[1]])
    _close(response.data[0].embedding, hf_pooled(long_ids[:MAX_MODEL_LEN]))
    _close(response.data[1].embedding, hf_pooled(IDS[1]))
    assert response.usage.prompt_tokens == MAX_MODEL_LEN + len(IDS[1])


BAD_REQUESTS = [
    ("empty string", "/v1/embeddings", {"input": ""}, 400, "input", "input is empty"),
    ("empty list", "/v1/embeddings", {"input": []}, 400, "input", "input is an empty list"),
    ("an empty string in a list", "/v1/embeddings", {"input": ["a", " "]}, 400, "input", "input[1] is empty"),
    ("an empty token list", "/v1/embeddings", {"input": [[1, 2], []]}, 400, "input", "input[1]"),
    ("missing input", "/v1/embeddings", {"model": None}, 400, "input", "input"),
    ("token id outside the vocabulary", "/v1/embeddings", {"input": [1, 10 ** 9]}, 400, "input", "vocabulary"),
    ("negative token id", "/v1/embeddings", {"input": [1, -2]}, 400, "input", "-2"),
    ("wrong dimensions", "/v1/embeddings", {"input": "x", "dimensions": 128}, 400, "dimensions",
     f"this model's embeddings have {DIM}"),
    ("bad encoding_format", "/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 400, "encoding_format",
     "encoding_format must be 'float' or 'base64'"),
    ("unknown field", "/v1/embeddings", {"input": "x", "truncate": True}, 400, "truncate", "truncate"),
    ("unknown model", "/v1/embeddings", {"input": "x", "model": "text-embedding-3-small"}, 404, "model",
     "text-embedding-3-small"),
    ("completions on an embed server", "/v1/completions", {"prompt": "hi"}, 400, None, "use /v1/embeddings"),
    ("chat on an embed server", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400,
     None, "this server embeds (--task embed)"),
]


@pytest.mark.parametrize("path,body,status,param,message", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(served, path, body, status, param, message):
    response = httpx.post(f"{served['url']}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"], error


def test_the_loop_refuses_sampling_params_on_an_embed_engine(served):
    with pytest.raises(ValueError, match="its PoolingParams, not SamplingParams"):
        served["loop"].submit([1, 2, 3], SamplingParams(max_tokens=2))


def test_an_embeddings_batch_answers_every_line_as_hf(served, hf_pooled):
    client = served["client"]
    lines = [{"custom_id": "text", "body": {"input": TEXTS[1]}},
             {"custom_id": "b64", "body": {"input": [TEXTS[2]], "encoding_format": "base64"}},
             {"custom_id": "ids", "body": {"input": IDS[0], "model": served["model"]}},
             {"custom_id": "two", "body": {"input": ["a", "b"]}}]  # a batch line embeds one input
    data = "".join(json.dumps({**line, "method": "POST", "url": "/v1/embeddings"}) + "\n" for line in lines)
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch").id
    http = httpx.Client(base_url=f"{served['url']}/v1", timeout=30)
    refused = http.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                          "completion_window": "24h"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "endpoint"
    assert "this server embeds" in refused.json()["error"]["message"]
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), 120, "the batch")
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    answers = {a["custom_id"]: a for a in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["two"] and "one line per input" in errors[0]["error"]["message"]
    bodies = {key: answer["response"]["body"] for key, answer in answers.items()}
    _close(bodies["text"]["data"][0]["embedding"], hf_pooled(_token_ids(served, TEXTS[1])))
    b64 = np.frombuffer(base64.b64decode(bodies["b64"]["data"][0]["embedding"]), dtype="<f4")
    _close(b64, hf_pooled(_token_ids(served, TEXTS[2])))
    _close(bodies["ids"]["data"][0]["embedding"], hf_pooled(IDS[0]))
    assert bodies["ids"]["usage"]["prompt_tokens"] == len(IDS[0])


def test_a_client_that_disconnects_aborts_its_inputs(served):
    loop, llm = served["loop"], served["llm"]

    def prefill_tokens() -> int:
        return loop.run_on_engine_thread(lambda: llm.engine.scheduler.stats.num_prefill_tokens).result(30)

    before = prefill_tokens()
    # ~65k tokens: minutes of work on a CPU. The client gives up after 2 s and closes its connection.
    inputs = _many_inputs(1024)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{served['url']}/v1/embeddings", json={"input": inputs}, timeout=2)
    wait_until(lambda: loop.snapshot.num_running == 0 and loop.snapshot.num_waiting == 0
               and loop.snapshot.num_used_blocks == 0, 30, "the disconnected request to be aborted")
    assert loop.wait_idle(30)
    assert prefill_tokens() - before < len(inputs) * MAX_MODEL_LEN // 2, "the inputs ran instead of being aborted"
    # The loop still serves.
    assert len(served["client"].embeddings.create(model=served["model"], input="still here").data) == 1


def test_shutdown_aborts_the_pooling_requests_left_and_answers_503(llm, own_loop):
    with serving(build_app(own_loop)) as url:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # 40 inputs: seconds of steps, far past the grace period.
            waiting = pool.submit(httpx.post, f"{url}/v1/embeddings", json={"input": _many_inputs(40)}, timeout=60)
            wait_until(lambda: own_loop.snapshot.num_waiting > 0, 30, "the HTTP request's inputs to be admitted")
            streams = [own_loop.submit(ids, llm.pooling_params) for ids in _many_inputs(20)]
            own_loop.shutdown(0.5)
            response = waiting.result(timeout=60)
    assert response.status_code == 503 and response.json()["error"]["code"] == "service_unavailable"
    outputs = [stream.next_event_blocking(timeout=30).output for stream in streams]
    assert all(isinstance(output, PoolingRequestOutput) for output in outputs)
    aborted = [output for output in outputs if output.error == ABORTED]
    assert aborted and all(output.outputs is None for output in aborted)
    assert all(len(output.outputs.embedding) == DIM for output in outputs if output.error is None)
    with pytest.raises(ServerShuttingDown):
        own_loop.submit([1, 2], llm.pooling_params)


def test_an_engine_error_fails_every_pooling_stream(llm, own_loop, monkeypatch):
    def broken_step():
        raise RuntimeError("the device fell off the bus")

    monkeypatch.setattr(llm.engine, "step", broken_step)
    streams = [own_loop.submit(IDS[0], llm.pooling_params) for _ in range(3)]
    for stream in streams:
        event = stream.next_event_blocking(timeout=30)
        assert isinstance(event.error, EngineDead) and "fell off the bus" in str(event.error)
    assert own_loop.dead
    monkeypatch.undo()
    for request_id in list(llm.engine.scheduler.requests):  # what the broken engine never ran
        llm.engine.abort(request_id)
