"""batchllm: throughput-first offline LLM batch inference."""

from batchllm.engine_client import EngineClient
from batchllm.engine_config import EngineConfig
from batchllm.entrypoints.api import embed, generate, run_job
from batchllm.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from batchllm.entrypoints.llm import LLM
from batchllm.lora.request import LoRARequest
from batchllm.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams
from batchllm.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "generate", "run_job", "embed",
           "PoolingParams", "PoolingRequestOutput", "EngineConfig", "EngineClient"]
__version__ = "0.1.0"
