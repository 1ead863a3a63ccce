"""Multi-LoRA on a GPU, with the Triton kernels and the decode CUDA graphs (skipped without CUDA).

The CPU tests check every row against PEFT through the torch reference; here the question is whether the
graphs replay the adapters right: a mixed batch decoded from captured graphs must give the tokens of the same
engine run eagerly (`enforce_eager=True`: the same kernels, launched one by one), and base rows on an engine
with adapters enabled (the graphs then hold the LoRA kernels with empty segments) those of an engine without.
"""

from __future__ import annotations

import json

import pytest
import torch

from batchllm import LLM, LoRARequest, SamplingParams

SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
         "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
         "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "max_position_embeddings": 2048,
         "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    from batchllm.model.config import ModelConfig, read_hf_config
    from batchllm.model.lora_adapter import write_random_adapter

    directory = tmp_path_factory.mktemp("shape")  # SmolLM2-135M's shape, random weights (load_format="dummy")
    (directory / "config.json").write_text(json.dumps(SHAPE))
    config = ModelConfig.from_hf_dict(read_hf_config(directory))
    for seed in range(3):
        write_random_adapter(directory / f"adapter{seed}", config, rank=8, seed=seed, scale=0.05,
                             dtype=torch.float32)
    return directory


def _generate(llm, loras):
    prompts = [[100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(len(loras))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False,
                        lora_request=loras if llm.runner.lora is not None else None)
    return [o.outputs[0].token_ids for o in outs]


def test_graphs_replay_adapters_like_eager_steps_and_base_rows_like_a_base_engine(shape_dir):
    adapters = [LoRARequest(f"a{i}", i + 1, str(shape_dir / f"adapter{i}")) for i in range(3)]
    loras = [None if i % 4 == 3 else adapters[i % 3] for i in range(24)]
    common = dict(model=str(shape_dir), load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=512,
                  enable_lora=True, max_loras=2, dtype="float32")  # float32: the base matmuls' rounding may
    # differ between a padded graph batch and an eager one; bfloat16 would turn that into near-tie flips
    graphs = _generate(LLM(**common), loras)
    assert graphs == _generate(LLM(**common, enforce_eager=True), loras)
    base_rows = [i for i, lora in enumerate(loras) if lora is None]
    base = _generate(LLM(model=str(shape_dir), load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=512,
                         dtype="float32"),
                     [None] * len(loras))
    assert [graphs[i] for i in base_rows] == [base[i] for i in base_rows]
    assert any(graphs[i] != base[i] for i in range(len(loras)) if loras[i] is not None)  # the adapters count
