"""What the HTTP process knows of an engine that runs in another process: `RemoteLLM` quacks like the parts of `LLM`
that the routes, the Batch API and its JSONL job read (task, tokenizer, model_path, max_model_len, pooling_params,
embedding_dim, quantization, kv_cache_dtype, max_num_seqs, reasoning_parser, check_lora, encode_requests). The tokenizer
is loaded here, as the engine loads it: prompts are tokenized, and outputs detokenized, in the HTTP process; adapters
are checked here too (that needs the model's config only, and the engine was built alike).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from batchllm.entrypoints.llm_inputs import encode_requests
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
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser(reasoning_parser_name)  # outputs are split here, as detokenized
        self._adapters = adapters

    def check_lora(self, lora_request: LoRARequest) -> None:
        """`LLM.check_lora`: LoRAError (a ValueError) naming an adapter the engine cannot apply."""
        self._adapters.check_call(lora_request, 1)

    def encode_requests(self, requests: Iterable[tuple | None]) -> Iterator[tuple | None]:
        """`LLM.encode_requests`: (key, text, token ids, params, adapter) per item, tokenized as the stream pulls."""
        return encode_requests(requests, self.tokenizer, self.check_lora)
