"""What the HTTP process knows of an engine that runs in another process: `RemoteLLM` quacks like the parts of `LLM`
that the routes, the Batch API and its JSONL job read (task, tokenizer, model_path, max_model_len, pooling_params,
embedding_dim, quantization, kv_cache_dtype, max_num_seqs, reasoning_parser, check_lora, image_prompts). The
tokenizer is loaded here, as the engine loads it: prompts are tokenized, and outputs detokenized, in the HTTP process;
adapters are checked here too (that needs the model's config only, and the engine was built alike); images are
decoded and preprocessed here too (the model's image processor, loaded on first use): the prepared `MultiModalPrompt`
crosses to the engine with the prompt's token ids.
"""

from __future__ import annotations

from typing import Any

from batchllm.entrypoints.server.engine_protocol import EngineInfo
from batchllm.lora.registry import AdapterRegistry
from batchllm.lora.request import LoRARequest
from batchllm.reasoning import reasoning_parser


class RemoteLLM:
    def __init__(self, info: EngineInfo, tokenizer: Any, adapters: AdapterRegistry,
                 reasoning_parser_name: str | None = None) -> None:
        self.model_path = info.model_path
        self.task = info.task
        self.max_model_len = info.max_model_len
        self.pooling_params = info.pooling_params
        self.embedding_dim = info.embedding_dim
        self.quantization = info.quantization
        self.kv_cache_dtype = info.kv_cache_dtype
        self.num_blocks = info.num_blocks
        self.max_num_seqs = info.scheduler_config.max_num_seqs
        self.allow_remote_media = info.allow_remote_media
        self.image_refusal = info.image_refusal
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser(reasoning_parser_name)  # outputs are split here, as detokenized
        self._adapters = adapters
        self._image_prompts: Any = None

    def check_lora(self, lora_request: LoRARequest) -> None:
        """`LLM.check_lora`: LoRAError (a ValueError) naming an adapter the engine cannot apply."""
        self._adapters.check_call(lora_request, 1)

    def image_prompts(self) -> Any:
        """`LLM.image_prompts`: the model's `MultiModalPrompts` (built on first use: it loads the image processor;
        two threads that both build one get equal ones)."""
        if self._image_prompts is None:
            from batchllm.entrypoints.multimodal_prompts import MultiModalPrompts  # Pillow, only for images
            from batchllm.model.config import ModelConfig

            self._image_prompts = MultiModalPrompts(self.model_path, ModelConfig.from_dir(self.model_path),
                                                    self.tokenizer, self.allow_remote_media, self.image_refusal)
        return self._image_prompts
