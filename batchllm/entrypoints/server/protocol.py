"""The request bodies of `/v1/completions`, `/v1/chat/completions` (OpenAI's fields plus vLLM's sampling
extensions) and `/v1/embeddings`, as pydantic models. A field the models do not know is refused (HTTP 400 naming
it), never ignored.

Shapes and ranges are checked here; what only the engine knows (the context length, the model's vocabulary, a
chat template that rejects the messages) is checked when the request is mapped (`request_mapping.py`). The
response bodies are built as plain dicts (`responses.py`), in OpenAI's shapes.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128
MAX_LOGPROBS = 20


class _Strict(BaseModel):
    # strict: "5" is not an int here (OpenAI refuses it too); ints are still accepted for floats.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None  # its shape is checked by connectors.constraints
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    # One prompt (text or token ids) or several; each gets n choices, numbered prompt * n + sample.
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [prompt]
        return list(prompt)

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]  # roles and content are checked by connectors.messages.check_messages
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class EmbeddingRequest(_Strict):
    # A string, a list of strings, a list of token ids or a list of lists of them: checked as a batch file's
    # /v1/embeddings line is (`connectors.jobs.openai_batch.embedding_inputs`), as are the two options.
    input: Any
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
