"""What a job pins about its model in the manifest's fingerprint, and the tokenizer check made before generating.

The model is known by content, not location (a moved model directory still resumes its jobs). The
tokenizer counts separately: `LLM(tokenizer=...)` may load it from elsewhere, and a chat template added
or edited in place changes every chat prompt without touching config or weights.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

# Runtime settings of the backend tokenizer that a call may toggle; they do not change its encoding.
_TOKENIZER_RUNTIME = ("truncation", "padding")


def model_identity(model_path: Path) -> dict[str, Any]:
    config = model_path / "config.json"
    return {"name": model_path.name,
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None,
            "weights_bytes": sum(f.stat().st_size for f in model_path.glob("*.safetensors"))}


def quantization_identity(engine: Any) -> dict[str, Any] | None:
    """The engine's weight quantization, KV-cache dtype and `deterministic` when not the defaults (they change the
    outputs, so a job resumes only under the same ones); None otherwise, which keeps older manifests resumable.
    `deterministic` appears only when on, so a manifest written without it reads as before."""
    quantization, kv_cache_dtype = getattr(engine, "quantization", None), getattr(engine, "kv_cache_dtype", "auto")
    deterministic = getattr(engine, "deterministic", False)
    if quantization is None and kv_cache_dtype == "auto" and not deterministic:
        return None
    numerics = {"quantization": quantization, "kv_cache_dtype": kv_cache_dtype}
    return {**numerics, "deterministic": True} if deterministic else numerics


def tokenizer_identity(tokenizer: Any) -> dict[str, Any] | None:
    """Hashes of the tokenizer's definition (vocabulary, merges, normalization, special tokens) and of its
    chat template; None for an engine built without a tokenizer."""
    if tokenizer is None:
        return None
    template = tokenizer.chat_template
    return {"sha256": _definition_sha256(tokenizer.backend_tokenizer.to_str()),
            "chat_template_sha256": None if template is None else _sha256(json.dumps(template, sort_keys=True))}


@functools.lru_cache(maxsize=4)
def _definition_sha256(serialized: str) -> str:
    """The hash of a serialized definition in canonical form. Parsing and re-serializing a large vocabulary takes
    a few hundred milliseconds (llama3's 128k tokens), so each distinct definition is canonicalized once per
    process: later jobs on the same engine start that much sooner."""
    definition = json.loads(serialized)
    for key in _TOKENIZER_RUNTIME:
        definition.pop(key, None)
    return _sha256(json.dumps(definition, sort_keys=True))


def require_chat_template(engine: Any, why: str) -> None:
    """A ValueError before any generation when chat prompts are needed (`why`) and the tokenizer has no chat
    template: otherwise every row would fail on its own, and the job would 'succeed' with nothing but errors."""
    if getattr(engine.tokenizer, "chat_template", None) is None:
        raise ValueError(f"the model at {engine.model_path} has no chat template; {why} need one: use a chat "
                         f"(instruct) model, add a chat template to its tokenizer_config.json, or send plain-text "
                         f"prompts")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
