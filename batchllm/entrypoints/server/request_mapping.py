"""A validated HTTP request → what the engine runs: prompt token ids, SamplingParams and the adapter.

Sampling fields map exactly as in an OpenAI batch file (`connectors.jobs.openai_batch.sampling_params`, with
`response_format` through `connectors.constraints`), so a request means the same over HTTP and in a batch.
Prompts are tokenized as `LLM.generate` (text) and `LLM.chat` (messages, through `PromptEncoder.render_chat`)
do, so the server's greedy answers equal theirs; messages with image content parts are rendered and their images
prepared as `LLM.chat` does (`image_chat.py`). Runs on the event loop's thread (a chat with images on a worker
thread: `app.py`): tokenizing one request is quick, and nothing here touches the engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchllm.connectors.cells import RowError
from batchllm.connectors.jobs.openai_batch import sampling_params
from batchllm.connectors.prompts import PromptEncoder
from batchllm.entrypoints.chat_prompts import has_image_parts
from batchllm.entrypoints.server.errors import APIError, bad_request
from batchllm.entrypoints.server.image_chat import ImageChat
from batchllm.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from batchllm.lora.request import LoRARequest
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.sampling_params import SamplingParams

# Fields that are not sampling parameters: the batch mapping must not see them.
_NOT_SAMPLING = {"model", "user", "stream", "stream_options", "prompt", "messages"}
_COMPLETION_DEFAULTS = SamplingParams(max_tokens=16)  # OpenAI's default for /v1/completions
_CHAT_DEFAULTS = SamplingParams(max_tokens=None)  # chat: up to the context length
_FIELD = re.compile(r"^([a-z_]+)")


@dataclass(slots=True)
class EngineInputs:
    prompts: list[tuple[str | None, list[int]]]  # (text, token ids) per prompt
    params: SamplingParams
    lora_request: LoRARequest | None
    top_logprobs: int | None  # the top-k per token the response shows; None: no logprobs
    model: str  # the name the response gives
    images: list[MultiModalPrompt | None] | None = None  # per prompt, for a chat with image parts


class RequestMapper:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, model_name: str,
                 loras: Mapping[str, LoRARequest], image_chat: ImageChat | None = None) -> None:
        """`image_chat`: how this model takes chat image parts (None: it refuses them as a text-only model)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.loras = dict(loras)
        self.image_chat = image_chat or ImageChat(model_name, None, None)
        self._encoder = PromptEncoder(tokenizer, max_model_len, "error")

    def completion(self, request: CompletionRequest) -> EngineInputs:
        lora = self.adapter_of(request.model)
        params = self._params(request, chat=False)
        prompts = request.prompts()
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        encoded = []
        for prompt in prompts:
            if isinstance(prompt, str):
                encoded.append((prompt, self.tokenizer(prompt)["input_ids"]))
            else:
                bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise bad_request(f"prompt holds the token id {bad}, outside the vocabulary [0, "
                                      f"{self.vocab_size})", "prompt")
                encoded.append((None, list(prompt)))
        for _, token_ids in encoded:
            self._check_length(len(token_ids), params.max_tokens, "prompt")
        return EngineInputs(encoded, params, lora, request.logprobs, request.model or self.model_name)

    def chat(self, request: ChatCompletionRequest) -> EngineInputs:
        lora = self.adapter_of(request.model)
        params = self._params(request, chat=True)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        mm = None
        if has_image_parts(request.messages):
            text, token_ids, mm = self.image_chat.prepare(request.messages, self.tokenizer)
        else:
            try:
                text = self._encoder.render_chat(request.messages).text
            except RowError as exc:
                raise bad_request(str(exc), "messages") from None
            # The template already holds the special tokens (BOS etc.): none are added again, as LLM.chat does.
            token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self._check_length(len(token_ids), params.max_tokens, "messages")
        top_k = (request.top_logprobs or 0) if request.logprobs else None
        return EngineInputs([(text, token_ids)], params, lora, top_k, request.model or self.model_name, [mm])

    def adapter_of(self, model: str | None) -> LoRARequest | None:
        """None for the base model (its name, or no name); an adapter's LoRARequest; 404 for anything else."""
        if model is None or model == self.model_name:
            return None
        if model in self.loras:
            return self.loras[model]
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _params(self, request: CompletionRequest | ChatCompletionRequest, chat: bool) -> SamplingParams:
        body = request.model_dump(exclude_none=True, exclude=_NOT_SAMPLING)
        try:
            return sampling_params(body, _CHAT_DEFAULTS if chat else _COMPLETION_DEFAULTS, chat)
        except RowError as exc:
            message = str(exc)
            match = _FIELD.match(message)
            param = match.group(1) if match and match.group(1) in type(request).model_fields else None
            raise bad_request(message, param) from None

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        if num_prompt_tokens == 0:
            raise bad_request(f"{param} is empty (0 tokens)", param)
        requested = num_prompt_tokens + (max_tokens or 1)
        if requested > self.max_model_len:
            completion = "at least 1" if max_tokens is None else str(max_tokens)
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{requested} tokens ({num_prompt_tokens} in the {param}, {completion} in the completion). Please "
                f"reduce the length of the {param} or of max_tokens.", param, code="context_length_exceeded")
