"""Set for the whole test session, before any test module is imported.

Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. `triton.jit` reads
TRITON_INTERPRET when it decorates, and Triton's own library functions are decorated when `triton` is first
imported, which some test dependencies do at import (peft does): so it is set here, ahead of every module.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `python -m pytest` from the repo root puts the root first on sys.path, where kernels/ (installed as
# batchllm.kernels) shadows HF's `kernels` package, which transformers >= 5.25 imports. `make test` runs pytest's
# own script, which never puts it there; for `python -m pytest` it goes here, before a test imports transformers.
REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or os.getcwd()).resolve() != REPO]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama written by transformers (2 layers, hidden 64) with the default model's tokenizer
    and chat template: for the tests whose point is a door's or a job's bookkeeping (resume, signals, replicas,
    flags), where the 135M default model only costs time (each of its decode steps reads its 538 MB of weights).
    Large initial weights give clear greedy choices, so its outputs do not hinge on rounding."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from batchllm.model.default_model import default_model_path

    directory = tmp_path_factory.mktemp("models") / "tiny-llama"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.5, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(directory)
    for path in default_model_path().iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(path, directory / path.name)
    return directory
