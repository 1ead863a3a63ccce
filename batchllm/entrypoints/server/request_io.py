"""What every route does around the engine: read a JSON body into its pydantic model (400 naming the field), and
wait for the results of the streams it submitted, aborting them when the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from batchllm.entrypoints.server.engine_handle import EngineHandle
from batchllm.entrypoints.server.engine_protocol import LIVE
from batchllm.entrypoints.server.errors import APIError, bad_request, from_validation_errors, unavailable
from batchllm.entrypoints.server.request_stream import EngineDead, RequestStream, ServerShuttingDown
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.outputs import PoolingRequestOutput, RequestOutput

_DISCONNECT_POLL_SECONDS = 0.5


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("We could not parse the JSON body of your request: it is not valid JSON.") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got a JSON {type(data).__name__}.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def submit_all(engine: EngineHandle, prompts: Sequence[tuple[str | None, list[int]]], params: Any,
               lora_request: Any = None, images: Sequence[MultiModalPrompt | None] | None = None,
               **options: Any) -> list[RequestStream]:
    """Submit each (text, token ids) at LIVE priority, with its images if `images` has them (one per prompt);
    `options`: `EngineHandle.submit`'s. 503, with the ones already submitted aborted, when the engine admits no
    more."""
    streams: list[RequestStream] = []
    try:
        for (text, token_ids), mm in zip(prompts, images or [None] * len(prompts), strict=True):
            streams.append(engine.submit(token_ids, params, lora_request, LIVE, prompt_text=text, mm=mm, **options))
    except (ServerShuttingDown, EngineDead) as exc:
        abort_all(engine, streams)
        raise unavailable(str(exc)) from None
    return streams


def abort_all(engine: EngineHandle, streams: Iterable[RequestStream]) -> None:
    for stream in list(streams):
        engine.abort(stream)  # a no-op for the finished ones


async def wait_outputs(engine: EngineHandle, request: Request, streams: list[RequestStream]
                       ) -> list[RequestOutput | PoolingRequestOutput]:
    """Each stream's final output, in order; a client that disconnects meanwhile aborts them all (499)."""
    tasks = [asyncio.ensure_future(stream.result()) for stream in streams]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=_DISCONNECT_POLL_SECONDS)
            if not pending:
                break
            if await request.is_disconnected():
                abort_all(engine, streams)
                raise APIError(499, "the client closed the request")
        return [task.result() for task in tasks]
    except (EngineDead, ServerShuttingDown) as exc:
        raise unavailable(str(exc)) from None
    except ValueError as exc:  # the engine refused the request (e.g. an adapter it cannot apply)
        raise bad_request(str(exc)) from None
    finally:
        for task in tasks:
            task.cancel()
