"""Prometheus metrics of one server, in a registry of its own (two servers in one process, e.g. in tests, do not
share counts). The engines' per-request measurements are replayed here (`LoopObserver`) as their results arrive;
the gauges add up the engines' latest `EngineSnapshot`s when scraped (pooling requests count as running and
waiting too), so a scrape never touches an engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from batchllm.entrypoints.server.engine_handle import EngineHandle

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.running = Gauge("batchllm_requests_running", "Requests in the engine's running batch", registry=registry)
        self.waiting = Gauge("batchllm_requests_waiting", "Requests waiting to be admitted", registry=registry)
        self.kv_cache_usage = Gauge("batchllm_kv_cache_usage", "Fraction of KV-cache blocks in use (0..1)",
                                    registry=registry)
        self.generated_tokens = Counter("batchllm_generated_tokens", "Tokens generated", registry=registry)
        self.prompt_tokens = Counter("batchllm_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=registry)
        self.time_to_first_token = Histogram("batchllm_time_to_first_token_seconds",
                                             "From submission to the first generated token", registry=registry,
                                             buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram("batchllm_inter_token_latency_seconds",
                                             "Between consecutive generated tokens of a sample", registry=registry,
                                             buckets=_ITL_BUCKETS)
        self.e2e_request_latency = Histogram("batchllm_e2e_request_latency_seconds",
                                             "From submission to the last token of a request", registry=registry,
                                             buckets=_LATENCY_BUCKETS)

    def watch(self, engines: list[EngineHandle]) -> None:
        """The gauges: requests summed over the engines; KV-cache usage over their blocks together."""
        self.running.set_function(lambda: sum(e.snapshot.num_running for e in engines))
        self.waiting.set_function(lambda: sum(e.snapshot.num_waiting for e in engines))
        self.kv_cache_usage.set_function(lambda: sum(e.snapshot.num_used_blocks for e in engines)
                                         / sum(e.snapshot.num_blocks for e in engines))

    # LoopObserver, called on the engine thread
    def request_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def tokens_generated(self, num_tokens: int, first_token_seconds: float | None,
                         inter_token_seconds: float | None) -> None:
        self.generated_tokens.inc(num_tokens)
        if first_token_seconds is not None:
            self.time_to_first_token.observe(first_token_seconds)
            num_tokens -= 1  # the first token has no predecessor
        if inter_token_seconds is not None:
            for _ in range(num_tokens):
                self.inter_token_latency.observe(inter_token_seconds)

    def request_finished(self, seconds: float) -> None:
        self.e2e_request_latency.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
