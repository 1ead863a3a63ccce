"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) as one model over a flat batch of tokens.

The differences between the families are config flags: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3),
tied embeddings, RoPE scaling, per-layer sliding windows (Mistral, Qwen2/Qwen3 with `use_sliding_window`).
Parameter names follow the HF checkpoints, except that q/k/v and gate/up are fused; `packed_modules_mapping`
tells the loader how HF tensors map onto the fused parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batchllm.distributed.parallel_state import get_pp
from batchllm.model.config import ModelConfig
from batchllm.model.layers.activation import SiluAndMul
from batchllm.model.layers.attention import Attention
from batchllm.model.layers.embedding import LMHead, VocabEmbedding, compute_logits
from batchllm.model.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from batchllm.model.layers.mrotary import MRotaryEmbedding
from batchllm.model.layers.norm import RMSNorm, normalize_for
from batchllm.model.layers.rotary import RotaryEmbedding
from batchllm.model.quantization.config import QuantConfig
from batchllm.model.stages import StagePlan

# What a pipeline stage hands the next: the hidden states and the residual stream, both [T, H].
StageOutput = tuple[torch.Tensor, torch.Tensor]


class LlamaSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, quant_config: QuantConfig | None,
                 sliding_window: int | None = None, qk_norm: type[nn.Module] = RMSNorm) -> None:
        """`sliding_window`: this layer's window (`ModelConfig.layer_sliding_window`), None for full attention.
        `qk_norm`: the per-head q/k norm's class where the config has one (Gemma's differs)."""
        super().__init__()
        self.qkv_proj = QKVLinear(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                                  bias=config.attention_bias, quant_config=quant_config)
        # This rank's heads: all of them without tensor parallelism.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.o_proj = RowLinear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias,
                                quant_config=quant_config)
        self.q_norm = qk_norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = qk_norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = rotary_emb
        scale = config.head_dim**-0.5 if config.attention_scale is None else config.attention_scale
        self.attn = Attention(self.num_heads, self.num_kv_heads, config.head_dim, scale=scale,
                              sliding_window=sliding_window, logit_soft_cap=config.attn_logit_softcap,
                              sinks=config.attention_sinks)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [config.intermediate_size] * 2,
                                               bias=config.mlp_bias, quant_config=quant_config)
        self.down_proj = RowLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias,
                                   quant_config=quant_config)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        down = self.down_proj
        return down(self.act.quantized(gate_up) if down.takes_fp8_rows else self.act(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, quant_config: QuantConfig | None,
                 sliding_window: int | None = None, mlp: nn.Module | None = None) -> None:
        """`mlp`: the layer's MLP when it is not the dense gated one (a MoE block, moe.py)."""
        super().__init__()
        self.self_attn = LlamaSelfAttention(config, rotary_emb, quant_config, sliding_window)
        self.mlp = LlamaMLP(config, quant_config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def _mlp_input(self) -> nn.Module | None:
        """The layer that reads the MLP's input; none for a MoE block, whose router reads it in 16 bits."""
        return self.mlp.gate_up_proj if isinstance(self.mlp, LlamaMLP) else None

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mlp output, residual stream)`; the next norm adds them, saving a separate add."""
        # Each norm's output has one reader; an FP8 linear layer takes it quantized by the norm (normalize_for).
        if residual is None:
            residual, hidden = hidden, normalize_for(self.self_attn.qkv_proj, self.input_layernorm, hidden)
        else:
            hidden, residual = normalize_for(self.self_attn.qkv_proj, self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = normalize_for(self._mlp_input, self.post_attention_layernorm, hidden, residual)
        return self.mlp(hidden), residual


class HeldElsewhere(nn.Module):
    """The place of a decoder layer another pipeline stage holds: layer indices (and parameter names) stay those of
    the checkpoint."""


class DecoderStack(nn.Module):
    """The forward pass of a stack of decoder layers split over pipeline stages, whatever the layers are: a
    subclass builds `stage`, `embed_tokens`, `layers` (`HeldElsewhere` where another stage holds one), `norm`
    (on the last stage) and `aux_layers` / `aux_hidden`, and may change `embed`."""

    stage: StagePlan
    embed_tokens: VocabEmbedding | None
    layers: nn.ModuleList
    norm: nn.Module | None
    aux_layers: tuple[int, ...]
    aux_hidden: torch.Tensor | None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_stage: StageOutput | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | StageOutput:
        """The final hidden states `[T, H]`; under pipeline parallelism a stage other than the first continues
        from `previous_stage`, and one other than the last returns what the next stage continues from.
        `inputs_embeds` (a step with images) replaces the token embeddings."""
        if previous_stage is None:
            hidden, residual = self.embed(input_ids) if inputs_embeds is None else inputs_embeds, None
        else:
            hidden, residual = previous_stage
        aux = []
        for i in range(self.stage.start, self.stage.end):
            if i in self.aux_layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = self.layers[i](positions, hidden, residual)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaModel(DecoderStack):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None,
                 layer_mlp: Callable[[ModelConfig, QuantConfig | None, int], nn.Module] | None = None) -> None:
        """`layer_mlp(config, quant_config, i)`: layer i's MLP (MoE families); None: Llama's everywhere."""
        super().__init__()
        pp = get_pp()
        self.stage = StagePlan(config, pp.rank, pp.size)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size) if self.stage.has_embedding else None
        # One cos/sin table shared by every layer: for long-context models it is tens of MB.
        rotary_emb = (MRotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, config.mrope_section)
                      if config.mrope_section else
                      RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling,
                                      rotary_dim=config.rotary_dim))
        # Windowed layers (Mistral, Qwen2 with use_sliding_window) mask keys outside their window; the hybrid KV
        # cache (engine/kv_groups.py) frees the blocks no window sees any more.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary_emb, quant_config, config.layer_sliding_window(i),
                              None if layer_mlp is None else layer_mlp(config, quant_config, i))
            if self.stage.holds_layer(i) else HeldElsewhere() for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.stage.is_last else None
        # EAGLE-3 heads read the residual stream entering these layers, concatenated, as `aux_hidden`.
        self.aux_layers = ()
        self.aux_hidden = None


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a flat batch: `forward(input_ids [T], positions [T]) -> hidden [T, H]`.

    Paging metadata is read from the forward context, so the runner must call the model inside
    `batchllm.forward_context.set_forward_context(...)`, after assigning each layer's KV cache
    (see `attention_layers`).
    """

    # HF checkpoint module name → (our fused module name, shard id).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        """`quant_config` (None: unquantized) is the checkpoint's, for the decoder's linear layers; the embedding
        and the LM head are never quantized."""
        super().__init__()
        self.config = config
        self.model = self.build_model(config, quant_config)
        # Tied models read logits off the embedding table instead of holding a second copy.
        self.lm_head = (
            None if config.tie_word_embeddings or not self.model.stage.is_last or config.num_labels
            else LMHead(config.vocab_size, config.hidden_size)
        )

    def build_model(self, config: ModelConfig, quant_config: QuantConfig | None) -> DecoderStack:
        """The decoder stack: Llama's here; Gemma (gemma.py) builds its own layers."""
        return LlamaModel(config, quant_config, self.layer_mlp)

    def layer_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, layer: int) -> nn.Module:
        """Decoder layer `layer`'s MLP: the dense gated one here; MoE families (moe.py) put their experts here."""
        return LlamaMLP(config, quant_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_stage: StageOutput | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | StageOutput:
        return self.model(input_ids, positions, previous_stage, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings a step with images starts from, before its image rows go in (runner side)."""
        return self.model.embed(input_ids)

    def held_elsewhere(self, checkpoint_name: str) -> bool:
        """A checkpoint tensor of a part another pipeline stage holds."""
        return self.model.stage.held_elsewhere(checkpoint_name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits `[N, vocab_size]` for the hidden states of the tokens that need them; under tensor
        parallelism on rank 0 only (None on the other ranks)."""
        return compute_logits(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head)

    def attention_layers(self) -> list[Attention]:
        """The paged attention layer of each decoder layer, in order; the runner assigns their KV caches."""
        return [layer.self_attn.attn for layer in self.model.layers if not isinstance(layer, HeldElsewhere)]


class LlamaForSequenceClassification(LlamaForCausalLM):
    """A Llama-family decoder with a classification head (HF's `*ForSequenceClassification`): `score.weight`
    `[num_labels, hidden]`, no bias, read by the pooler from the last token's final hidden state (no LM head)."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        super().__init__(config, quant_config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise ValueError("a sequence-classification model has no LM head: it classifies (task='classify'), it does "
                         "not generate")
