"""`batchllm serve --task embed` as the issue's user ran it (the engine in a process of its own): a long embeddings
request whose client gives up is aborted within a step, so the next request is answered promptly, and /metrics
counts the pooling request while it runs; SIGTERM during a long engine step ends the process at the drain deadline;
a second signal ends it at once; no signal path prints a traceback."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import wait_until

START_TIMEOUT = 300.0  # two engine builds share two cores with the rest of the suite
PROMPT_TOKENS = 2048


class Server:
    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "batchllm", "serve", "--port", "0", "--task", "embed", "--data-dir",
             str(tmp_path / "data"), *flags],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True).start()
        wait_until(lambda: "Uvicorn running on" in self.stderr or self.process.poll() is not None, START_TIMEOUT,
                   "the server to start")
        assert self.process.poll() is None, self.stderr
        self.url = "http://127.0.0.1:" + re.search(r"http://127\.0\.0\.1:(\d+)", self.stderr).group(1)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def in_engine(self) -> float:
        """Requests running plus waiting, as /metrics reports them."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(re.search(rf"^batchllm_requests_{kind} (\S+)$", text, re.M).group(1))
                   for kind in ("running", "waiting"))

    def embed_in_background(self, inputs: list[list[int]], timeout: float | None) -> dict:
        """POST /v1/embeddings from a thread whose client gives up after `timeout` seconds."""
        outcome: dict = {}

        def post() -> None:
            try:
                outcome["response"] = httpx.post(f"{self.url}/v1/embeddings", json={"input": inputs},
                                                 timeout=timeout)
            except httpx.HTTPError as exc:
                outcome["error"] = exc

        outcome["thread"] = threading.Thread(target=post, daemon=True)
        outcome["thread"].start()
        return outcome

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def _long_inputs(count: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 40000 + 100 for j in range(length)] for i in range(count)]


def _assert_no_traceback(server: Server) -> None:
    assert "Traceback" not in server.stderr and "CancelledError" not in server.stderr, server.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server's own step budget (no --max-num-batched-tokens): a long input is pooled in short chunks."""
    server = Server(tmp_path_factory.mktemp("serve"), "--max-model-len", str(PROMPT_TOKENS), "--num-kv-blocks",
                    "300", "--grace-seconds", "60")
    yield server
    server.close()


def test_a_long_embedding_whose_client_left_is_aborted_and_the_next_request_answered(server):
    # 8 x 2048 tokens: minutes of work on two cores; the client gives up after 5 s, as the did.
    gone = server.embed_in_background(_long_inputs(8, PROMPT_TOKENS), timeout=5.0)
    wait_until(lambda: server.in_engine() >= 1, 30, "/metrics to count the pooling requests while they run")
    gone["thread"].join(timeout=60)
    assert "error" in gone, "the long request should still have been running when its client gave up"
    start = time.monotonic()
    answer = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"}, timeout=120)
    elapsed = time.monotonic() - start
    assert answer.status_code == 200 and len(answer.json()["data"]) == 1
    assert elapsed < 60, f"the next request waited {elapsed:.0f} s: the abandoned one was not aborted"
    wait_until(lambda: server.in_engine() == 0, 60, "the engine to be empty")


def test_a_second_signal_stops_at_once(server):
    server.embed_in_background(_long_inputs(8, PROMPT_TOKENS), timeout=None)
    wait_until(lambda: server.in_engine() >= 1, 30, "the long request to reach the engine")
    server.process.send_signal(signal.SIGTERM)  # drains: the grace period (60 s) outlasts this test
    wait_until(lambda: "draining" in server.stderr, 30, "the drain to begin")
    start = time.monotonic()
    server.process.send_signal(signal.SIGINT)
    status = server.process.wait(timeout=60)
    assert time.monotonic() - start < 10, "the second signal did not stop the server at once"
    assert status == 128 + signal.SIGINT
    _assert_no_traceback(server)


def test_sigterm_during_a_long_step_exits_at_the_drain_deadline(tmp_path):
    # One step pools the whole 4096-token input: tens of seconds on two cores, far past the 1 s grace period.
    server = Server(tmp_path, "--max-model-len", "4096", "--num-kv-blocks", "300", "--max-num-batched-tokens",
                    "4096", "--grace-seconds", "1")
    try:
        server.embed_in_background(_long_inputs(1, 4096), timeout=None)
        wait_until(lambda: server.in_engine() >= 1, 30, "the long request to reach the engine")
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        status = server.process.wait(timeout=120)
        elapsed = time.monotonic() - start
        assert status == 0, server.stderr
        # grace (1 s) + the engine's stop (2 s) and terminate, and the HTTP server's close: a few seconds
        assert elapsed < 1 + 15, f"exited {elapsed:.0f} s after SIGTERM"
        assert "terminating its process" in server.stderr
        _assert_no_traceback(server)
    finally:
        server.close()
