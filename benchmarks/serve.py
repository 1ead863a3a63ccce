"""Serving benchmark of `batchllm serve` (the `vllm bench serve` method): latency and throughput of the
OpenAI-compatible server under Poisson arrivals, against offline `LLM.generate` on the same prompts.

    python benchmarks/serve.py --shape llama3-8b --out $OUT                     # GPU: W1, 200 rows x 128 tokens
    python benchmarks/serve.py --shape llama3-8b --rates inf --out $OUT         # GPU: W1 all at once vs offline
    python benchmarks/serve.py --shape tiny-host --rows 8 --max-tokens 8 --rates inf   # CPU check (seconds)
    python benchmarks/serve.py --rows 8 --max-tokens 16 --rates 4 inf           # CPU, the real default model

The server runs its engine in a process of its own (`batchllm serve`'s layout since the engine-process split):
the served / offline ratio at rate inf measures what the HTTP side (tokenizing, detokenizing, streaming) and the
pipe between the processes cost, against `LLM.generate` on the same engine flags in this process.

Model: `--model DIR` (default: the bundled SmolLM2-135M-Instruct, `default_model_path()`), or `--shape NAME`:
random weights (`make_shape_dir`, `--load-format dummy`) plus a synthetic word-level tokenizer (token i is the
word "t{i}"), since the server streams a chunk only when it has text. Engine flags: `--dtype` (bfloat16 on
CUDA, float32 on CPU) and `--engine-args "..."` (`batchllm serve`'s engine flags, e.g. "--max-num-seqs 512"),
which the offline peer reads back with the server's own parser, so both build the same engine.

Prompts: `--rows` token-id prompts of `--workload` (`make_prompts`), `--max-tokens` output tokens each, greedy,
`ignore_eos` (every request yields exactly max_tokens). Every round (warm-up, each rate, offline) replaces the
prompts' first token with its own id below 100 (`make_prompts` draws none), so no round reuses prefix-cache
blocks of another; the offline peer runs the `inf` round's prompts.

Server: `python -m batchllm serve` in a subprocess on a free loopback port. Once /health answers 200, every
prompt at once warms it up (the shapes the timed rounds run compile first; the first W1 run of an engine takes
about twice as long as the next); then, per rate of `--rates` (requests/s; inf: all at once),
every prompt goes to POST /v1/completions (`stream`, `include_usage`) at Poisson arrival times (exponential
gaps, `random.Random(0)`), concurrently, from one `httpx.AsyncClient`. Recorded per request: send time, the
arrival of every chunk that carries text, end time, `usage.completion_tokens`. SIGTERM stops the server.

Figures per rate (duration: first send to last end): req/s; output tok/s (completion tokens / duration);
TTFT (send to first text chunk); ITL, the gaps between consecutive text chunks, per chunk (a chunk's gap is not
divided among the tokens it carries: `tokens_per_chunk` in the record says how many that is); TPOT per request
((last chunk - first chunk) / (tokens - 1)); E2E; goodput: req/s of the requests with TTFT <= --slo-ttft-ms and
TPOT <= --slo-itl-ms. Offline peer: after the server has exited (its memory is free), `LLM` in this process,
warmed up alike (every prompt once, salted apart), then `generate` on the prompts: output tok/s, and served `inf` /
offline (target: >= 0.90 for llama3-8b on one H200).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import json
import math
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
from serve_client import arrival_offsets, client, client_process, figures, send_all, server_histograms, server_means
from shapes import make_shape_dir, shape_config
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from batchllm import LLM, SamplingParams
from batchllm.entrypoints.cli.engine_flags import add_engine_flags, engine_options
from batchllm.model.default_model import default_model_path

READY_TIMEOUT_S = 600  # loading the model and capturing its graphs
STOP_TIMEOUT_S = 60  # SIGTERM's drain, then SIGKILL
SLO_DEFAULTS_MS = {"cuda": (2000.0, 100.0), "cpu": (20000.0, 1000.0)}  # TTFT, TPOT


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A tokenizer for a shape directory: token i is the word "t{i}", text is the words joined by spaces, so
    every token decodes to text; AutoTokenizer loads it as a PreTrainedTokenizerFast."""
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # no token has the prefix: joins by spaces
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "model_max_length": 1 << 20}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def salted(prompts: list[list[int]], salt: int) -> list[list[int]]:
    return [[salt, *p[1:]] for p in prompts]


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def serving(model: Path, engine_argv: list[str], workdir: Path) -> Iterator[str]:
    """`batchllm serve` in a subprocess, ready (/health 200) on a free loopback port: yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "batchllm", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--data-dir", str(workdir / "data"), "--log-level", "warning", *engine_argv]
    log_path = workdir / "server.log"
    with log_path.open("wb") as log:
        # In the work directory, not the cwd: `python -m` puts the cwd on sys.path, and from the repo root its
        # kernels/ folder would shadow HF's `kernels` package, which transformers imports.
        server = subprocess.Popen(command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited with status {server.returncode}:\n{tail(log_path)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no /health 200 within {READY_TIMEOUT_S} s:\n{tail(log_path)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                time.sleep(0.5)
            yield url
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(STOP_TIMEOUT_S)
    if server.returncode != 0:
        print(f"warning: the server exited with status {server.returncode}:\n{tail(log_path)}", file=sys.stderr)


async def serve_rounds(url: str, prompts: list[list[int]], warmup: list[list[int]], max_tokens: int,
                       rates: list[float], processes: list[int], slo: tuple[float, float]) -> dict[str, dict]:
    """One round per rate and client-process count; keyed by the rate (one process) or "RATExNp"."""
    results: dict[str, dict] = {}
    pool = None
    if max(processes) > 1:
        pool = concurrent.futures.ProcessPoolExecutor(max(processes), mp_context=multiprocessing.get_context("spawn"))
        list(pool.map(time.sleep, [0.0] * max(processes)))  # started (serve_client imported) before any round
    try:
        async with client() as http:
            warm = await send_all(http, url, warmup, max_tokens, arrival_offsets(len(warmup), math.inf),
                                  time.perf_counter())
            if any(r.error for r in warm):
                raise RuntimeError(f"warm-up failed: {next(r.error for r in warm if r.error)}")
            rounds = [(rate, count) for rate in rates for count in processes]
            for i, (rate, count) in enumerate(rounds):
                before = server_histograms(url)
                timed, cpu = await timed_round(http, pool, url, salted(prompts, 11 + i), max_tokens,
                                               arrival_offsets(len(prompts), rate), count)
                entry = figures(timed, max_tokens, slo[0] / 1000, slo[1] / 1000)
                entry.update(client_processes=count, client_cpu_s=round(cpu, 3),
                             **server_means(before, server_histograms(url)))
                key = f"{rate:g}" if count == 1 else f"{rate:g}x{count}p"
                results[key] = entry
                print(f"rate {key}: {json.dumps(entry)}", flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
    return results


async def timed_round(http: httpx.AsyncClient, pool: concurrent.futures.Executor | None, url: str,
                      prompts: list[list[int]], max_tokens: int, offsets: list[float], count: int
                      ) -> tuple[list, float]:
    """A round's results and the client's CPU seconds: from this process, or dealt round-robin over `count` client
    processes of `pool`, every one starting at one instant."""
    if count == 1:
        cpu = time.process_time()
        results = await send_all(http, url, prompts, max_tokens, offsets, time.perf_counter())
        return results, time.process_time() - cpu
    start = time.perf_counter() + 1.0
    shares = await asyncio.gather(*(asyncio.wrap_future(pool.submit(client_process, url, prompts[j::count], max_tokens,
                                                                    offsets[j::count], start))
                                    for j in range(count)))
    return [r for share, _ in shares for r in share], sum(seconds for _, seconds in shares)


def offline(model: Path, engine: dict, prompts: list[list[int]], warmup: list[list[int]], max_tokens: int) -> dict:
    start = time.perf_counter()
    llm = LLM(str(model), **engine)
    ready = time.perf_counter() - start
    llm.generate(warmup, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"ready_s": round(ready, 1), "seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tok_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_group = parser.add_mutually_exclusive_group()
    model_group.add_argument("--model", type=Path, help="model directory (default: the bundled SmolLM2-135M)")
    model_group.add_argument("--shape", help="random weights of a shapes.py shape, e.g. llama3-8b, tiny-host")
    parser.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0, math.inf],
                        help="requests/s; inf: all at once")
    parser.add_argument("--client-processes", type=int, nargs="+", default=[1],
                        help="one round per rate and count: the prompts dealt over that many client processes (a "
                             "single Python client parsing every stream may fall behind the server)")
    parser.add_argument("--slo-ttft-ms", type=float, help="default: 2000 on CUDA, 20000 on CPU")
    parser.add_argument("--slo-itl-ms", type=float, help="TPOT's SLO; default: 100 on CUDA, 1000 on CPU")
    parser.add_argument("--engine-args", default="", help='more engine flags of `batchllm serve`, e.g. '
                                                          '"--max-num-seqs 512 --max-num-batched-tokens 16384"')
    parser.add_argument("--out", default=None, help="also copy the JSON record here (the device tool's $OUT)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    slo = (args.slo_ttft_ms or SLO_DEFAULTS_MS[device][0], args.slo_itl_ms or SLO_DEFAULTS_MS[device][1])
    engine_argv = ["--dtype", dtype, *(["--load-format", "dummy"] if args.shape else []),
                   *shlex.split(args.engine_args)]
    engine_parser = argparse.ArgumentParser(prog="--engine-args")
    add_engine_flags(engine_parser)
    engine = engine_options(engine_parser.parse_args(engine_argv))  # as `batchllm serve` reads them
    if args.shape:
        model = make_shape_dir(args.shape)
        vocab = shape_config(args.shape)["vocab_size"]
        write_word_tokenizer(model, vocab)
    else:
        model = args.model or default_model_path()
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    name = args.shape or model.name
    prompts = make_prompts(WORKLOADS[args.workload], args.rows, vocab)
    warmup = salted(prompts, 10)  # every prompt at once: what the timed rounds run gets compiled first
    peak = max(range(len(args.rates)), key=args.rates.__getitem__)  # inf, where it is one of the rates
    final = salted(prompts, 11 + peak * len(args.client_processes))  # the peak rate's prompts (its first round)
    print(f"{args.workload}: {args.rows} rows, prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} output tokens, {name} {dtype} on {device}, engine flags {engine_argv}", flush=True)

    load_at_start = round(os.getloadavg()[0], 2)  # other processes on the cores skew every figure
    if load_at_start > 0.5:
        print(f"warning: load average {load_at_start} before the run; the figures will not be representative")
    with tempfile.TemporaryDirectory(prefix="batchllm-serve-") as workdir:
        with serving(model, engine_argv, Path(workdir)) as url:
            served = asyncio.run(serve_rounds(url, prompts, warmup, args.max_tokens, args.rates,
                                                 args.client_processes, slo))
    peer = offline(model, engine, final, warmup, args.max_tokens)
    peak_rate = f"{args.rates[peak]:g}"
    peak_rounds = [key for key in served if key == peak_rate or key.startswith(peak_rate + "x")]
    ratios = {key: round(served[key].get("output_tok_s", 0.0) / peer["output_tok_s"], 3) for key in peak_rounds}
    ratio = ratios[peak_rounds[0]]

    device_name, device_info = hardware(device)
    today = str(datetime.date.today())
    record = dict(benchmark="serve", date=today, git=git_sha(), model=str(model), shape=args.shape, dtype=dtype,
                  engine_args=engine_argv, workload=args.workload, rows=args.rows, max_tokens=args.max_tokens,
                  prompt_tokens=sum(map(len, prompts)), slo_ms={"ttft": slo[0], "tpot": slo[1]}, device=device_name,
                  **device_info,
                  load_average_at_start=load_at_start, served=served,
                  offline=peer, served_over_offline={"rate": peak_rounds[0], "ratio": ratio, "by_round": ratios})
    save_record(f"{today}-serve-{name}-{device_name}.json", record, args.out)
    print("\n| rate | req/s | out tok/s | TTFT mean/p50/p99 ms | ITL mean/p50/p99 ms | goodput req/s |")
    print("|---|---|---|---|---|---|")
    for rate, entry in served.items():
        if not entry["completed"]:
            print(f"| {rate} | all {entry['failed']} failed: {entry['errors'][:1]} | | | | |")
            continue
        ttft, itl = ("/".join(f"{entry[key][q]:.1f}" for q in ("mean", "p50", "p99")) for key in ("ttft_ms", "itl_ms"))
        failed = f" ({entry['failed']} failed)" if entry["failed"] else ""
        print(f"| {rate} | {entry['request_per_s']:.2f}{failed} | {entry['output_tok_s']:.1f} | {ttft} | {itl} | "
              f"{entry['goodput_req_s']:.2f} |")
    print(f"\noffline LLM.generate: {peer['output_tok_s']:.1f} out tok/s ({peer['seconds']:.2f} s)")
    for key, value in ratios.items():
        entry = served[key]
        print(f"served (rate {key}) / offline output tok/s: {value:.3f}; client CPU {entry.get('client_cpu_s')} s "
              f"over {entry.get('duration_s')} s; E2E mean as the client saw it {entry.get('e2e_ms', {}).get('mean')} "
              f"ms, as the server did {entry.get('server_e2e_mean_ms')} ms")


if __name__ == "__main__":
    main()
