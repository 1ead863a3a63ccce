"""`batchllm serve` as a user runs it: its flags, bad values (exit 2 naming the flag), and a real server process that
answers, then drains on SIGTERM and exits with status 0."""

from __future__ import annotations

import json
import os
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

# Run in each test's own directory: `python -m` puts the cwd on sys.path, and from the repo root its kernels/
# folder would shadow HF's `kernels` package, which transformers imports.
SERVE = [sys.executable, "-m", "batchllm", "serve"]


def _run(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_help_shows_the_flags(tmp_path):
    result = _run(tmp_path, "--help")
    assert result.returncode == 0
    for flag in ("--model", "--host", "--port", "--api-key", "--data-dir", "--lora", "--speculative-config",
                 "--grace-seconds", "--batch-rows-per-shard", "--batch-flush-seconds", "--batch-max-in-flight",
                 "--max-upload-mb", "--device", "--dtype", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--gpu-memory-utilization", "--tensor-parallel-size"):
        assert flag in result.stdout, flag
    host_help = " ".join(result.stdout.split())
    assert "0.0.0.0 exposes" in host_help and "--api-key" in host_help
    assert "127.0.0.1" in host_help


@pytest.mark.parametrize("args,flag", [
    (["--port", "99999"], "--port"),
    (["--port", "http"], "--port"),
    (["--grace-seconds", "-1"], "--grace-seconds"),
    (["--batch-rows-per-shard", "0"], "--batch-rows-per-shard"),
    (["--max-upload-mb", "lots"], "--max-upload-mb"),
    (["--speculative-config", "{not json"], "--speculative-config"),
    (["--lora", "no-equals-sign"], "--lora"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),  # checked by LLM() before any weights load
    (["--task", "classify"], "--task"),  # the server serves generate and embed only
    (["--task", "score"], "--task"),
])
def test_a_bad_flag_value_exits_2_naming_the_flag(args, flag, tmp_path):
    result = _run(tmp_path, *args)
    assert result.returncode == 2, result.stderr
    assert flag in result.stderr


def test_serve_answers_then_drains_on_sigterm_and_exits_0(tmp_path):
    process = subprocess.Popen([*SERVE, "--port", "0", "--max-num-seqs", "4", "--grace-seconds", "1",
                                "--data-dir", str(tmp_path / "data")],
                               cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("Uvicorn running on" in line for line in lines) or process.poll() is not None, 120,
                   "the server to start")
        assert process.poll() is None, "".join(lines)
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
        url = f"http://127.0.0.1:{port}"
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                                           "temperature": 0}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        chunks: list[dict] = []

        def stream_long() -> None:
            body = {"prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))

        streamer = threading.Thread(target=stream_long, daemon=True)
        streamer.start()
        wait_until(lambda: len(chunks) >= 2, 60, "the long stream to start")
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # draining: the listener stays up and answers 503
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 503:
                    break
            except httpx.TransportError:
                break
            time.sleep(0.05)
        assert process.wait(timeout=60) == 0, "".join(lines)
        streamer.join(timeout=30)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort", "the grace period ended the long stream"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
