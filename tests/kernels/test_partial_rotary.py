"""Partial rotary with LongRoPE (Phi-4-mini: 0.75 of each head rotated) against HF's own Phi-3 rotary functions.

The rotated part of each head is a strided view (head stride = head_dim), which the torch reference and the Triton
kernel (in Triton's interpreter without a GPU) rotate in place; the rest of each head and the value slice of the
fused qkv output stay untouched.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from batchllm.model.layers.rotary import RotaryEmbedding
from batchllm.model.phi3_config import parse_config

pytest.importorskip("triton")

from batchllm.kernels.rotary import apply_rotary_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS, KV_HEADS, HEAD_DIM, TOKENS = 4, 2, 32, 9


def _config() -> Phi3Config:
    gen = torch.Generator().manual_seed(0)
    half = int(HEAD_DIM * 0.75) // 2
    short, long = (1 + torch.rand(half, generator=gen)).tolist(), (2 + torch.rand(half, generator=gen)).tolist()
    return Phi3Config(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      max_position_embeddings=1024, original_max_position_embeddings=64, partial_rotary_factor=0.75,
                      rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long},
                      vocab_size=128, pad_token_id=0, eos_token_id=2, bos_token_id=1)


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_partial_longrope_rotation_equals_hf(use_triton: bool) -> None:
    hf_config = _config()
    config = parse_config({**hf_config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    rope = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling,
                           rotary_dim=config.rotary_dim).to(DEVICE)
    gen = torch.Generator(DEVICE).manual_seed(1)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(TOKENS, q_size + 2 * kv_size, generator=gen, device=DEVICE)
    # Past the original 64 positions: HF then uses the long factors, as this 1024-position table does.
    positions = torch.randint(64, 1024, (TOKENS,), generator=gen, device=DEVICE)
    values = qkv[:, q_size + kv_size:].clone()

    hf_cos, hf_sin = Phi3RotaryEmbedding(hf_config).to(DEVICE)(qkv, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(qkv[None, :, :q_size].view(1, TOKENS, HEADS, HEAD_DIM).transpose(1, 2),
                                      qkv[None, :, q_size:q_size + kv_size].view(1, TOKENS, KV_HEADS, HEAD_DIM)
                                      .transpose(1, 2), hf_cos, hf_sin)

    q = qkv[:, :q_size].view(TOKENS, HEADS, HEAD_DIM)
    k = qkv[:, q_size:q_size + kv_size].view(TOKENS, KV_HEADS, HEAD_DIM)
    if use_triton:
        dim = config.rotary_dim
        apply_rotary_triton(positions, q[..., :dim], k[..., :dim], rope.cos, rope.sin)
    else:
        rope(positions, q, k)

    # float32: the kernel may contract a product and a sum into one FMA where HF rounds twice.
    torch.testing.assert_close(q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, q_size + kv_size:], values), "the value slice of qkv must not be written"
