"""Gemma 2 and Gemma 3 (text) as one model over a flat batch of tokens, with `LlamaForCausalLM`'s interface.

What sets them apart from Llama: `1 + w` RMSNorms computed in float32 (`GemmaRMSNorm`), a norm after the
attention and after the MLP as well as before each, a GELU-tanh gated MLP, embeddings scaled by
`sqrt(hidden)`, the score scale `query_pre_attn_scalar ** -0.5`, and local (sliding-window) layers beside
global ones. Gemma 2 soft-caps the attention scores and the final logits; Gemma 3 normalises each head of q and
k and gives its local layers their own RoPE base. `ModelConfig` (from `gemma_config.py`) says which.

Parameter names follow the HF checkpoints, q/k/v and gate/up fused as in Llama, so FP8 and 4-bit weights,
LoRA, tensor and pipeline parallelism work unchanged. `Gemma3ForConditionalGeneration` is the text model of a
multimodal checkpoint: the loader maps its language-model tensors onto this model and skips the vision parts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchllm.distributed.parallel_state import get_pp
from batchllm.model.config import ModelConfig
from batchllm.model.layers.activation import GeluTanhAndMul
from batchllm.model.layers.embedding import VocabEmbedding
from batchllm.model.layers.linear import MergedColumnLinear, RowLinear
from batchllm.model.layers.norm import GemmaRMSNorm
from batchllm.model.layers.rotary import RotaryEmbedding
from batchllm.model.llama import DecoderStack, HeldElsewhere, LlamaForCausalLM, LlamaSelfAttention
from batchllm.model.quantization.config import QuantConfig
from batchllm.model.stages import StagePlan
from batchllm.model.uploads import rows_to_device


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                               quant_config=quant_config)
        self.down_proj = RowLinear(config.intermediate_size, config.hidden_size, bias=False,
                                   quant_config=quant_config)
        self.act = GeluTanhAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, quant_config: QuantConfig | None,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = LlamaSelfAttention(config, rotary_emb, quant_config, sliding_window, qk_norm=GemmaRMSNorm)
        self.mlp = GemmaMLP(config, quant_config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(normed mlp output, residual stream)`, as Llama's layer does: the next norm adds them. The
        sums are HF's (`residual + post_norm(x)`, in the activation dtype), only carried to the next norm."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(DecoderStack):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        super().__init__()
        pp = get_pp()
        self.stage = StagePlan(config, pp.rank, pp.size)
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size) if self.stage.has_embedding else None
        # One cos/sin table per RoPE: Gemma 3's local layers turn with their own base (and no scaling).
        global_rope = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling)
        local_rope = global_rope if config.local_rope_theta is None else RotaryEmbedding(
            config.head_dim, config.max_model_len, config.local_rope_theta, config.local_rope_scaling)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, local_rope if i in config.sliding_window_layers else global_rope,
                              quant_config, config.layer_sliding_window(i))
            if self.stage.holds_layer(i) else HeldElsewhere() for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if self.stage.is_last else None
        # EAGLE-3 heads read the residual stream entering these layers, concatenated, as `aux_hidden`.
        self.aux_layers = ()
        self.aux_hidden = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled embeddings. HF rounds `sqrt(hidden)` to the activation dtype before the multiply
        (Gemma 2 9B's 59.87 becomes 60.0 in bfloat16); so does this, for the same activations."""
        hidden = self.embed_tokens(input_ids)
        return hidden * float(torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """A Gemma 2 / Gemma 3 causal LM over a flat batch: `forward(input_ids [T], positions [T]) -> hidden [T, H]`,
    called like `LlamaForCausalLM` (inside a forward context, after the runner assigned the KV caches), whose
    interface and checkpoint mapping it keeps. Gemma ties its head to the embedding (every released checkpoint);
    an untied one loads `lm_head`."""

    def build_model(self, config: ModelConfig, quant_config: QuantConfig | None) -> DecoderStack:
        return GemmaModel(config, quant_config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits `[N, vocab_size]`, soft-capped (`cap * tanh(logits / cap)`, in float32) where the
        config says so; under tensor parallelism on rank 0 only (None on the other ranks)."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: the same model; its config switches on q/k norms and the local RoPE base, and off the
    soft-caps."""


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """A multimodal Gemma 3 checkpoint: the language model above, and the SigLIP tower with its projector
    (gemma3_vision.py), whose rows the runner's multimodal step puts at the image tokens (after the embedding's
    `sqrt(hidden)` scale, as transformers does). transformers 5 names the language model's tensors
    `model.language_model.*`, older versions (and transformers 5 on save) `language_model.model.*`; the tower's
    spellings are `vision_param_name`'s. Under pipeline parallelism the first stage holds the tower."""

    checkpoint_prefix_renames = {
        "model.language_model.": "model.",
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
    }
    # The tower's tensors go through `checkpoint_parts` first; what is left of it (SigLIP's unused pooling head)
    # is skipped.
    checkpoint_skipped_prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                   "model.multi_modal_projector.")
    checkpoint_unpacked_prefixes = ("vision.",)  # SigLIP's q/k/v_proj are its own, not the decoder's fused qkv

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        from batchllm.model.gemma3_vision import Gemma3VisionEncoder, vision_param_name

        super().__init__(config, quant_config)
        self.checkpoint_parts = {"vision.": vision_param_name}
        self.vision = (Gemma3VisionEncoder(config.vision.vision_config)
                       if config.vision is not None and self.model.stage.has_embedding else None)

    def held_elsewhere(self, checkpoint_name: str) -> bool:
        if checkpoint_name.startswith("vision."):
            return self.vision is None
        return super().held_elsewhere(checkpoint_name)

    def encode_images(self, images: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image's `mm_tokens_per_image` rows from its processor output (`pixel_values [3, H, W]`); all in
        one tower call."""
        weight = self.vision.vision_tower.embeddings.patch_embedding.weight
        # Queued behind the running step, never waiting for it; in the processor's dtype, as the tower takes them.
        pixels = rows_to_device([torch.as_tensor(image["pixel_values"])[None] for image in images], weight.device)
        return list(self.vision(pixels))
