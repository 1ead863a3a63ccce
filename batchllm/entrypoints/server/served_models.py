"""The models one server serves (`batchllm serve --model NAME=PATH`, repeatable), each on an engine of its own, and
the LoRA adapters beside them: a request's `model` picks one (the vLLM behaviour "different models selected per
request via the `model` parameter"). No `model` means the first (the default) model; an adapter's name runs its base
model's engine under that adapter; any other name is a 404 that names what is served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchllm.entrypoints.server.errors import APIError
from batchllm.entrypoints.server.image_chat import ImageChat
from batchllm.entrypoints.server.request_mapping import RequestMapper
from batchllm.lora.request import LoRARequest
from batchllm.model.config import ModelConfig, read_hf_config


@dataclass(slots=True)
class ServedModel:
    name: str
    engine: Any  # an EngineHandle
    adapters: dict[str, LoRARequest]
    mapper: RequestMapper

    @property
    def task(self) -> str:
        return self.engine.llm.task


class ServedModels:
    def __init__(self, models: Sequence[tuple[str, Any, Mapping[str, LoRARequest]]]) -> None:
        """`models`: (name, engine handle, adapters by name) each, the default model first."""
        if not models:
            raise ValueError("a server serves at least one model")
        self.models: list[ServedModel] = []
        seen: set[str] = set()
        for name, engine, adapters in models:
            for served in (name, *adapters):
                if served in seen:
                    raise ValueError(f"the name {served!r} is given to two models or adapters: each needs its own")
                seen.add(served)
            llm = engine.llm
            config = ModelConfig.from_hf_dict(read_hf_config(llm.model_path))
            images = ImageChat(name, config.architecture, None if config.vision is None else llm.image_prompts)
            mapper = RequestMapper(llm.tokenizer, llm.max_model_len, config.vocab_size, name, adapters, images)
            self.models.append(ServedModel(name, engine, dict(adapters), mapper))

    @classmethod
    def single(cls, engine: Any, name: str | None = None,
               adapters: Mapping[str, LoRARequest] | None = None) -> ServedModels:
        """One model (named after its directory unless `name` is given) and its adapters."""
        return cls([(name or engine.llm.model_path.name, engine, dict(adapters or {}))])

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    @property
    def engines(self) -> list[Any]:
        return [model.engine for model in self.models]

    def names(self) -> list[str]:
        """Every name a request's `model` may give: the models, then the adapters."""
        return [m.name for m in self.models] + [name for m in self.models for name in m.adapters]

    def route(self, model: str | None) -> tuple[ServedModel, LoRARequest | None]:
        """The served model that runs a request naming `model`, and the adapter it runs under; 404 otherwise."""
        if model is None:
            return self.default, None
        for served in self.models:
            if model == served.name:
                return served, None
            if model in served.adapters:
                return served, served.adapters[model]
        names = ", ".join(f"`{name}`" for name in self.names())
        raise APIError(404, f"The model `{model}` does not exist. This server serves: {names}.", param="model",
                       code="model_not_found")

    def parent_of(self, name: str) -> str | None:
        """The model an adapter belongs to; None for a model."""
        served, lora = self.route(name)
        return None if lora is None else served.name
