"""Model shapes of shared/bench/WORKLOADS.md as HF config directories, for random-weight runs.

`make_shape_dir(name)` writes a config.json (and generation_config.json) that `LLM(model=dir,
load_format="dummy", skip_tokenizer_init=True)` and HF (`AutoConfig`) both read, so no weights or tokenizer
have to travel to the GPU machine. Shapes are Llama's unless they name another family.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
                      max_position_embeddings=8192),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
                       max_position_embeddings=8192),
    # Gemma 3 12B's text model: 5 window layers (1,024 tokens) to each global one, head_dim 256, a 262k vocabulary.
    "gemma3-12b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=3840,
                       intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, vocab_size=262208, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                       rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=256,
                       sliding_window=1024, layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                         for i in range(48)],
                       hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position_embeddings=131072),
    # Qwen3-30B-A3B: 48 layers of 128 experts (top-8, 768 features each), q/k norms, 4 KV heads of 128.
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                          max_position_embeddings=40960),
    # gpt-oss-20b: 24 layers alternating a 128-token window and full attention, sinks, 32 experts (top-4), YaRN.
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880,
                        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
                        rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                           "beta_slow": 1.0, "truncate": False,
                                                           "original_max_position_embeddings": 4096},
                        swiglu_limit=7.0, attention_bias=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        max_position_embeddings=131072),
    # Qwen2.5-VL-7B: Qwen2-7B's decoder with multimodal RoPE (sections 16/24/24) and a 32-block ViT (windows of
    # 112 pixels, full attention every 8th block) whose 2x2 merged patches become 3,584-wide embeddings.
    "qwen2.5-vl-7b": dict(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl",
                          text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                           num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                           max_position_embeddings=128000, rms_norm_eps=1e-6,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                            "mrope_section": [16, 24, 24]}),
                          vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                             out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                                             temporal_patch_size=2, window_size=112,
                                             fullatt_block_indexes=[7, 15, 23, 31]),
                          image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                          vision_end_token_id=151653, tie_word_embeddings=False),
    # Not a workload shape: Qwen2.5-VL's layout at toy widths, for trying the image benchmarks on the CPU.
    "tiny-vl": dict(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl",
                    text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=152064, max_position_embeddings=8192,
                                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                         "mrope_section": [2, 3, 3]}),
                    vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                                       fullatt_block_indexes=[1]),
                    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653, tie_word_embeddings=True),
    # Not a workload shape: so small that on the CPU a step's time is the host's Python, for host_profile.py.
    "tiny-host": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2048, rope_theta=10000.0, tie_word_embeddings=True,
                      max_position_embeddings=8192),
}


def shape_config(name: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", **SHAPES[name]}


def hf_config(name: str):
    """The shape as an HF config object of its family (for HF's own model of it)."""
    from transformers import AutoConfig

    config = {k: v for k, v in shape_config(name).items() if k != "architectures"}
    return AutoConfig.for_model(config.pop("model_type"), **config)


def head_dim(name: str) -> int:
    s = SHAPES[name]
    return s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]


def make_shape_dir(name: str, root: Path | None = None) -> Path:
    directory = Path(root or tempfile.mkdtemp(prefix="batchllm-shape-")) / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape_config(name), indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return directory


def write_random_checkpoint(name: str, root: Path | None = None, device: str = "cpu") -> Path:
    """A shape with random bf16 weights (transformers' own initialization) saved as a safetensors checkpoint, for
    runs whose peer must load the very same weights (benchmarks/embeddings.py). Built on `device`: an 8B shape
    initializes in seconds on a GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = make_shape_dir(name, root)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.bfloat16).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model
    return directory


def num_params(name: str, active: bool = False) -> int:
    """All parameters, or (`active`) those one token multiplies: a MoE layer's top-k experts and its router."""
    s = SHAPES[name]
    h, i, layers, vocab = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * head_dim(name), s["num_key_value_heads"] * head_dim(name)
    experts = s.get("num_experts") or s.get("num_local_experts")
    mlp = 3 * h * i
    if experts:
        expert_size = s.get("moe_intermediate_size", i)
        mlp = 3 * h * expert_size * (s["num_experts_per_tok"] if active else experts) + h * experts
    per_layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
    embeddings = vocab * h * (1 if s["tie_word_embeddings"] else 2)
    return layers * per_layer + embeddings + h
