"""Response bodies in OpenAI's shapes: whole `text_completion` / `chat.completion` bodies (the builders the Batch
API's output lines use, `connectors.jobs.openai_batch`), and the server-sent events of a streamed answer.

Streamed choices are numbered as whole ones are: prompt * n + sample. A chat stream opens each choice with
`{"role": "assistant", "content": ""}`; every update with text (or with logprobs, when asked for) is one chunk;
a choice's last chunk carries its finish_reason. With a reasoning parser, new reasoning travels as the delta's
`reasoning_content` (as vLLM's server sends it, and OpenAI-compatible clients read it) and only the answer as
`content`. With `stream_options.include_usage` a chunk with empty choices
and the usage comes last, before `data: [DONE]`.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from batchllm.connectors.jobs.openai_batch import chat_logprobs, response_body, text_logprobs, usage
from batchllm.entrypoints.server.request_stream import SampleUpdate
from batchllm.outputs import CompletionOutput, RequestOutput

DONE = "data: [DONE]\n\n"


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def full_body(chat: bool, model: str, outputs: list[RequestOutput], top_logprobs: int | None) -> dict[str, Any]:
    """The whole answer to a request whose prompts produced `outputs` (in prompt order)."""
    completions = [dataclasses.replace(c, index=p * len(output.outputs) + c.index)
                   for p, output in enumerate(outputs) for c in output.outputs]
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return response_body(new_id(chat), chat, model, completions, prompt_tokens, top_logprobs)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ChunkWriter:
    """The chunks of one streamed answer."""

    def __init__(self, chat: bool, model: str, n: int, top_logprobs: int | None) -> None:
        self.chat, self.model, self.n, self.top_logprobs = chat, model, n, top_logprobs
        self.id = new_id(chat)
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}  # completions logprobs: where each choice's next token starts

    def opening(self, num_prompts: int) -> list[str]:
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(num_prompts * self.n)]

    def update(self, prompt_index: int, update: SampleUpdate) -> str | None:
        """The chunk of one sample's update, or None when it shows nothing yet (text held back, partial bytes)."""
        wants_logprobs = self.top_logprobs is not None and update.token_ids
        if not (update.text or update.reasoning or update.finish_reason or wants_logprobs):
            return None
        index = prompt_index * self.n + update.index
        delta = CompletionOutput(index, update.text, update.token_ids, logprobs=update.logprobs)
        if self.chat:
            logprobs = chat_logprobs(delta, self.top_logprobs) if wants_logprobs else None
            message = {"content": update.text} if update.text else {}
            if update.reasoning:
                message["reasoning_content"] = update.reasoning
            choice = {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": update.finish_reason}
        else:
            logprobs = None
            if wants_logprobs:
                logprobs = text_logprobs(delta, self.top_logprobs, self._text_offsets.get(index, 0))
                self._text_offsets[index] = (logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                                             if logprobs["tokens"] else self._text_offsets.get(index, 0))
            choice = {"index": index, "text": update.text, "logprobs": logprobs, "finish_reason": update.finish_reason}
            if update.reasoning:
                choice["reasoning_content"] = update.reasoning
        return self._chunk(choice)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        return sse({"id": self.id, "object": self._object, "created": self.created, "model": self.model,
                    "choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    def error(self, message: str) -> str:
        return sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})

    @property
    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: dict[str, Any]) -> str:
        return sse({"id": self.id, "object": self._object, "created": self.created, "model": self.model,
                    "choices": [choice]})
