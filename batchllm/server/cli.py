"""`batchllm serve`: the OpenAI-compatible server on one engine (also `python -m batchllm serve`).

    batchllm serve --model /models/llama3-8b --port 8000 --api-key "$KEY"
    batchllm serve --model /models/my-embedder --task embed          # POST /v1/embeddings

The engine flags are `batchllm run`'s. SIGTERM / SIGINT drain the server: new requests get 503 (and /health
503) while the requests in flight finish, for up to --grace-seconds; what is left is then aborted and the
process exits with status 0. A second signal stops at once. Bad flag values exit with status 2, naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from batchllm.cli_engine import (
    USAGE_ERRORS,
    add_engine_flags,
    engine_options,
    fail,
    flags_by_python_name,
    with_flag_names,
)
from batchllm.cli_types import adapter
from batchllm.server.batch_runner import BatchSettings

DEFAULT_DATA_DIR = "./batchllm-data"
_BATCH_DEFAULTS = BatchSettings()
logger = logging.getLogger("batchllm.server")


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
    serve.add_argument("--model", help="local HF model directory (None: the bundled SmolLM2-135M-Instruct)")
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
                       help="a PEFT LoRA adapter directory under a name (repeatable): a request's `model` names it")
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
    from batchllm.connectors.adapters import adapter_requests
    from batchllm.llm import LLM
    from batchllm.server.app import SERVED_TASKS, build_app
    from batchllm.server.engine_loop import EngineLoop

    if args.task not in SERVED_TASKS:
        return fail(f"--task {args.task} is not served: batchllm serve takes --task generate (/v1/completions, "
                    f"/v1/chat/completions) or --task embed (/v1/embeddings)")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    engine = engine_options(args)
    loras = dict(args.lora or [])
    if len(loras) < len(args.lora or []):
        return fail("--lora names an adapter twice")
    if loras:
        engine["enable_lora"] = True
    try:
        llm = LLM(args.model, **engine)
        adapters = adapter_requests(sorted(loras.items()), llm) if loras else {}
    except USAGE_ERRORS as exc:
        return fail(with_flag_names(str(exc), args.flags_by_python_name))
    # The engine steps in this thread, the one that built the LLM (engine_loop.py says why); HTTP is served from
    # another, and SIGTERM / SIGINT, which only this thread can receive, are handed to the server.
    loop = EngineLoop(llm, start=False)
    try:
        settings = BatchSettings(args.batch_rows_per_shard, args.batch_flush_seconds, args.batch_max_in_flight,
                                 args.max_upload_mb * 2 ** 20)
        app = build_app(loop, api_key=args.api_key, loras=adapters, data_dir=args.data_dir, batch_settings=settings)
        if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
            logger.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
        server = _draining_server(uvicorn, uvicorn.Config(app, host=args.host, port=args.port,
                                                           log_level=args.log_level, timeout_graceful_shutdown=5),
                                  loop, args.grace_seconds)

        def serve_http() -> None:
            try:
                server.run()
            finally:
                loop.shutdown(0)  # the server stopped (or never started): so does the engine

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, server.handle_exit)
        http = threading.Thread(target=serve_http, name="batchllm-http")
        http.start()
        loop.run()
        server.should_exit = True
        http.join()
    finally:
        loop.shutdown(0)  # a no-op after a drain
        llm.shutdown()
    if not server.started:
        print("batchllm: the HTTP server did not start (its error is above)", file=sys.stderr)
        return 1
    return 0


def _draining_server(uvicorn: Any, config: Any, loop: Any, grace_seconds: float) -> Any:
    """A uvicorn.Server whose first SIGTERM / SIGINT drains the engine loop before the server stops (uvicorn's own
    handling would close the listening socket at once, and re-raise the signal after it stops)."""

    class DrainingServer(uvicorn.Server):
        _drain: threading.Thread | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self._drain is not None:  # a second signal: stop now
                self.should_exit = self.force_exit = True
                return
            print(f"batchllm: draining: no new requests; the ones in flight get up to {grace_seconds:g} s "
                  f"(signal again to stop at once)", file=sys.stderr, flush=True)
            self._drain = threading.Thread(target=self._drain_then_exit, name="batchllm-drain", daemon=True)
            self._drain.start()

        def _drain_then_exit(self) -> None:
            loop.shutdown(grace_seconds)
            self.should_exit = True

    return DrainingServer(config)
