"""The OpenAI-compatible HTTP application over the server's engines (`engine_handle.EngineHandle`: an engine process
each under `batchllm serve`, one per served model).

    POST /v1/completions, POST /v1/chat/completions   (server-sent events with "stream": true; chat messages may
                                                      hold image parts, as data: URLs: `image_chat.py`)
    POST /v1/embeddings                               on a model built with task="embed" (`--task embed`), which
                                                      serves it instead of the two above (`embeddings.py`)
    GET  /v1/models, /v1/models/{id}                  the models (by default their directories' names) and adapters
    GET  /health                                      200, or 503 while shutting down or once an engine died
    GET  /metrics                                     Prometheus text

A request's `model` picks the engine (`served_models.py`); an unknown one is a 404 naming the served models. With
`api_key` every /v1 route needs `Authorization: Bearer KEY` (401 otherwise); /health and /metrics stay open.
Handlers tokenize on the event loop (quick) and hand requests to an engine handle; they never call an engine. A
client that goes away aborts its request: a stream's generator aborts it when it is cancelled or closed (and the
response's background task makes sure), a non-streaming request checks for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from batchllm.entrypoints.chat_prompts import has_image_parts
from batchllm.entrypoints.server.batch_api import mount_batch_api
from batchllm.entrypoints.server.batch_runner import BatchSettings
from batchllm.entrypoints.server.embeddings import mount_embeddings
from batchllm.entrypoints.server.engine_handle import EngineHandle
from batchllm.entrypoints.server.errors import APIError, bad_request, install_handlers, unavailable
from batchllm.entrypoints.server.metrics import CONTENT_TYPE, ServerMetrics
from batchllm.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from batchllm.entrypoints.server.request_io import abort_all, parse_body, submit_all, wait_outputs
from batchllm.entrypoints.server.request_mapping import EngineInputs
from batchllm.entrypoints.server.request_stream import RequestStream
from batchllm.entrypoints.server.responses import DONE, ChunkWriter, full_body
from batchllm.entrypoints.server.served_models import ServedModels
from batchllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)
_EMBED_SERVER = "this server embeds (--task embed): use /v1/embeddings"
SERVED_TASKS = ("generate", "embed")


def build_app(engines: EngineHandle | ServedModels, *, api_key: str | None = None, model_name: str | None = None,
              loras: Mapping[str, LoRARequest] | None = None, data_dir: str | Path | None = None,
              batch_settings: BatchSettings | None = None) -> FastAPI:
    """`engines`: one engine handle, or the served models (`ServedModels`: several engines, each with its adapters).
    For one client, `model_name` is its name (default: its directory's name) and `loras` its adapters by the name
    a request's `model` gives (already checked with `llm.check_lora`; the engine needs enable_lora=True).
    `data_dir`: where the Batch API keeps its files (`batch_api.mount_batch_api`); None serves no Batch API.
    `batch_settings`: its shard size, save interval, rows in flight and upload limit."""
    models = engines if isinstance(engines, ServedModels) else ServedModels.single(engines, model_name, loras)
    for served in models.models:
        if served.task not in SERVED_TASKS:
            raise ValueError(f"the server serves engines built with task 'generate' or 'embed', not "
                             f"{served.task!r} (model {served.name})")
    metrics = _shared_metrics(models.engines)
    started = int(time.time())

    app = FastAPI(title="batchllm", docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    require_key = api_key_checker(api_key)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "batchllm", "root": name,
                "parent": models.parent_of(name)}

    @v1.get("/models")
    async def list_models():
        return {"object": "list", "data": [model_card(name) for name in models.names()]}

    @v1.get("/models/{model_id}")
    async def get_model(model_id: str):
        return model_card(model_id)  # 404 for an unknown one

    @v1.post("/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        served = _generating(models, body.model)
        return await _answer(served.engine, request, body, served.mapper.completion(body), chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        served = _generating(models, body.model)
        if has_image_parts(body.messages):  # decoding and preprocessing images takes milliseconds: not on the loop
            inputs = await asyncio.to_thread(served.mapper.chat, body)
        else:
            inputs = served.mapper.chat(body)
        return await _answer(served.engine, request, body, inputs, chat=True)

    @app.get("/health")
    async def health():
        dead = [m.name for m in models.models if m.engine.dead]
        if dead or not all(m.engine.healthy for m in models.models):
            message = f"the engine of {', '.join(dead)} failed" if dead else "the server is shutting down"
            return JSONResponse(unavailable(message).body(), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    mount_embeddings(v1, models)
    app.include_router(v1)
    if data_dir is not None:
        mount_batch_api(app, models, Path(data_dir), require_key, batch_settings)
    return app


def _generating(models: ServedModels, model: str | None):
    served, _ = models.route(model)
    if served.task != "generate":
        raise bad_request(_EMBED_SERVER)
    return served


def _shared_metrics(engines: list[EngineHandle]) -> ServerMetrics:
    """One set of metrics per set of engines: a second app on the same engines (another port, another key)
    shares them."""
    observers = {id(engine.observer) for engine in engines}
    first = engines[0].observer
    metrics = first if len(observers) == 1 and isinstance(first, ServerMetrics) else ServerMetrics()
    metrics.watch(engines)
    for engine in engines:
        engine.observer = metrics
    return metrics


def api_key_checker(api_key: str | None):
    """A FastAPI dependency: 401 `invalid_api_key` unless the request carries `Authorization: Bearer <api_key>`."""
    expected = None if api_key is None else api_key.encode()

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "Incorrect API key provided (send it as 'Authorization: Bearer KEY').",
                           code="invalid_api_key")

    return check


async def _answer(loop: EngineHandle, request: Request, body: Any, inputs: EngineInputs, chat: bool):
    sink: asyncio.Queue | None = asyncio.Queue() if body.stream else None
    streams = submit_all(loop, inputs.prompts, inputs.params, inputs.lora_request, inputs.images,
                         incremental=body.stream, sink=sink)
    if body.stream:
        writer = ChunkWriter(chat, inputs.model, inputs.params.n, inputs.top_logprobs)
        return StreamingResponse(_events(loop, streams, sink, writer, body.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(abort_all, loop, streams))
    outputs = await wait_outputs(loop, request, streams)
    for output in outputs:
        failed = [c for c in output.outputs if c.finish_reason == "error"]
        if failed:
            refused = not any(c.token_ids for c in failed)  # the engine refused it before generating
            raise APIError(400 if refused else 500, failed[0].error or "the request failed")
    return full_body(chat, inputs.model, outputs, inputs.top_logprobs)


async def _events(loop: EngineHandle, streams: list[RequestStream], sink: asyncio.Queue, writer: ChunkWriter,
                  include_usage: bool):
    prompt_index = {stream: i for i, stream in enumerate(streams)}
    remaining = set(streams)
    completion_tokens = 0
    try:
        for chunk in writer.opening(len(streams)):
            yield chunk
        while remaining:
            # Everything queued goes out in one write: a client (or event loop) that fell behind catches up in
            # one send, not one per token.
            ready, chunks = [await sink.get()], []
            while not sink.empty():
                ready.append(sink.get_nowait())
            for stream, event in ready:
                if event.error is not None:
                    yield "".join(chunks) + writer.error(str(event.error)) + DONE
                    return
                for update in event.updates:
                    completion_tokens += len(update.token_ids)
                    chunk = writer.update(prompt_index[stream], update)
                    if chunk is not None:
                        chunks.append(chunk)
                if event.finished:
                    remaining.discard(stream)
            if chunks:
                yield "".join(chunks)
        if include_usage:
            yield writer.usage(sum(s.num_prompt_tokens for s in streams), completion_tokens)
        yield DONE
    finally:  # cancelled (the client left) or closed early: nothing reads the rest
        abort_all(loop, remaining)
