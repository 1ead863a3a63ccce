"""The Files and Batch APIs with the official `openai` client, against `LLM.generate` / `LLM.chat` run on the same
engine before the server started (greedy: the same text), and a server SIGKILLed mid-batch and restarted.

The point is the APIs' bookkeeping, so every engine here runs the session's tiny random Llama (the default model's
tokenizer and chat template). Its decode steps cost ~1-3 ms: the rows that must still be running while a test cancels,
kills or signals ask for many tokens (MANY_TOKENS, LONG_TOKENS)."""

from __future__ import annotations

import io
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI

from batchllm import LLM, SamplingParams
from batchllm.entrypoints.server.app import build_app
from batchllm.entrypoints.server.batch_api import mount_batch_api
from batchllm.entrypoints.server.batch_runner import BatchSettings
from batchllm.entrypoints.server.batches import BatchRecord, BatchStore, RequestCounts, new_batch_id
from batchllm.entrypoints.server.engine_loop import EngineLoop
from batchllm.entrypoints.server.files import FileStore
from tests.server.conftest import openai_client, serving, wait_until

KEY = "batch-test-key"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):"]
CHATS = [[{"role": "user", "content": "Name a prime number."}], [{"role": "user", "content": "Say hi to Bob."}]]
MANY = [f"Write the number {i} in words:" for i in range(12)]  # 2 at a time (SETTINGS): seconds to cancel or kill in
MANY_TOKENS = 128
LONG_TOKENS = 768  # seconds of work per row on a CPU, even in the CLI's main-thread engine: time to signal meanwhile
KV_BLOCKS = 256  # by default the tiny model would get 65,536 blocks (512 MB) in every server process
MAX_UPLOAD = 256 * 1024
SETTINGS = BatchSettings(rows_per_shard=4, flush_seconds=0.2, max_in_flight=2, max_upload_bytes=MAX_UPLOAD)
BATCH_SERVER = Path(__file__).with_name("batch_server.py")
SLOW = 300.0  # seconds: a bound for waits that take seconds on an idle CPU, much longer on a shared one


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir):
    # Room for every reference prompt in one batch: fewer steps.
    llm = LLM(tiny_llama_dir, device="cpu", max_num_seqs=64, num_kv_blocks=KV_BLOCKS)
    ref = {"text": _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False)),
           "many": _texts(llm.generate(MANY, SamplingParams(max_tokens=MANY_TOKENS, temperature=0, ignore_eos=True),
                                       use_tqdm=False)),
           "chat": _texts(llm.chat(CHATS, GREEDY, use_tqdm=False)),
           "long": _texts(llm.generate(PROMPTS[:2], SamplingParams(max_tokens=LONG_TOKENS, temperature=0,
                                                                   ignore_eos=True), use_tqdm=False))}
    loop = EngineLoop(llm)
    app = build_app(loop, api_key=KEY, data_dir=tmp_path_factory.mktemp("data"), batch_settings=SETTINGS)
    with serving(app) as base_url:
        yield {"ref": ref, "url": base_url, "client": openai_client(base_url, KEY), "loop": loop}
    loop.shutdown(5)


def _texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _completion(custom_id: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    return _line(custom_id, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                "ignore_eos": True})


def _upload(client, lines: list[str]) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def _run(client, lines: list[str], endpoint: str = "/v1/completions", timeout: float = SLOW):
    file_id = _upload(client, lines)
    batch = client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h",
                                  metadata={"test": "yes"})
    assert batch.status == "validating" and batch.input_file_id == file_id and batch.metadata == {"test": "yes"}
    return _wait_status(client, batch.id, ("completed", "failed", "cancelled"), timeout)


def _poll_batch(client, batch_id: str, done, timeout: float, what: str):
    """The batch as last retrieved, once `done(batch)`; fails after `timeout` seconds."""
    latest = []
    wait_until(lambda: done(latest.append(client.batches.retrieve(batch_id)) or latest[-1]), timeout, what)
    return latest[-1]


def _wait_status(client, batch_id: str, statuses: tuple[str, ...], timeout: float):
    return _poll_batch(client, batch_id, lambda b: b.status in statuses, timeout, f"{batch_id} to reach {statuses}")


def _answers(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def _by_id(answers: list[dict]) -> dict[str, dict]:
    ids = [a["custom_id"] for a in answers]
    assert len(ids) == len(set(ids)), f"a custom_id answered twice: {sorted(ids)}"
    return {a["custom_id"]: a for a in answers}


def test_completions_batch_answers_every_request_as_generate_does(served):
    client = served["client"]
    batch = _run(client, [_completion(f"c{i}", p) for i, p in enumerate(PROMPTS)])
    assert batch.status == "completed" and batch.error_file_id is None, batch
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.expires_at
    answers = _by_id(_answers(client, batch.output_file_id))
    assert sorted(answers) == ["c0", "c1", "c2"]
    for i, text in enumerate(served["ref"]["text"]):
        body = answers[f"c{i}"]["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == text
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
    output = client.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.bytes == len(client.files.content(output.id).content)


def test_chat_batch_answers_as_chat_does(served):
    client = served["client"]
    lines = [_line(f"chat{i}", "/v1/chat/completions", {"messages": m, "max_completion_tokens": MAX_TOKENS,
                                                         "temperature": 0, "ignore_eos": True})
             for i, m in enumerate(CHATS)]
    batch = _run(client, lines, endpoint="/v1/chat/completions")
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    answers = _by_id(_answers(client, batch.output_file_id))
    for i, text in enumerate(served["ref"]["chat"]):
        assert answers[f"chat{i}"]["response"]["body"]["choices"][0]["message"]["content"] == text


def test_bad_lines_go_to_the_error_file_and_the_good_ones_are_answered(served):
    client = served["client"]
    lines = [_completion("good0", PROMPTS[0]),
             '{"custom_id": "bad-json", "method": "POST", "url": "/v1/completions", "body": {"prompt": ',
             _line("bad-url", "/v1/images/generations", {"prompt": "x"}),
             _line("bad-field", "/v1/completions", {"prompt": "x", "max_tokens": 2, "frobnicate": 1}),
             _completion("good1", PROMPTS[1])]
    batch = _run(client, lines)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 5, "completed": 2, "failed": 3}
    good, bad = _by_id(_answers(client, batch.output_file_id)), _by_id(_answers(client, batch.error_file_id))
    assert sorted(good) == ["good0", "good1"] and sorted(bad) == ["bad-field", "bad-json", "bad-url"]
    assert good["good0"]["response"]["body"]["choices"][0]["text"] == served["ref"]["text"][0]
    assert all(a["response"] is None and a["error"]["code"] == "invalid_request" for a in bad.values())
    assert "frobnicate" in bad["bad-field"]["error"]["message"]


def test_cancel_stops_mid_way_with_a_consistent_partial_output(served):
    client = served["client"]
    file_id = _upload(client, [_completion(f"m{i}", p, MANY_TOKENS) for i, p in enumerate(MANY)])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.ConflictError):
        client.files.delete(file_id)
    _poll_batch(client, batch.id, lambda b: b.request_counts.completed >= 2, SLOW, "some answers")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    batch = _wait_status(client, batch.id, ("cancelled",), SLOW)
    answers = _by_id(_answers(client, batch.output_file_id))
    assert 2 <= len(answers) < len(MANY), "the cancel did not stop the batch half way"
    assert batch.request_counts.model_dump() == {"total": len(MANY), "completed": len(answers), "failed": 0}
    assert batch.error_file_id is None and batch.cancelled_at is not None
    for custom_id, answer in answers.items():
        assert answer["response"]["body"]["choices"][0]["text"] == served["ref"]["many"][int(custom_id[1:])]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    assert client.files.delete(file_id).deleted  # refused while the batch ran (below), allowed once it ended


def test_a_request_for_the_other_endpoint_fails_the_batch_at_validation(served):
    client = served["client"]
    chat = _line("chat", "/v1/chat/completions", {"messages": CHATS[0], "max_tokens": 2})
    batch = _run(client, [_completion("c", PROMPTS[0]), chat])
    assert batch.status == "failed" and batch.failed_at is not None and batch.output_file_id is None
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [("mismatched_endpoint", 2, "url")]
    empty = _run(client, ["", "  "])
    assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [empty.id] and page.has_more
    assert client.batches.list(limit=1, after=empty.id).data[0].id == batch.id


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]
    return error


def test_unknown_ids_bad_parameters_and_auth_answer_openai_errors(served):
    client, url = served["client"], served["url"]
    http = httpx.Client(base_url=f"{url}/v1", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    for path in ("/files/file-nope", "/files/file-nope/content", "/batches/batch_nope"):
        _error(http.get(path), 404, "id")
    _error(http.delete("/files/file-nope"), 404, "id")
    _error(http.post("/batches/batch_nope/cancel"), 404, "id")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    file_id = _upload(client, [_completion("x", PROMPTS[0])])
    good = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    embeddings = _error(http.post("/batches", json={**good, "endpoint": "/v1/embeddings"}), 400, "endpoint")
    assert "started without --task embed" in embeddings["message"]
    _error(http.post("/batches", json={**good, "completion_window": "48h"}), 400, "completion_window")
    _error(http.post("/batches", json={k: v for k, v in good.items() if k != "input_file_id"}), 400, "input_file_id")
    _error(http.post("/batches", json={**good, "metadata": {"k": 3}}), 400, "metadata")
    _error(http.post("/batches", json={**good, "priority": 1}), 400, "priority")
    _error(http.post("/batches", json={**good, "input_file_id": "file-nope"}), 404, "input_file_id")
    _error(http.post("/batches", content=b"{not json"), 400, None)
    _error(http.get("/batches", params={"limit": 0}), 400, "limit")
    upload = {"file": ("input.jsonl", b"{}\n")}
    _error(http.post("/files", files=upload, data={"purpose": "fine-tune"}), 400, "purpose")
    _error(http.post("/files", files=upload), 400, "purpose")
    _error(http.post("/files", data={"purpose": "batch"}), 400, "file")
    big = {"file": ("big.jsonl", b"x" * (MAX_UPLOAD + 1))}
    _error(http.post("/files", files=big, data={"purpose": "batch"}), 413, "file")
    assert all(f.filename != "big.jsonl" for f in client.files.list()), "a refused upload was kept"
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("input.jsonl", b"{}\n"), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"
    assert httpx.get(f"{url}/v1/batches").status_code == 401
    assert httpx.get(f"{url}/v1/files/{file_id}").status_code == 401


def test_build_app_with_a_data_dir_serves_the_batch_api(served, tmp_path):
    with serving(build_app(served["loop"], data_dir=tmp_path)) as url:
        client = openai_client(url)
        file_id = _upload(client, [_completion("x", PROMPTS[0])])
        assert client.files.retrieve(file_id).filename == "input.jsonl"
        assert client.batches.list().data == []
        with pytest.raises(RuntimeError, match="in use by another batchllm server"):
            mount_batch_api(FastAPI(), served["loop"], tmp_path)
    assert (tmp_path / "files" / file_id).read_bytes().startswith(b'{"custom_id": "x"')
    again = mount_batch_api(FastAPI(), served["loop"], tmp_path)  # the stopped server released the data dir
    assert again.files.get(file_id).filename == "input.jsonl"
    again.close()


def test_a_restart_finishes_a_cancel_that_a_kill_interrupted(served, tmp_path):
    input_file = FileStore(tmp_path / "files").upload(io.BytesIO(_completion("x", PROMPTS[0]).encode()), "in.jsonl",
                                                      "batch", MAX_UPLOAD)
    record = BatchStore(tmp_path / "batches").add(BatchRecord(
        new_batch_id(), "/v1/completions", input_file.id, "24h", int(time.time()), 4, status="cancelling",
        request_counts=RequestCounts(1)))
    service = mount_batch_api(FastAPI(), served["loop"], tmp_path)
    try:
        wait_until(lambda: service.batches.get(record.id).status == "cancelled", SLOW, "the cancel to end")
        cancelled = service.batches.get(record.id)
        assert cancelled.output_file_id is None and cancelled.request_counts == RequestCounts(1, 0, 0)
    finally:
        service.close()


def _start_server(model: Path, data_dir: Path) -> tuple[subprocess.Popen, openai.OpenAI]:
    (data_dir / "port").unlink(missing_ok=True)
    # Run as a script, in the test's directory: `python -m` from the repo root would put the root on sys.path,
    # where its kernels/ folder shadows HF's `kernels` package (transformers imports it).
    process = subprocess.Popen([sys.executable, str(BATCH_SERVER), str(data_dir), str(model)], cwd=data_dir)
    wait_until(lambda: (data_dir / "port").exists() or process.poll() is not None, SLOW, "the server to start")
    assert process.poll() is None, "the server process died at start"
    return process, openai_client(f"http://127.0.0.1:{(data_dir / 'port').read_text()}")


def test_a_batch_survives_sigkill_and_resumes_with_every_request_answered_once(served, tiny_llama_dir, tmp_path):
    processes = []
    try:
        process, client = _start_server(tiny_llama_dir, tmp_path)
        processes.append(process)
        file_id = _upload(client, [_completion(f"k{i}", p, MANY_TOKENS) for i, p in enumerate(MANY)])
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
        seen = _poll_batch(client, batch.id, lambda b: b.request_counts.completed > 0, SLOW, "the first answers")
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        assert seen.status == "in_progress" and seen.request_counts.completed < len(MANY), seen
        job_output = tmp_path / "batches" / batch.id / "output.jsonl"
        manifest = job_output.with_name("output.jsonl.manifest.jsonl").read_text()
        records = [json.loads(line) for line in manifest[:manifest.rfind("\n")].splitlines()[1:]]  # not a torn one
        saved = job_output.read_bytes()[:records[-1]["end_offset"]]  # what the killed server had made durable
        process, client = _start_server(tiny_llama_dir, tmp_path)
        processes.append(process)
        done = _wait_status(client, batch.id, ("completed", "failed"), SLOW)
        assert done.status == "completed", done
        assert done.request_counts.model_dump() == {"total": len(MANY), "completed": len(MANY), "failed": 0}
        answers = _by_id(_answers(client, done.output_file_id))
        assert sorted(answers) == sorted(f"k{i}" for i in range(len(MANY))) and done.error_file_id is None
        assert job_output.read_bytes().startswith(saved), "the restarted server redid rows the first one had saved"
        for custom_id, answer in answers.items():
            assert answer["response"]["body"]["choices"][0]["text"] == served["ref"]["many"][int(custom_id[1:])]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def _serve_cli(model: Path, data_dir: Path, port: int, log: Path) -> subprocess.Popen:
    """`batchllm serve` on `port`, once it answers /health; one batch row at a time in the engine."""
    process = subprocess.Popen([sys.executable, "-m", "batchllm", "serve", "--model", str(model),
                                "--data-dir", str(data_dir), "--port", str(port), "--api-key", KEY,
                                "--max-num-seqs", "2", "--grace-seconds", "0",
                                "--num-kv-blocks", str(KV_BLOCKS), "--log-level", "warning"],
                               cwd=log.parent, stdout=log.open("ab"), stderr=subprocess.STDOUT)

    def healthy() -> bool:
        assert process.poll() is None, f"batchllm serve exited at start:\n{log.read_text()[-3000:]}"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, SLOW, "batchllm serve to start")
    return process


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_sigterm_with_the_last_rows_in_the_engine_saves_no_aborted_answer(served, tiny_llama_dir, tmp_path):
    """The CLI's drain (--grace-seconds 0) aborts the rows in the engine. When they are the batch's last ones, the job
    would end normally and finalize their aborted, empty answers: the next server must answer them instead."""
    data_dir, port, log, processes = tmp_path / "data", _free_port(), tmp_path / "serve.log", []
    lines = [_line(f"t{i}", "/v1/completions", {"prompt": p, "max_tokens": LONG_TOKENS, "temperature": 0,
                                                 "ignore_eos": True}) for i, p in enumerate(PROMPTS[:2])]
    try:
        processes.append(_serve_cli(tiny_llama_dir, data_dir, port, log))
        client = openai_client(f"http://127.0.0.1:{port}", KEY)
        batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/completions",
                                      completion_window="24h")
        _poll_batch(client, batch.id, lambda b: b.status != "validating", SLOW, "the batch to start")
        time.sleep(1.0)  # both rows are in the engine now: they take seconds
        processes[0].send_signal(signal.SIGTERM)
        assert processes[0].wait(timeout=120) == 0, log.read_text()[-3000:]
        assert json.loads((data_dir / "batches" / f"{batch.id}.json").read_text())["status"] == "in_progress", \
            "the batch ended before the signal, or ended with the aborted rows"
        processes.append(_serve_cli(tiny_llama_dir, data_dir, port, log))
        done = _wait_status(client, batch.id, ("completed", "failed"), SLOW)
        assert done.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}, done
        answers = _by_id(_answers(client, done.output_file_id))
        for i, text in enumerate(served["ref"]["long"]):
            choice = answers[f"t{i}"]["response"]["body"]["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (text, "length")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
