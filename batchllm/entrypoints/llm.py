"""The `LLM` facade: build the engine once, then generate for whole batches of prompts."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

from batchllm.engine.build import BuiltEngine, build_engine
from batchllm.engine_config import EngineConfig
from batchllm.entrypoints.admission_order import admission_order
from batchllm.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from batchllm.entrypoints.chat_prompts import render_conversations
from batchllm.entrypoints.engine_stream import stream_engine
from batchllm.entrypoints.llm_inputs import (
    Prompt,
    as_prompt_list,
    broadcast_params,
    encode_prompt,
    encode_requests,
    progress_bar,
    show_preemptions,
)
from batchllm.entrypoints.pooling import PoolingCalls
from batchllm.entrypoints.tokenize_ahead import can_tokenize_aside, tokenized_ahead
from batchllm.lora.registry import AdapterRegistry
from batchllm.lora.request import LoRARequest
from batchllm.multimodal.engine_limits import image_refusal
from batchllm.outputs import PoolingRequestOutput, RequestOutput
from batchllm.pooling_params import PoolingParams
from batchllm.reasoning import reasoning_parser
from batchllm.sampling_params import SamplingParams
from batchllm.stats import EngineStats
from batchllm.structured_outputs import StructuredOutputsParams

Messages = list[dict[str, Any]]
K = TypeVar("K")


class LLM(PoolingCalls):
    """An offline batch-inference engine for one model.

    Every argument is documented, checked and typed in `batchllm.engine_config` (`EngineConfig.from_kwargs`):
    parallelism, pooling tasks, step budgets, asynchronous scheduling, structured outputs, LoRA, quantization,
    speculative decoding and the host KV tier.
    """

    def __init__(self, model: str | Path | None = None, *, device: str = "auto", dtype: str = "auto",
                 max_model_len: int | None = None, block_size: int = 16, max_num_seqs: int | None = None,
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
                 normalize: bool | None = None, disable_hybrid_kv_cache_manager: bool = False,
                 reasoning_parser: str | None = None, enable_expert_parallel: bool = False,
                 admission_policy: str = "kv_aware", deterministic: bool = False,
                 allow_remote_media: bool = False, num_decode_steps: int = 1) -> None:
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
        self.deterministic = self.config.deterministic
        self.tokenizer = resolved.tokenizer
        self.reasoning_parser = reasoning_parser(self.config.reasoning_parser)
        structured = getattr(self.engine, "structured", None)
        if structured is not None:  # the grammar constrains the answer, after the reasoning
            structured.reasoning_parser = self.reasoning_parser
        self.reorder_by_prefix = self.config.reorder_by_prefix and self.config.cache.enable_prefix_caching
        lora = self.config.lora
        self._adapters = AdapterRegistry(resolved.model_config, lora.max_lora_rank, lora.enable_lora)
        self._model_config = resolved.model_config
        # Why images are refused though the model takes them (multimodal/engine_limits.py); None: they are not.
        self.image_refusal = (None if resolved.model_config.vision is None
                              else image_refusal(self.config, resolved.model_config))
        self._image_prompts: Any = None  # MultiModalPrompts, built on first use
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

    def get_tokenizer(self) -> Any:
        """The model's HF tokenizer (vLLM's accessor of `LLM.tokenizer`); None with `skip_tokenizer_init=True`."""
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.scheduler.config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        """The sequences a step runs at most: the user's, or what the engine chose (calibrated on CUDA)."""
        return self.engine.scheduler.config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        """The tokens a step computes at most: the user's, or what the engine chose."""
        return self.engine.scheduler.config.max_num_batched_tokens

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
        """Generate completions for `prompts` (strings, token-id lists, or dicts with images:
        `{"prompt": ..., "multi_modal_data": {"image": ...}}`, see `multimodal_prompts.py`); results come in
        input order. A row whose image does not load finishes with `finish_reason == "error"`; the others go on.

        Text prompts are tokenized in chunks while the engine runs on the first ones (`tokenize_ahead.py`).
        With `reorder_by_prefix` they are admitted in text order (token-id prompts ahead of them, in token order),
        so rows sharing a prefix run together.

        `lora_request`: the adapter of every prompt, or one per prompt (None: the base model); needs
        `enable_lora=True`. Every adapter is read and checked before generation (LoRAError names it)."""
        prompt_list = as_prompt_list(prompts)
        self._check_call_wide(sampling_params)
        params_list = broadcast_params(sampling_params, len(prompt_list))
        loras = self._adapters.check_call(lora_request, len(prompt_list))
        with_images = {i: prompt for i, prompt in enumerate(prompt_list) if isinstance(prompt, dict)}
        given = self.image_prompts().check(with_images) if with_images else {}
        encoded = [given[i] if i in given else self._encode(prompt, i, tokenize=False)
                   for i, prompt in enumerate(prompt_list)]
        texts = [text for text, _ in encoded]
        token_lists = [token_ids if text is None and i not in given else None for i, (text, token_ids) in
                       enumerate(encoded)]
        return self._run(texts, token_lists, params_list, use_tqdm, loras, images=with_images,
                         image_token_ids={i: ids for i, (_, ids) in given.items() if ids is not None})

    def image_prompts(self) -> Any:
        """Prompts with images → engine rows, for this model (built on first use: it loads the image processor)."""
        if self._image_prompts is None:
            from batchllm.entrypoints.multimodal_prompts import MultiModalPrompts  # Pillow, only for images

            self._image_prompts = MultiModalPrompts(self.model_path, self._model_config, self.tokenizer,
                                                    self.config.allow_remote_media, self.image_refusal)
        return self._image_prompts

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
        """`stream`'s items as (key, text, token ids, params, adapter), tokenized as the stream pulls."""
        return encode_requests(requests, self.tokenizer, self.check_lora, self._prepare_image_prompt)

    def _prepare_image_prompt(self, index: int, prompt: dict) -> Any:
        self.image_prompts().check({index: prompt})
        return self.image_prompts().prepare({index: prompt})[index]

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (once per adapter); raises LoRAError (a ValueError) naming it, or
        ValueError if the LLM was built without enable_lora=True."""
        self._adapters.check_call(lora_request, 1)

    def _stream(self, requests: Iterator[tuple[K, str | None, list[int], SamplingParams, LoRARequest | None] | None],
                max_in_flight: int | None, stop: Callable[[], bool] | None = None
                ) -> Iterator[tuple[K, RequestOutput | PoolingRequestOutput]]:
        """Items whose params are `PoolingParams` (this LLM's `pooling_params`, on a pooling task) are pooled and
        come back as `PoolingRequestOutput`s (`batchllm/entrypoints/engine_stream.py`)."""
        return stream_engine(self, requests, max_in_flight, stop)

    def _check_pooling_item(self, params: Any) -> None:
        if self.task == "generate":
            raise ValueError("a pooling request (PoolingParams) needs an LLM built with task='embed', 'classify' or "
                             "'score'")
        if not isinstance(params, PoolingParams):
            raise ValueError(f"this LLM was built with task={self.task!r}: it does not generate; call "
                             f"{'classify' if self.task == 'classify' else 'embed'}() (or build it with "
                             f"task='generate')")

    def _encode(self, prompt: Prompt, index: int, tokenize: bool = True) -> tuple[str | None, list[int]]:
        return encode_prompt(self.tokenizer, prompt, index, tokenize)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations, each rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts, images = render_conversations(self.tokenizer, conversations, chat_template, add_generation_prompt)
        if images:
            self.image_prompts().check(images)
        self._check_call_wide(sampling_params)
        params_list = broadcast_params(sampling_params, len(prompts))
        # The template already contains the special tokens (BOS etc.), so do not add them a second time.
        return self._run(list(prompts), [None] * len(prompts), params_list, use_tqdm, add_special_tokens=False,
                         images=images)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search per prompt (strings or token ids), with HF transformers' selection and stopping rules;
        see `batchllm.entrypoints.beam_search`. Beams share their history's K/V through the prefix cache."""
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
             add_special_tokens: bool = True, images: dict[int, dict] | None = None,
             image_token_ids: dict[int, list[int]] | None = None) -> list[RequestOutput]:
        """Every prompt through the engine; a None in `token_lists` is a text to tokenize, which happens while the
        engine runs on the first rows (`tokenize_ahead.py`). `images`: the rows given as dicts with images (their
        `token_lists` entry None), whose images are decoded and processed the same way, chunk by chunk, while the
        engine runs; `image_token_ids`: those of them given as token ids (their admission-order key)."""
        if self.tokenizer is None and any(p.stop_strings for p in params_list):
            raise ValueError("stop strings need a tokenizer (the LLM was built with skip_tokenizer_init=True)")
        loras = loras or [None] * len(token_lists)
        images, image_token_ids = images or {}, image_token_ids or {}
        extras: list[tuple | None] = [None] * len(token_lists)  # a row with images: (its images, its error)
        if all(token_ids is not None for token_ids in token_lists):
            ready: Iterable[tuple[int, list[int]] | None] = (
                (i, token_lists[i]) for i in self.admission_order(token_lists, loras))
        else:
            # Texts are ordered by their text, which groups shared prefixes as token order does, so that order is
            # known before they are tokenized; rows given as ids sort ahead of them.
            keys = [(0, image_token_ids[i]) if i in image_token_ids else (1, texts[i]) if token_ids is None
                    else (0, token_ids) for i, token_ids in enumerate(token_lists)]

            def tokenize(rows: Sequence[int]) -> list[list[int]]:
                prepared = {}
                if images:
                    prepared = self.image_prompts().prepare({i: images[i] for i in rows if i in images},
                                                            add_special_tokens)
                    for i, row in prepared.items():
                        extras[i] = (row.mm, row.error)
                pending = [i for i in rows if token_lists[i] is None and i not in prepared]
                batch = iter(self.tokenizer([texts[i] for i in pending], add_special_tokens=add_special_tokens)
                             ["input_ids"] if pending else [])
                return [prepared[i].token_ids if i in prepared else next(batch) if token_lists[i] is None
                        else token_lists[i] for i in rows]

            # Rows with images decode and preprocess on the worker too (Pillow and numpy release the GIL).
            aside = can_tokenize_aside(self.tokenizer) if self.tokenizer is not None or not images else True
            ready = tokenized_ahead(self.admission_order(keys, loras), tokenize, self.engine.has_unfinished, aside)
        items = (None if item is None else (item[0], texts[item[0]], item[1], params_list[item[0]], loras[item[0]],
                                            *((extras[item[0]],) if extras[item[0]] else ()))
                 for item in ready)
        outputs: list[RequestOutput | None] = [None] * len(token_lists)
        progress = progress_bar(len(token_lists), use_tqdm)
        try:
            for index, output in self._stream(items, max_in_flight=None):
                outputs[index] = output
                if progress is not None:
                    progress.update(1)
                    show_preemptions(progress, self.engine.scheduler.stats)
        finally:
            if progress is not None:
                progress.close()
        return outputs  # type: ignore[return-value]  (every slot is filled once the stream ends)

    def admission_order(self, token_lists: Sequence[Any],
                        loras: Sequence[LoRARequest | None] | None = None) -> list[int]:
        """The order a whole batch is admitted in (`admission_order.py`): by prefix (of the token lists, or of
        the texts), and by adapter first. Results still come back in input order."""
        return admission_order(token_lists, loras, self.reorder_by_prefix)

    def has_unfinished(self) -> bool:
        """Whether requests of a stream are in the engine (a request source may pause admission only then)."""
        return self.engine.has_unfinished()
