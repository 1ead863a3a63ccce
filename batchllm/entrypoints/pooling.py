"""`LLM.embed`, `LLM.classify` and `LLM.score`: prompts through the engine's prefill path, pooled, nothing generated.

Each input is one engine request whose prompt is computed (chunked under the token budget like any prompt) and
pooled on the device (executor/pooler.py); its K/V blocks are freed as soon as its prompt is done. Results come
back as one float32 matrix (`embed_matrix`, which the table connectors write without a Python object per row) or
as vLLM-style `PoolingRequestOutput`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from batchllm.engine.request import Request
from batchllm.entrypoints.llm_inputs import Prompt, as_prompt_list, progress_bar
from batchllm.lora.request import LoRARequest
from batchllm.outputs import ClassificationOutput, EmbeddingOutput, PoolingRequestOutput, ScoringOutput
from batchllm.sampling_params import SamplingParams

TRUNCATE = ("right", "left", None)
NO_SAMPLING = SamplingParams(max_tokens=1)  # a pooling request samples nothing; the engine wants params


class PoolingCalls:
    """Mixed into `LLM`, which provides `engine`, `tokenizer`, `task`, `pooling_params`, `embedding_dim`,
    `_encode` and `_stream`."""

    def embed(self, prompts: Prompt | Sequence[Prompt], *, prompt_template: str | None = None,
              truncate: str | None = "right", use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`), in input order. `prompt_template`, e.g.
        "Instruct: find the answer\\nQuery: {text}", wraps each text prompt. `truncate`: a prompt longer than
        max_model_len keeps its first ("right", the default) or last ("left") max_model_len tokens, or (None)
        fails with an error naming its length. A failed prompt has `error` set and `outputs` None."""
        self._require_task(("embed", "score"), "embed")
        texts, token_lists = self._pooling_inputs(prompts, prompt_template, truncate)
        matrix, errors = self._pool(token_lists, use_tqdm, lora_request)
        return [_output(i, texts[i], token_lists[i], None if errors[i] else EmbeddingOutput(matrix[i]), errors[i])
                for i in range(len(token_lists))]

    def embed_matrix(self, prompts: Sequence[Prompt], *, prompt_template: str | None = None,
                     truncate: str | None = "right", use_tqdm: bool = False,
                     lora_request: LoRARequest | None = None) -> tuple[np.ndarray, list[str | None]]:
        """`embed` as one float32 matrix [len(prompts), dim] (a failed row holds zeros) and each row's error."""
        self._require_task(("embed", "score"), "embed")
        _, token_lists = self._pooling_inputs(prompts, prompt_template, truncate)
        return self._pool(token_lists, use_tqdm, lora_request)

    def classify(self, prompts: Prompt | Sequence[Prompt], *, prompt_template: str | None = None,
                 truncate: str | None = "right", use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The classification head's logits per prompt (`outputs.logits`, `outputs.probs`), in input order."""
        self._require_task(("classify",), "classify")
        texts, token_lists = self._pooling_inputs(prompts, prompt_template, truncate)
        matrix, errors = self._pool(token_lists, use_tqdm, None)
        return [_output(i, texts[i], token_lists[i], None if errors[i] else ClassificationOutput(matrix[i]),
                        errors[i]) for i in range(len(token_lists))]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *, truncate: str | None = "right",
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """A score per pair: one `text_1` against each of `text_2`, or the lists pair by pair. An embedding model
        scores the cosine of the two embeddings; a one-label cross-encoder (task="score") the sigmoid of its logit
        for the pair, encoded as the tokenizer encodes text pairs."""
        self._require_task(("score", "embed"), "score")
        firsts, seconds = _pairs(text_1, text_2)
        if self.pooling_params.classify:  # a cross-encoder reads both texts at once
            token_lists = [self._fit(self.tokenizer(a, b)["input_ids"], truncate) for a, b in zip(firsts, seconds)]
            logits, errors = self._pool(token_lists, use_tqdm, None)
            scores = 1 / (1 + np.exp(-logits[:, 0]))
        else:
            _, token_lists = self._pooling_inputs(firsts + seconds, None, truncate)
            vectors, errors = self._pool(token_lists, use_tqdm, None)
            a, b = vectors[: len(firsts)], vectors[len(firsts):]
            norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
            scores = (a * b).sum(axis=1) / np.where(norms == 0, 1, norms)
            errors = [x or y for x, y in zip(errors[: len(firsts)], errors[len(firsts):])]
            token_lists = token_lists[: len(firsts)]
        return [_output(i, firsts[i], token_lists[i], None if errors[i] else ScoringOutput(float(scores[i])),
                        errors[i]) for i in range(len(firsts))]

    def _require_task(self, tasks: tuple[str, ...], call: str) -> None:
        if self.task not in tasks:
            raise ValueError(f"LLM.{call}() needs an LLM built with task={' or '.join(map(repr, tasks))}; this one "
                             f"has task={self.task!r}")
        if call == "embed" and self.pooling_params.classify:
            raise ValueError("LLM.embed() needs an embedding model; this one is a cross-encoder (its pooled vector is "
                             "its classification head's logit): call score()")

    def _pooling_inputs(self, prompts: Prompt | Sequence[Prompt], prompt_template: str | None,
                        truncate: str | None) -> tuple[list[str | None], list[list[int]]]:
        if truncate not in TRUNCATE:
            raise ValueError(f"truncate must be 'right', 'left' or None, got {truncate!r}")
        if prompt_template is not None and "{text}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{text}}', got {prompt_template!r}")
        prompt_list = as_prompt_list(prompts)
        texts: list[str | None] = []
        token_lists: list[list[int] | None] = []
        for index, prompt in enumerate(prompt_list):
            if isinstance(prompt, str) and prompt_template is not None:
                prompt = prompt_template.replace("{text}", prompt)
            text, token_ids = self._encode(prompt, index, tokenize=False)
            texts.append(text)
            token_lists.append(None if text is not None else token_ids)
        text_rows = [i for i, ids in enumerate(token_lists) if ids is None]
        if text_rows:  # one call: the fast tokenizer encodes a batch on its own threads
            for i, ids in zip(text_rows, self.tokenizer([texts[i] for i in text_rows])["input_ids"]):
                token_lists[i] = ids
        return texts, [self._fit(ids, truncate) for ids in token_lists]

    def _fit(self, token_ids: list[int], truncate: str | None) -> list[int]:
        limit = self.max_model_len
        if truncate is None or len(token_ids) <= limit:
            return token_ids
        return token_ids[:limit] if truncate == "right" else token_ids[-limit:]

    def _pool(self, token_lists: list[list[int]], use_tqdm: bool, lora_request: LoRARequest | None
              ) -> tuple[np.ndarray, list[str | None]]:
        """Every prompt through the engine (`LLM.stream`, all admitted before the first step): a matrix of the
        pooled vectors in input order (zeros where a prompt failed) and each row's error."""
        params = self.pooling_params
        matrix = np.zeros((len(token_lists), self.embedding_dim), dtype=np.float32)
        errors: list[str | None] = [None] * len(token_lists)
        items = ((index, None, token_ids, params, lora_request) for index, token_ids in enumerate(token_lists))
        progress = progress_bar(len(token_lists), use_tqdm)
        try:
            for index, output in self._stream(items, max_in_flight=None):
                if output.error is None:
                    matrix[index] = output.outputs.data
                errors[index] = output.error
                if progress is not None:
                    progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        return matrix, errors


def _pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> tuple[list[str], list[str]]:
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1 and len(seconds) > 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"score() pairs text_1 with text_2: got {len(firsts)} and {len(seconds)} texts (one text_1 "
                         f"goes with every text_2)")
    return firsts, seconds


def _output(index: int, text: str | None, token_ids: list[int], outputs: Any, error: str | None
            ) -> PoolingRequestOutput:
    return PoolingRequestOutput(str(index), text, token_ids, outputs, error=error)


def pooling_output(request: Request, text: str | None, token_ids: list[int]) -> PoolingRequestOutput:
    """A finished pooling request as its output: an embedding, or a classification's logits."""
    if request.error is not None:
        return PoolingRequestOutput(request.request_id, text, token_ids, None, error=request.error)
    result = ClassificationOutput(request.pooled) if request.pooling.classify else EmbeddingOutput(request.pooled)
    return PoolingRequestOutput(request.request_id, text, token_ids, result)
