"""`POST /v1/embeddings`, OpenAI's embeddings API, on a model that embeds (`task="embed"`, `--task embed`).

The body is read as a batch file's /v1/embeddings line is (`connectors/jobs/openai_batch.py`): `input` a string, a
list of strings, a list of token ids or a list of lists of them (up to `MAX_INPUTS`); `encoding_format` "float" or
"base64" (little-endian float32 bytes); `dimensions` only the model's own; `user` ignored; `model` a served model
or an adapter (404 otherwise; none: the default model). Texts are tokenized as `LLM.embed` tokenizes them, and an
input longer than the model's max_model_len keeps its first tokens (the embeddings' documented policy,
`LLM.embed(truncate="right")`).
Each input is one pooling request of the model's engine; the response lists the vectors in input order, and `usage`
counts the tokens embedded. A client that disconnects aborts every input of its request.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from batchllm.connectors.cells import RowError
from batchllm.connectors.jobs.openai_batch import (
    ENCODING_FORMATS,
    check_embedding_options,
    embedding_inputs,
    embeddings_body,
)
from batchllm.entrypoints.server.admitted import ABORTED
from batchllm.entrypoints.server.errors import bad_request, unavailable
from batchllm.entrypoints.server.protocol import EmbeddingRequest
from batchllm.entrypoints.server.request_io import parse_body, submit_all, wait_outputs
from batchllm.entrypoints.server.request_mapping import RequestMapper
from batchllm.entrypoints.server.served_models import ServedModels

MAX_INPUTS = 2048  # OpenAI's limit per request


def mount_embeddings(router: APIRouter, models: ServedModels) -> None:
    """Add `POST /embeddings` to `router` (build_app's /v1 router, with its API-key dependency)."""

    @router.post("/embeddings")
    async def embeddings(request: Request):
        body = await parse_body(request, EmbeddingRequest)
        served, lora = models.route(body.model)
        engine, mapper, llm = served.engine, served.mapper, served.engine.llm
        if llm.task != "embed":
            raise bad_request(f"this server was started without --task embed (its task is {llm.task!r}): it does "
                              f"not serve /v1/embeddings")
        try:
            check_embedding_options(body.encoding_format, body.dimensions, llm.embedding_dim)
        except RowError as exc:
            param = "dimensions" if body.encoding_format in ENCODING_FORMATS else "encoding_format"
            raise bad_request(str(exc), param) from None
        prompts = _prompts(body.input, mapper)
        streams = submit_all(engine, prompts, llm.pooling_params, lora)
        outputs = await wait_outputs(engine, request, streams)
        for output in outputs:
            if output.error == ABORTED:  # only the engine's shutdown aborts a request whose client still waits
                raise unavailable("the server is shutting down")
            if output.error is not None:
                raise bad_request(output.error, "input")
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return JSONResponse(embeddings_body(body.model or served.name, [o.outputs.data for o in outputs],
                                            num_tokens, body.encoding_format))


def _prompts(value: Any, mapper: RequestMapper) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per input, cut to max_model_len."""
    try:
        inputs = embedding_inputs(value, "input")
    except RowError as exc:
        raise bad_request(str(exc), "input") from None
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"input holds {len(inputs)} inputs; at most {MAX_INPUTS} per request", "input")
    texts = [(i, item) for i, item in enumerate(inputs) if isinstance(item, str)]
    token_lists: list[Any] = list(inputs)
    if texts and mapper.tokenizer is None:
        raise bad_request("this server has no tokenizer (skip_tokenizer_init): send token ids", "input")
    if texts:  # one call: the fast tokenizer encodes a batch on its own threads
        for (i, _), ids in zip(texts, mapper.tokenizer([text for _, text in texts])["input_ids"]):
            token_lists[i] = ids
    for i, item in enumerate(inputs):
        bad = None if isinstance(item, str) else next((t for t in item if t >= mapper.vocab_size), None)
        if bad is not None:
            raise bad_request(f"input[{i}] holds the token id {bad}, outside the vocabulary [0, {mapper.vocab_size})",
                              "input")
    limit = mapper.max_model_len
    return [(item if isinstance(item, str) else None, ids[:limit]) for item, ids in zip(inputs, token_lists)]
