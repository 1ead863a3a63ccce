"""Checks of a speculative proposer against the target model, made before any weights load."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from batchllm.engine.speculative.config import DRAFT_MODEL, EAGLE, EAGLE3, MEDUSA, SpeculativeConfig
from batchllm.model.config import ModelConfig, read_hf_config
from batchllm.model.eagle import eagle3_aux_layers, read_eagle_config
from batchllm.model.medusa import read_medusa_config


def check_speculative_model(config: SpeculativeConfig, target_path: Path, tensor_parallel_size: int) -> None:
    """Raise ValueError, saying why, when the proposer cannot serve the target model."""
    if not config.on_device:
        return
    if tensor_parallel_size > 1:
        raise ValueError(f"speculative_config: method {config.method!r} does not run under tensor parallelism yet "
                         f"(tensor_parallel_size={tensor_parallel_size}); 'ngram' does")
    target = ModelConfig.from_hf_dict(read_hf_config(target_path))
    path = Path(config.model).expanduser()
    if not path.is_dir():
        raise ValueError(f"speculative_config: model {config.model!r} is not a directory")
    if config.method == MEDUSA:
        heads = read_medusa_config(path)
        _same("hidden_size", heads["hidden_size"], target.hidden_size, "the Medusa heads have")
        _same("vocab_size", heads["vocab_size"], target.vocab_size, "the Medusa heads have")
        return
    if config.method in (EAGLE, EAGLE3):
        _check_eagle(config.method, path, target)
        return
    assert config.method == DRAFT_MODEL
    draft = ModelConfig.from_hf_dict(read_hf_config(path))
    _same("vocab_size", draft.vocab_size, target.vocab_size, "the draft model has")
    draft_tokenizer, target_tokenizer = _tokenizer_digest(path), _tokenizer_digest(target_path)
    if draft_tokenizer != target_tokenizer:
        raise ValueError(f"speculative_config: the draft model's tokenizer ({path}) differs from the target's "
                         f"({target_path}): a draft must share the target's vocabulary token for token")


def _check_eagle(method: str, path: Path, target: ModelConfig) -> None:
    head, raw = read_eagle_config(path, method)
    subject = f"the {method} head has"
    _same("vocab_size", head.vocab_size, target.vocab_size, subject)
    if method == EAGLE:
        _same("hidden_size", head.hidden_size, target.hidden_size, subject)
        return
    _same("target_hidden_size", raw.get("target_hidden_size", head.hidden_size), target.hidden_size, subject)
    if not 0 < raw["draft_vocab_size"] <= target.vocab_size:
        raise ValueError(f"speculative_config: draft_vocab_size={raw['draft_vocab_size']} is not in "
                         f"[1, {target.vocab_size}], the target's vocabulary")
    layers = eagle3_aux_layers(target.num_layers)
    if len(layers) != 3 or not all(0 <= layer < target.num_layers for layer in layers):
        raise ValueError(f"speculative_config: EAGLE-3 fuses three distinct target layers; a target of "
                         f"{target.num_layers} layers has too few")


def _same(name: str, value: int, target: int, subject: str) -> None:
    if value != target:
        raise ValueError(f"speculative_config: {subject} {name}={value}, the target model {name}={target}")


def _tokenizer_digest(path: Path) -> str | None:
    """A digest of the vocabulary and merges in tokenizer.json (None when there is none: nothing to compare)."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    model = json.loads(file.read_text(encoding="utf-8")).get("model", {})
    return hashlib.sha256(json.dumps([model.get("vocab"), model.get("merges")], sort_keys=True).encode()).hexdigest()
