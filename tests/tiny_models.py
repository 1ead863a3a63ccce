"""Tiny random-weight Llamas with the default model's tokenizer, for door and bookkeeping tests whose point is
not the real weights' numerics (see `tiny_llama_dir` in tests/conftest.py, the session's shared one)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY_LLAMA = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.5, tie_word_embeddings=True)
# Heads and KV heads divisible by 3, for tensor parallelism over three ranks.
TINY_LLAMA_TP3 = {**TINY_LLAMA, "hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 6,
                  "num_key_value_heads": 3}


def write_random_llama(directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **config) -> Path:
    """A random Llama of `config` (LlamaConfig's fields) written by transformers in `dtype`, without a tokenizer (for
    engines with `skip_tokenizer_init=True`: the GPU machines have no default model to copy one from)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**config)).to(dtype).save_pretrained(directory)
    return directory


def write_tiny_llama(directory: Path, seed: int = 0, **config) -> Path:
    """A random Llama of `config` (TINY_LLAMA's fields) written by transformers, with the default model's tokenizer,
    chat template and generation config."""
    from batchllm.model.default_model import default_model_path

    write_random_llama(directory, seed, **config)
    for path in default_model_path().iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(path, directory / path.name)
    return directory
