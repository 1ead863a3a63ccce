"""`batchllm serve`: the OpenAI-compatible server (also `python -m batchllm serve`).

    batchllm serve --model /models/llama3-8b --port 8000 --api-key "$KEY"
    batchllm serve --model /models/my-embedder --task embed          # POST /v1/embeddings
    batchllm serve --model chat=/models/llama3-8b --model small=/models/smollm2   # a request's `model` picks one

Each model runs in an engine process of its own (`engine_process.py`); this process serves HTTP, tokenizes,
detokenizes and streams. Several models share the GPUs' memory (--gpu-memory-utilization divided among them), or
get a GPU each when enough are visible. The engine flags are `batchllm run`'s and apply to every model.
SIGTERM / SIGINT drain the server (`draining.py`): new requests get 503 (and /health 503) while the requests in
flight finish, for up to --grace-seconds; what is left is then aborted and the process exits with status 0. A
second signal stops at once. Bad flag values exit with status 2, naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from batchllm.entrypoints.cli.engine_flags import (
    USAGE_ERRORS,
    add_engine_flags,
    engine_options,
    fail,
    flags_by_python_name,
    with_flag_names,
)
from batchllm.entrypoints.cli.types import adapter, served_model
from batchllm.entrypoints.server.batch_runner import BatchSettings

DEFAULT_DATA_DIR = "./batchllm-data"
# A pooling task's step budget on the server, GPU and CPU (LLM's default is 32768): a long input is pooled in chunks
# this big, so an abort or the drain deadline takes effect within one short step (a 2048-token chunk of an 8B model is
# ~0.1 s on an H100; 256 tokens of the 135M default model ~1 s on two CPU cores), and other requests get steps
# between the chunks.
SERVER_POOLING_BUDGET = {"gpu": 2048, "cpu": 256}
_BATCH_DEFAULTS = BatchSettings()
logger = logging.getLogger("batchllm.entrypoints.server")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {port}")
    return port


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return seconds


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (needs the serve extra)",
        description="An OpenAI-compatible server: /v1/completions, /v1/chat/completions (streaming too), "
                    "/v1/models, the Batch API (/v1/files, /v1/batches), /health and /metrics; with --task embed, "
                    "/v1/embeddings instead of the completions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--model", type=served_model, action="append", metavar="[NAME=]PATH",
                       help="a local HF model directory, served under its directory's name or under NAME "
                            "(repeatable: one engine process per model, a request's `model` picks one, the first is "
                            "the default; none: the bundled SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; 0.0.0.0 exposes the server to the network: set --api-key with it")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port)")
    serve.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every /v1 route")
    serve.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR",
                       help="where the Batch API keeps uploaded files, batch outputs and their state")
    serve.add_argument("--batch-rows-per-shard", type=_positive, default=_BATCH_DEFAULTS.rows_per_shard, metavar="N",
                       help="Batch API: request lines per output shard of a new batch (the unit a restart resumes)")
    serve.add_argument("--batch-flush-seconds", type=_seconds, default=_BATCH_DEFAULTS.flush_seconds, metavar="S",
                       help="Batch API: how often a running batch saves its answers (what a kill can lose)")
    serve.add_argument("--batch-max-in-flight", type=_positive, default=None, metavar="N",
                       help="Batch API: a batch's rows in the engine at once (None: the engine's max_num_seqs)")
    serve.add_argument("--max-upload-mb", type=_positive, default=_BATCH_DEFAULTS.max_upload_bytes // 2 ** 20,
                       metavar="MB", help="largest file POST /v1/files accepts (413 above)")
    serve.add_argument("--lora", type=adapter, action="append", metavar="NAME=PATH",
                       help="a PEFT LoRA adapter directory under a name (repeatable): a request's `model` names it; "
                            "adapters apply to the first --model")
    serve.add_argument("--allow-remote-media", action="store_true",
                       help="let chat image parts be http(s) URLs, which the server fetches (otherwise images come as "
                            "data: URLs only); the server can then be made to fetch any URL it can reach")
    serve.add_argument("--grace-seconds", type=_seconds, default=30.0,
                       help="on SIGTERM / SIGINT, how long the requests in flight may take to finish")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                       help="uvicorn's and batchllm's log level")
    add_engine_flags(serve)
    serve.set_defaults(flags_by_python_name=flags_by_python_name(serve), handler=serve_command)


def serve_command(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        return fail(f"batchllm serve needs the serve extra ({exc.name} is missing): pip install 'batchllm[serve]'")
    from batchllm.entrypoints.server.app import SERVED_TASKS

    if args.task not in SERVED_TASKS:
        return fail(f"--task {args.task} is not served: batchllm serve takes --task generate (/v1/completions, "
                    f"/v1/chat/completions) or --task embed (/v1/embeddings)")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    loras = dict(args.lora or [])
    if len(loras) < len(args.lora or []):
        return fail("--lora names an adapter twice")
    try:
        engines = _start_engines(args, loras)
    except USAGE_ERRORS as exc:
        return fail(with_flag_names(str(exc), args.flags_by_python_name))
    except KeyboardInterrupt:
        return 130
    try:
        return _serve(uvicorn, args, engines, loras)
    finally:
        for _, engine in engines:
            engine.stop()  # a no-op after a drain


def _start_engines(args: argparse.Namespace, loras: dict[str, str]) -> list[tuple[str | None, Any]]:
    """(name given by --model, engine process) per model, started in parallel; ValueError and the like for bad
    flags (the engine's own, raised where it was built)."""
    from batchllm.engine_config import EngineConfig
    from batchllm.entrypoints.server.engine_process import EngineLaunch, launch_engines
    from batchllm.entrypoints.server.placement import gpu_count, plan_engines

    models = args.model or [(None, None)]
    named = [name for name, _ in models if name is not None]
    if len(set(named)) < len(named):
        raise ValueError("--model names two models alike: give each its own NAME")
    engine = engine_options(args)
    if loras:
        engine["enable_lora"] = True
    if args.allow_remote_media:
        engine["allow_remote_media"] = True
    EngineConfig.from_kwargs(**engine)  # a bad flag value fails here, before torch is imported and GPUs counted
    if args.task != "generate" and "max_num_batched_tokens" not in engine:
        engine["max_num_batched_tokens"] = SERVER_POOLING_BUDGET["gpu" if gpu_count(engine) else "cpu"]
    placements = plan_engines(len(models), engine)
    launches = [EngineLaunch(name or f"model{i}", path, p.engine_kwargs, p.env, p.num_threads)
                for i, ((name, path), p) in enumerate(zip(models, placements))]
    return [(name, process) for (name, _), process in zip(models, launch_engines(launches))]


def _serve(uvicorn: Any, args: argparse.Namespace, engines: list[tuple[str | None, Any]],
           loras: dict[str, str]) -> int:
    from batchllm.connectors.adapters import adapter_requests
    from batchllm.entrypoints.server.app import build_app
    from batchllm.entrypoints.server.draining import draining_server
    from batchllm.entrypoints.server.served_models import ServedModels

    try:
        adapters = adapter_requests(sorted(loras.items()), engines[0][1].llm) if loras else {}
        served = ServedModels([(name or process.llm.model_path.name, process, adapters if i == 0 else {})
                               for i, (name, process) in enumerate(engines)])
    except USAGE_ERRORS as exc:
        return fail(with_flag_names(str(exc), args.flags_by_python_name))
    settings = BatchSettings(args.batch_rows_per_shard, args.batch_flush_seconds, args.batch_max_in_flight,
                             args.max_upload_mb * 2 ** 20)
    app = build_app(served, api_key=args.api_key, data_dir=args.data_dir, batch_settings=settings)
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = draining_server(uvicorn, config, served.engines, args.grace_seconds)
    server.run()  # in the main thread: SIGTERM / SIGINT reach its handlers (draining.py) as they arrive
    if not server.started:
        print("batchllm: the HTTP server did not start (its error is above)", file=sys.stderr)
        return 1
    return 0
