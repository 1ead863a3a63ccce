"""How an `LLM(task="embed" | "classify" | "score")` pools: from the model directory, or the caller's override.

Embedding checkpoints in sentence-transformers layout say how they pool in `modules.json` (a `Pooling` module,
whose `config.json` sets one `pooling_mode_*`) and whether they normalize (a `Normalize` module). Without that
layout an embedding model pools the last token and normalizes (the convention of Llama-family embedding models,
e5-mistral and Qwen3-Embedding among them). A classifier (`*ForSequenceClassification`) reads its last token.
"""

from __future__ import annotations

import json
from pathlib import Path

from batchllm.model.config import ModelConfig
from batchllm.pooling_params import POOLING_TYPES, TASKS, PoolingParams

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


def sentence_transformers_pooling(path: Path) -> tuple[str | None, bool | None]:
    """(pooling, normalize) as `modules.json` says; (None, None) for a directory without it."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = json.loads(modules_file.read_text())
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    pooling = None
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config = json.loads((path / module.get("path", "") / "config.json").read_text())
            unsupported = [mode for mode in _UNSUPPORTED_MODES if config.get(mode)]
            if unsupported:
                raise ValueError(f"{path}: sentence-transformers pooling {unsupported[0]!r} is not supported "
                                 f"(batchllm pools {', '.join(POOLING_TYPES)}); pass pooling= to choose one")
            chosen = [name for mode, name in _MODES.items() if config.get(mode)]
            if len(chosen) != 1:
                raise ValueError(f"{path}: its Pooling module sets {len(chosen)} of the pooling modes batchllm reads "
                                 f"({', '.join(_MODES)}); pass pooling= to choose one")
            pooling = chosen[0]
    return pooling, normalize


def pooled_dim(config: ModelConfig, params: PoolingParams | None) -> int:
    """The length of a pooled vector: the classifier's labels, or the hidden size (0 for generation)."""
    if params is None:
        return 0
    return config.num_labels if params.classify else config.hidden_size


def resolve_pooling(path: Path, config: ModelConfig, task: str, pooling: str | None,
                    normalize: bool | None) -> PoolingParams | None:
    """The pooling of an LLM's task (None for "generate"); errors name the argument."""
    if task not in TASKS:
        raise ValueError(f"LLM argument task must be one of {', '.join(map(repr, TASKS))}, got {task!r}")
    if pooling is not None and pooling not in POOLING_TYPES:
        raise ValueError(f"LLM argument pooling must be None or one of {', '.join(map(repr, POOLING_TYPES))}, "
                         f"got {pooling!r}")
    if normalize not in (None, True, False):
        raise ValueError(f"LLM argument normalize must be None, True or False, got {normalize!r}")
    if task == "generate":
        if pooling is not None or normalize is not None:
            raise ValueError("LLM arguments pooling and normalize need task='embed', 'classify' or 'score'")
        if config.num_labels:
            raise ValueError(f"{path} is a sequence-classification model ({config.architecture}): it cannot "
                             f"generate; use task='classify' (or 'score' for a one-label cross-encoder)")
        return None
    if task == "classify" or (task == "score" and config.num_labels):
        if not config.num_labels:
            raise ValueError(f"task={task!r} needs a sequence-classification checkpoint (*ForSequenceClassification "
                             f"with a `score` head); {path} is a {config.architecture}: use task='embed'")
        if task == "score" and config.num_labels != 1:
            raise ValueError(f"task='score' needs a cross-encoder with one label; {path} has {config.num_labels} "
                             f"(classify it with task='classify')")
        return PoolingParams(pooling or "last", bool(normalize), classify=True)
    found, found_normalize = sentence_transformers_pooling(path)
    default_normalize = True if found_normalize is None else found_normalize
    return PoolingParams(pooling or found or "last", default_normalize if normalize is None else normalize)
