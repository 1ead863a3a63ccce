"""Tokenizer loading and end-of-sequence ids, through transformers (local files only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Any one of these lets transformers build a tokenizer; without them it fails with a message naming no path.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The fast tokenizer in the directory `path`; FileNotFoundError / ValueError naming `path` when it has none."""
    from transformers import AutoTokenizer

    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); copy the "
                                f"checkpoint's tokenizer files into it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer in {path}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        raise ValueError(f"the tokenizer in {path} has no fast (tokenizers-backed) version; batchllm needs one")
    return tokenizer


def resolve_eos_token_ids(model_path: Path, tokenizer: Any) -> frozenset[int]:
    """EOS ids as HF `generate` would stop on them: generation_config.json, else config.json, else the
    tokenizer's EOS token."""
    for name in ("generation_config.json", "config.json"):
        file = Path(model_path) / name
        if file.exists():
            ids = _as_id_set(json.loads(file.read_text()).get("eos_token_id"))
            if ids:
                return ids
    return frozenset() if tokenizer is None else _as_id_set(tokenizer.eos_token_id)


def _as_id_set(value: int | list[int] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    return frozenset(int(v) for v in value)
