"""The client side of `serve.py`: streaming completions over HTTP at given arrival times, from this process or from
client processes, the server's own histograms from /metrics, and a round's figures."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

REQUEST_TIMEOUT_S = 1800  # one request, from its send


@dataclasses.dataclass
class Result:
    send: float
    chunks: list[float]  # arrival times of the chunks that carry text
    end: float
    tokens: int  # usage.completion_tokens
    error: str | None = None


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = Result(time.perf_counter(), [], 0.0, 0)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            else:
                await read_events(response, result)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    return result


async def read_events(response: httpx.Response, result: Result) -> None:
    """The server-sent events of one answer, up to `data: [DONE]` (or the end of the stream)."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        event = json.loads(line[len("data: "):])
        if "error" in event:
            result.error = event["error"]["message"]
        elif any(choice.get("text") for choice in event["choices"]):
            result.chunks.append(time.perf_counter())
        if event.get("usage"):
            result.tokens = event["usage"]["completion_tokens"]
    result.error = result.error or "the stream ended without [DONE]"


def arrival_offsets(count: int, rate: float) -> list[float]:
    """Every prompt at once (rate inf) or Poisson arrival times of `rate` requests/s."""
    rng = random.Random(0)
    offsets = [0.0]
    for _ in range(count - 1):
        offsets.append(offsets[-1] + (0.0 if math.isinf(rate) else rng.expovariate(rate)))
    return offsets


async def send_all(client: httpx.AsyncClient, url: str, prompts: list[list[int]], max_tokens: int,
                   offsets: list[float], start: float) -> list[Result]:
    """Each prompt at `start + its offset` (perf_counter seconds), concurrently."""

    async def at(offset: float, prompt: list[int]) -> Result:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        try:
            return await asyncio.wait_for(stream_one(client, url, prompt, max_tokens), REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            now = time.perf_counter()
            return Result(now - REQUEST_TIMEOUT_S, [], now, 0, f"no answer within {REQUEST_TIMEOUT_S} s")

    return await asyncio.gather(*(at(offset, prompt) for offset, prompt in zip(offsets, prompts)))


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                             timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=60))


def client_process(url: str, prompts: list[list[int]], max_tokens: int, offsets: list[float],
                   start: float) -> tuple[list[Result], float]:
    """One client process's share of a round (`--client-processes`): its results and its CPU seconds.
    perf_counter is the system's monotonic clock on Linux, so `start` and the times recorded agree across
    processes."""

    async def run() -> list[Result]:
        async with client() as http:
            return await send_all(http, url, prompts, max_tokens, offsets, start)

    cpu = time.process_time()
    results = asyncio.run(run())
    return results, time.process_time() - cpu


def server_histograms(url: str) -> dict[str, float]:
    """The server's own E2E and TTFT histograms' sums and counts (/metrics): cumulative over the rounds."""
    wanted = ("batchllm_e2e_request_latency_seconds_sum", "batchllm_e2e_request_latency_seconds_count",
              "batchllm_time_to_first_token_seconds_sum", "batchllm_time_to_first_token_seconds_count")
    values = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in values:  # summed over the labels (one series per model)
                values[sample.name] += sample.value
    return values


def summary(values: list[float]) -> dict[str, float]:
    """Mean, median and 99th percentile, in milliseconds."""
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    ms = 1000 * np.asarray(values)
    return {"mean": round(float(ms.mean()), 2), "p50": round(float(np.percentile(ms, 50)), 2),
            "p99": round(float(np.percentile(ms, 99)), 2)}


def figures(results: list[Result], max_tokens: int, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    ok = [r for r in results if r.error is None and r.chunks]
    errors = sorted({r.error or "no text chunk" for r in results if r not in ok})
    if not ok:
        return {"completed": 0, "failed": len(results), "errors": errors}
    duration = max(r.end for r in ok) - min(r.send for r in ok)
    tokens, chunks = sum(r.tokens for r in ok), sum(len(r.chunks) for r in ok)
    ttft = [r.chunks[0] - r.send for r in ok]
    tpot = [(r.chunks[-1] - r.chunks[0]) / (r.tokens - 1) if r.tokens > 1 else 0.0 for r in ok]
    good = sum(t <= slo_ttft_s and p <= slo_tpot_s for t, p in zip(ttft, tpot))
    return {"completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:5],
            "short": sum(r.tokens != max_tokens for r in ok), "duration_s": round(duration, 3),
            "request_per_s": round(len(ok) / duration, 3), "output_tok_s": round(tokens / duration, 1),
            "goodput_req_s": round(good / duration, 3), "tokens_per_chunk": round(tokens / chunks, 3),
            "ttft_ms": summary(ttft), "itl_ms": summary([b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]),
            "tpot_ms": summary(tpot), "e2e_ms": summary([r.end - r.send for r in ok])}


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The server's own E2E and TTFT means over a round, from its histograms before and after it."""
    means = {}
    for key, metric in (("server_e2e_mean_ms", "e2e_request_latency"), ("server_ttft_mean_ms", "time_to_first_token")):
        total = f"batchllm_{metric}_seconds"
        n = after.get(total + "_count", 0) - before.get(total + "_count", 0)
        if n:
            means[key] = round(1000 * (after[total + "_sum"] - before[total + "_sum"]) / n, 2)
    return means
