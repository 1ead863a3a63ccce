"""The OpenAI Batch API formats: request lines in, response lines out.

A request line is `{"custom_id", "method": "POST", "url", "body"}` with url `/v1/chat/completions`
(body: `messages`), `/v1/completions` (body: a single string `prompt`) or, for a job whose engine embeds
(`task="embed"`), `/v1/embeddings` (body: `input`, one string, or one list of token ids; `encoding_format`
"float" or "base64"; `model`, `user`, `dimensions` equal to the model's). Body fields mapped to sampling:
`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `n`, `seed`, `stop`, the presence and
frequency penalties, `logprobs` (chat: true with `top_logprobs`; completions: an int), and vLLM's
extensions `top_k`, `min_p`, `min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`. Fields
the body does not set take the job's defaults.

`response_format` constrains the output (`batchllm.connectors.constraints.response_format_constraint`):
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}} to the schema (always enforced,
whatever `strict` says), {"type": "json_object"} to any JSON object, {"type": "text"} to nothing. A line
without one takes the job's default constraint (the CLI's --json-schema / --regex / --choice), if any; any
other response_format fails the line. A schema the grammar engine rejects fails its line with the engine's
message. A constrained answer cut short by max_tokens is answered as OpenAI does: its (incomplete) content
with finish_reason "length".

`model`, `user`, `metadata`, `store`, `service_tier` and a false `stream` are ignored; any other field is
refused for that line rather than silently ignored.

Chat messages follow `batchllm.connectors.messages.check_messages`: the roles are system, user, assistant
and tool (any other fails the line); content is a string or a list of text parts (joined), or, for a
vision-language model, of text and image parts (`image_url` with a data: URL or a path; `batchllm/connectors/images.py`;
an image that does not load fails its line); an assistant's
`tool_calls` (its content may then be null) and `tool` results go to the chat template when it renders
tool calls, and fail the line otherwise. A line that is not valid UTF-8 fails on its own.

A response line is `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error":
null}` with a `chat.completion`, `text_completion` or embeddings (`"object": "list"`) body, or `"response":
null` and `"error": {"code", "message"}` for a line that could not be answered (its custom_id is recovered
from a line that is not valid JSON when possible): code `invalid_request` when the line or its request was
refused before any token was generated, `generation_error` when generation failed later. Ids derive from the
line number, so reruns agree.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchllm.connectors.cells import RowError, check_text
from batchllm.connectors.constraints import response_format_constraint
from batchllm.connectors.results import RowOutcome, token_logprobs
from batchllm.outputs import CompletionOutput, PoolingRequestOutput
from batchllm.sampling_params import SamplingParams

_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
_EMBEDDING_FIELDS = frozenset({"input", "model", "user", "encoding_format", "dimensions"})
ENCODING_FORMATS = ("float", "base64")
_IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "stream"})
_SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
             "top_p": "top_p", "n": "n", "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
             "min_tokens": "min_tokens", "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
             "stop_token_ids": "stop_token_ids"}


@dataclass(slots=True)
class Envelope:
    """A request line's outer fields; `error` when the line is not a valid request."""

    custom_id: str | None
    url: str | None
    body: dict[str, Any] | None
    error: str | None = None


def parse_envelope(raw: str | None) -> Envelope:
    """The request line `raw`; None stands for a line whose bytes are not UTF-8 (the format is UTF-8 text)."""
    if raw is None:
        return Envelope(None, None, None, "the line is not valid UTF-8")
    try:
        request = json.loads(raw)
    except json.JSONDecodeError as exc:
        return Envelope(_salvage_custom_id(raw), None, None, f"invalid JSON: {exc}")
    if not isinstance(request, dict):
        return Envelope(None, None, None, f"a request line must be a JSON object, got {type(request).__name__}")
    custom_id, url, body = request.get("custom_id"), request.get("url"), request.get("body")
    custom_id = custom_id if isinstance(custom_id, str) and custom_id else None
    error = None
    if custom_id is None:
        error = "custom_id must be a non-empty string"
    elif request.get("method", "POST") != "POST":
        error = f"method must be POST, got {request.get('method')!r}"
    elif url not in URLS:
        error = f"url must be {', '.join(URLS[:-1])} or {URLS[-1]}, got {url!r}"
    elif not isinstance(body, dict):
        error = "body must be a JSON object"
    return Envelope(custom_id, url if error is None else None, body if error is None else None, error)


def _salvage_custom_id(raw: str) -> str | None:
    """The custom_id of a line that is not valid JSON, when it can still be read: the error then maps back to
    its request."""
    match = _CUSTOM_ID.search(raw)
    if match is None:
        return None
    try:
        return json.loads(f'"{match.group(1)}"') or None
    except json.JSONDecodeError:
        return None


def sampling_params(body: dict[str, Any], defaults: SamplingParams, chat: bool) -> SamplingParams:
    """The request's sampling parameters: the job's defaults overridden by the body's fields."""
    unknown = sorted(set(body) - _IGNORED - set(_SAMPLING) - {"messages", "prompt", "logprobs", "top_logprobs",
                                                              "response_format"})
    if unknown:
        raise RowError(f"unsupported parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    if body.get("stream"):
        raise RowError("stream=true is not supported in a batch")
    overrides = {_SAMPLING[key]: value for key, value in body.items() if key in _SAMPLING}
    temperature = overrides.get("temperature")
    if isinstance(temperature, (int, float)) and temperature > 2:
        raise RowError(f"temperature must be in [0, 2], got {temperature}")  # OpenAI's range, stricter than ours
    if chat:
        if body.get("logprobs"):
            overrides["logprobs"] = body.get("top_logprobs") or 0
        elif "top_logprobs" in body:
            raise RowError("top_logprobs needs logprobs=true")
    elif body.get("logprobs") is not None:
        overrides["logprobs"] = body["logprobs"]
    if body.get("response_format") is not None:  # its own, even {"type": "text"}: the job's default does not apply
        overrides["structured_outputs"] = response_format_constraint(body["response_format"])
    try:
        return dataclasses.replace(defaults, **overrides)
    except (ValueError, TypeError) as exc:
        raise RowError(str(exc).replace("SamplingParams.", "")) from exc


def prompt_of(body: dict[str, Any], chat: bool) -> Any:
    """The messages (chat) or the prompt text (completions) of a body."""
    if chat:
        if "messages" not in body:
            raise RowError("body.messages is required for /v1/chat/completions")
        return body["messages"]
    if isinstance(body.get("prompt"), list):
        raise RowError("body.prompt must be a single string; send one line per prompt")
    return check_text(body.get("prompt"), "body.prompt")


def embedding_input(body: dict[str, Any], dim: int) -> str | list[int]:
    """An embeddings body's one input: text, or token ids."""
    unknown = sorted(set(body) - _EMBEDDING_FIELDS)
    if unknown:
        raise RowError(f"unsupported parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    check_embedding_options(body.get("encoding_format", "float"), body.get("dimensions"), dim)
    inputs = embedding_inputs(body.get("input"), "body.input")
    if len(inputs) > 1:
        raise RowError("body.input must be one string (or one list of token ids); send one line per input")
    return inputs[0]


def check_embedding_options(encoding_format: Any, dimensions: Any, dim: int) -> None:
    """An embeddings request's `encoding_format` and `dimensions` (only the model's own `dim`); RowError names
    the field first."""
    if encoding_format not in ENCODING_FORMATS:
        raise RowError(f"encoding_format must be 'float' or 'base64', got {encoding_format!r}")
    if dimensions not in (None, dim):
        raise RowError(f"dimensions={dimensions!r}: this model's embeddings have {dim}")


def embedding_inputs(value: Any, what: str) -> list[str | list[int]]:
    """An embeddings request's `input` as a list of inputs: a string, a list of strings, a list of token ids, or
    a list of lists of token ids (OpenAI's four shapes). Empty texts, lists and token lists are refused."""
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if min(value) < 0:
            raise RowError(f"{what} holds the token id {min(value)}; token ids are >= 0")
        return [value]
    if not isinstance(value, list):
        return [check_text(value, what)]
    if not value:
        raise RowError(f"{what} is an empty list")
    inputs: list[str | list[int]] = []
    for index, item in enumerate(value):
        if isinstance(item, list):
            if not item or not all(_is_token_id(t) for t in item):
                raise RowError(f"{what}[{index}] must be a non-empty list of token ids (ints >= 0)")
            inputs.append(item)
        else:
            inputs.append(check_text(item, f"{what}[{index}]"))
    return inputs


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def embeddings_body(model: str, vectors: Sequence[Any], prompt_tokens: int, encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings response: an `embedding` object per vector, in order (a list of floats, or base64 of
    little-endian float32 bytes)."""
    data = [{"object": "embedding", "index": index, "embedding": embedding_data(vector, encoding_format)}
            for index, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def embedding_data(vector: Any, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


def response_line(line: int, envelope: Envelope, outcome: RowOutcome, model: str) -> str:
    request_id = f"batch_req_{line}"
    if outcome.failed:
        # Refused before any token (a bad line, a prompt too long, a constraint the grammar engine rejects): the
        # request was invalid. Failed after generating: the generation went wrong.
        refused = (outcome.output is None or isinstance(outcome.output, PoolingRequestOutput)
                   or not any(c.token_ids for c in outcome.output.outputs))
        code = "invalid_request" if refused else "generation_error"
        return json.dumps({"id": request_id, "custom_id": envelope.custom_id, "response": None,
                           "error": {"code": code, "message": f"line {line}: {outcome.error}"}})
    chat = envelope.url == CHAT_URL
    if envelope.url == EMBEDDINGS_URL:
        body = embeddings_body(model, [outcome.output.outputs.data], outcome.prompt_tokens,
                               envelope.body.get("encoding_format", "float"))
    else:
        body = response_body(f"{'chatcmpl' if chat else 'cmpl'}-{line}", chat, model, outcome.output.outputs,
                             outcome.prompt_tokens, outcome.top_logprobs)
    return json.dumps({"id": request_id, "custom_id": envelope.custom_id,
                       "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None})


def response_body(body_id: str, chat: bool, model: str, completions: Sequence[CompletionOutput], prompt_tokens: int,
                  top_logprobs: int | None, created: int | None = None) -> dict[str, Any]:
    """A `chat.completion` or `text_completion` body; each completion's `index` is its choice's (the server
    numbers the choices of several prompts prompt * n + sample). `top_logprobs`: the request's top-k, None when it
    asked for no logprobs."""
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "id": body_id, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created, "model": model,
        "choices": [chat_choice(c, top_logprobs) if chat else text_choice(c, top_logprobs) for c in completions],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_choice(completion: CompletionOutput, top_k: int | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": completion.text}
    if completion.reasoning is not None:  # a reasoning parser's split, named as vLLM's server names it
        message["reasoning_content"] = completion.reasoning
    return {"index": completion.index, "message": message, "logprobs": chat_logprobs(completion, top_k),
            "finish_reason": completion.finish_reason}


def chat_logprobs(completion: CompletionOutput, top_k: int | None) -> dict[str, Any] | None:
    """Chat's logprobs shape, {"content": [{token, logprob, bytes, top_logprobs}]}, or None when not asked for."""
    if top_k is None:
        return None
    return {"content": [
        {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode()),
         "top_logprobs": [{"token": a["token"], "logprob": a["logprob"], "bytes": list(a["token"].encode())}
                          for a in t["top_logprobs"]]}
        for t in token_logprobs(completion, top_k) or []]}


def text_choice(completion: CompletionOutput, top_k: int | None) -> dict[str, Any]:
    choice = {"index": completion.index, "text": completion.text, "logprobs": text_logprobs(completion, top_k),
              "finish_reason": completion.finish_reason}
    if completion.reasoning is not None:
        choice["reasoning_content"] = completion.reasoning
    return choice


def text_logprobs(completion: CompletionOutput, top_k: int | None, text_offset: int = 0) -> dict[str, Any] | None:
    """The completions logprobs shape, {tokens, token_logprobs, top_logprobs, text_offset}, or None when not asked
    for; `text_offset`: where the completion's first token starts (a streamed chunk continues its choice's text)."""
    if top_k is None:
        return None
    tokens = token_logprobs(completion, top_k) or []
    offsets, position = [], text_offset
    for t in tokens:
        offsets.append(position)
        position += len(t["token"])
    return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{a["token"]: a["logprob"] for a in t["top_logprobs"]} for t in tokens],
            "text_offset": offsets}
