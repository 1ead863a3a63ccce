"""The chat route with image content parts, through the official `openai` client, against HF transformers' greedy
tokens on the tiny random Qwen2.5-VL checkpoint (tests/e2e/test_qwen2_5_vl.py's `checkpoint` and `hf` reference).

The "vl" model runs as `batchllm serve` runs it, in an engine process: its images are prepared in the HTTP process
and cross the pipe with the prompt. Beside it, a text-only model ("text", the default model, in this process). A
second server holds the same checkpoint in this process, built with allow_remote_media=True, and fetches an http URL
from a loopback server. Bad images are 400s naming the problem, and the server goes on answering.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading

import openai
import pytest

from batchllm import LLM, SamplingParams
from batchllm.entrypoints.server.app import build_app
from batchllm.entrypoints.server.engine_loop import EngineLoop
from batchllm.entrypoints.server.engine_process import EngineLaunch, launch_engines
from batchllm.entrypoints.server.served_models import ServedModels
from tests.e2e.qwen2_5_vl_checkpoint import png_bytes, random_image
from tests.e2e.test_qwen2_5_vl import MAX_NEW, PAD, chat, checkpoint, hf  # noqa: F401 (checkpoint, hf: fixtures)
from tests.server.conftest import openai_client, serving, wait_until

ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
SMALL, OTHER = random_image(1, 100, 80), random_image(4, 100, 80)  # same size, other pixels


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def describe(url: str) -> list[dict]:
    """A conversation that the checkpoint's template renders as chat(f"Describe {PAD} briefly.")."""
    return [{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " briefly."}]}]


@pytest.fixture(scope="module")
def expected(checkpoint, hf):  # noqa: F811
    """HF's greedy answer (token ids and text) for each image under `describe`'s prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint[0]))
    ids = {name: hf(chat(f"Describe {PAD} briefly."), [image]) for name, image in (("small", SMALL),
                                                                                    ("other", OTHER))}
    assert ids["small"] != ids["other"], "the image must move the greedy tokens"
    return {name: (token_ids, tokenizer.decode(token_ids, skip_special_tokens=True))
            for name, token_ids in ids.items()}


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):  # noqa: F811
    (vl,) = launch_engines([EngineLaunch("vl", checkpoint[0], ENGINE, num_threads=1)])
    text_only = EngineLoop(LLM(num_kv_blocks=16, max_num_seqs=2))
    try:
        models = ServedModels([("vl", vl, {}), ("text", text_only, {})])
        with serving(build_app(models, data_dir=tmp_path_factory.mktemp("data"))) as url:
            yield {"client": openai_client(url), "engine": vl}
    finally:
        vl.shutdown(0)
        text_only.shutdown(0)


def _answer(client, messages, stream: bool = False, model: str = "vl") -> str:
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_NEW, temperature=0,
                                              stream=stream)
    if not stream:
        return response.choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)


def _refusal(client, messages, model: str = "vl") -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        _answer(client, messages, model=model)
    assert caught.value.status_code == 400
    return caught.value.message


def test_a_data_url_image_answers_as_hf_greedy(served, expected):
    for name, image in (("small", SMALL), ("other", OTHER)):
        assert _answer(served["client"], describe(data_url(image))) == expected[name][1], name


def test_streaming_gives_the_same_text(served, expected):
    assert _answer(served["client"], describe(data_url(SMALL)), stream=True) == expected["small"][1]


@pytest.mark.parametrize("url, problem", [
    ("http://127.0.0.1:9/cat.png", "--allow-remote-media"),
    ("data:image/png;base64,%%%not-base64%%%", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"plain text, not a picture").decode(), "not a PNG/JPEG"),
    ("data:image/png;base64," + base64.b64encode(png_bytes(SMALL)[:200]).decode(), "corrupt or truncated"),
    ("/etc/hosts", "never reads its own files"),
    ("file:///etc/hosts", "never reads its own files"),
], ids=["http-without-opt-in", "bad-base64", "not-an-image", "truncated-png", "path", "file-url"])
def test_a_bad_image_is_a_400_naming_the_problem(served, url, problem):
    message = _refusal(served["client"], describe(url))
    assert "messages[0].content[1]" in message and problem in message, message


def test_the_server_answers_after_refusals(served, expected):
    _refusal(served["client"], describe("data:image/png;base64,AAAA"))
    assert _answer(served["client"], describe(data_url(OTHER))) == expected["other"][1]


def test_a_text_only_model_given_an_image_is_a_400_naming_it(served):
    message = _refusal(served["client"], describe(data_url(SMALL)), model="text")
    assert "`text`" in message and "takes text only" in message, message


def test_batch_rows_with_images_run_on_the_engine_process(served, expected):
    """The Batch API's engine (`BatchEngine`, as its jobs use it) takes prompt dicts with images; a row whose image
    does not decode finishes with its error, the other is answered."""
    rows = [(key, {"prompt": chat(f"Describe {PAD} briefly."), "multi_modal_data": {"image": image}},
             SamplingParams(max_tokens=MAX_NEW, temperature=0))
            for key, image in (("good", png_bytes(SMALL)), ("bad", b"\x89PNG not really"))]
    outputs = dict(served["engine"].batch_engine().stream(rows))
    assert list(outputs["good"].outputs[0].token_ids) == expected["small"][0]
    assert outputs["bad"].outputs[0].finish_reason == "error"
    assert "not a PNG" in outputs["bad"].outputs[0].error


def test_a_batch_file_with_image_parts(served, expected):
    """The Batch API's rows: a data URL answered as HF's greedy; a path (a file of the server) and a corrupt image
    fail their own line."""
    def line(custom_id: str, url: str) -> str:
        body = {"model": "vl", "messages": describe(url), "max_tokens": MAX_NEW, "temperature": 0}
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})

    client = served["client"]
    lines = [line("good", data_url(SMALL)), line("path", "/etc/hosts"),
             line("corrupt", "data:image/png;base64," + base64.b64encode(b"not a picture").decode())]
    upload = client.files.create(file=("input.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), 60, "the batch")
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    rows = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            lines = client.files.content(file_id).content.splitlines()
            rows.update((row["custom_id"], row) for row in map(json.loads, lines))
    assert rows["good"]["response"] is not None, rows["good"]
    good = rows["good"]["response"]["body"]["choices"][0]["message"]["content"]
    assert good == expected["small"][1]
    assert "never reads its own files" in json.dumps(rows["path"]), rows["path"]
    assert "not a PNG" in json.dumps(rows["corrupt"]), rows["corrupt"]


@pytest.fixture
def image_host():
    """A loopback HTTP server with one PNG at /small.png."""
    body = png_bytes(SMALL)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/small.png"
    server.shutdown()
    thread.join(timeout=10)


def test_an_http_url_is_fetched_when_the_engine_opts_in(checkpoint, expected, image_host):  # noqa: F811
    loop = EngineLoop(LLM(model=str(checkpoint[0]), allow_remote_media=True, **ENGINE))
    try:
        with serving(build_app(loop, model_name="vl")) as url:
            assert _answer(openai_client(url), describe(image_host)) == expected["small"][1]
    finally:
        loop.shutdown(0)
