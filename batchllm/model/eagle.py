"""EAGLE (Li et al. 2024) and EAGLE-3 (Li et al. 2025) draft heads, in the layouts their authors publish
(SafeAILab/EAGLE: `eagle/model/cnets1.py` and `cnets.py`).

A heads directory holds `config.json` (a Llama config of the head: hidden size, heads, intermediate size,
`num_hidden_layers`; EAGLE-3 adds `draft_vocab_size`) and its weights as `*.safetensors`; the authors'
`pytorch_model.bin` is a pickle and is refused: convert it to safetensors first (same tensor names).

- EAGLE: `fc.weight` `[H, 2H]` (+ `fc.bias` when trained with one) and Llama decoder layers `layers.{i}.*`,
  layer 0 without `input_layernorm`. The head reads `fc(cat(embed(token at p+1), f_p))`, where `f_p` is the
  target's last hidden state at p (after its final norm); its output is the next feature and goes through
  the target's LM head.
- EAGLE-3: `fc.weight` `[H, 3H]` fuses the target's residual stream entering layers 2, L/2 and L-3;
  `midlayer.*` is one decoder layer whose attention reads `cat(input_layernorm(embed), hidden_norm(f))`
  (q/k/v over 2H inputs); `norm.weight` and `lm_head.weight` `[draft_vocab, H]` give the draft, and `d2t`
  maps a draft-vocabulary id d to the target id `d + d2t[d]`.
Both may carry `embed_tokens.weight`; without it the head shares the target's embedding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from batchllm.engine.speculative.config import EAGLE3
from batchllm.model.config import ModelConfig
from batchllm.model.layers.attention import Attention
from batchllm.model.layers.embedding import LMHead, VocabEmbedding, compute_logits
from batchllm.model.layers.linear import QKVLinear
from batchllm.model.layers.norm import RMSNorm
from batchllm.model.layers.rotary import RotaryEmbedding
from batchllm.model.llama import LlamaDecoderLayer, LlamaMLP, LlamaSelfAttention
from batchllm.model.loader import fill_dummy_weights, load_checkpoint_weights


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose input stream EAGLE-3 fuses: low, middle and high."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def read_eagle_config(path: str | Path, method: str) -> tuple[ModelConfig, dict]:
    """The head's config as a `ModelConfig` (for its attention and KV cache), and the raw dict."""
    path = Path(path).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"speculative_config: the {method} heads directory {str(path)!r} has no config.json")
    raw = json.loads(config_file.read_text())
    if not list(path.glob("*.safetensors")):
        found = sorted(p.name for p in path.iterdir())
        raise ValueError(f"speculative_config: {str(path)!r} has no *.safetensors (found {found}); pickled "
                         f"pytorch_model.bin heads are not loaded, convert them to safetensors")
    if method == EAGLE3 and "draft_vocab_size" not in raw:
        raise ValueError(f"speculative_config: {config_file} has no draft_vocab_size: not an EAGLE-3 head")
    as_llama = {**raw, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False,
                "max_position_embeddings": raw.get("max_position_embeddings", 1 << 20)}
    try:
        return ModelConfig.from_hf_dict(as_llama), raw
    except (KeyError, ValueError) as exc:
        raise ValueError(f"speculative_config: {config_file}: {exc}") from None


class Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaSelfAttention(config, rotary_emb, quant_config=None)
        self.self_attn.qkv_proj = QKVLinear(2 * config.hidden_size, config.head_dim, config.num_heads,
                                            config.num_kv_heads, bias=config.attention_bias, quant_config=None)
        self.mlp = LlamaMLP(config, quant_config=None)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        hidden, residual = self.post_attention_layernorm(self.self_attn(positions, x), features)
        return self.mlp(hidden) + residual


class EagleHead(nn.Module):
    """`forward(token_ids, positions, features) -> next features`; `draft(features) -> target token ids`.
    Runs inside a forward context, like the target, with its own paged KV cache. Its linear layers are
    unquantized whatever the target's quantization: heads are published in full precision."""

    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, method: str, config: ModelConfig, raw: dict, target: ModelConfig, own_embedding: bool,
                 fc_bias: bool) -> None:
        super().__init__()
        self.method, self.config = method, config
        rotary = RotaryEmbedding(config.head_dim, target.max_model_len, config.rope_theta, config.rope_scaling)
        self.embed_tokens = VocabEmbedding(target.vocab_size, config.hidden_size) if own_embedding else None
        target_hidden = raw.get("target_hidden_size", target.hidden_size)
        if method == EAGLE3:
            self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=fc_bias)
            self.midlayer = Eagle3Layer(config, rotary)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = LMHead(raw["draft_vocab_size"], config.hidden_size)
            self.register_buffer("d2t", torch.zeros(raw["draft_vocab_size"], dtype=torch.long))
        else:
            self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
            self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, quant_config=None)
                                        for _ in range(config.num_layers))
            self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer reads fc's output unnormed
        # The target's embedding and LM head, held in a tuple so that they do not become this module's own.
        self._target: tuple[VocabEmbedding, VocabEmbedding] | None = None

    def share_target(self, target: nn.Module) -> None:
        """The target's embedding (used when the checkpoint has none) and its LM head (EAGLE's logits)."""
        embedding = target.model.embed_tokens
        self._target = (embedding, embedding if target.lm_head is None else target.lm_head)

    def features(self, hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> torch.Tensor:
        """The feature of each target token: its last hidden state (EAGLE), or fc of the fused stream (EAGLE-3)."""
        return self.fc(aux_hidden) if self.method == EAGLE3 else hidden

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        embeds = (self.embed_tokens or self._target[0])(token_ids)
        if self.method == EAGLE3:
            return self.midlayer(positions, embeds, features)
        hidden, residual = self.fc(torch.cat([embeds, features], dim=-1)), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual

    def draft(self, features: torch.Tensor) -> torch.Tensor:
        """Greedy target token ids from the head's output features."""
        if self.method == EAGLE3:
            ids = compute_logits(self.norm(features), self.lm_head).argmax(-1)
            return ids + self.d2t[ids]
        return compute_logits(features, self._target[1]).argmax(-1)

    def attention_layers(self) -> list[Attention]:
        if self.method == EAGLE3:
            return [self.midlayer.self_attn.attn]
        return [layer.self_attn.attn for layer in self.layers]


def load_eagle_head(path: str | Path, method: str, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                    load_format: str, seed: int) -> EagleHead:
    path = Path(path).expanduser()
    config, raw = read_eagle_config(path, method)
    names = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            names |= set(f.keys())
    dummy = load_format == "dummy"
    with torch.device(device):
        head = EagleHead(method, config, raw, target, own_embedding="embed_tokens.weight" in names and not dummy,
                         fc_bias="fc.bias" in names)
    head.to(dtype)
    with torch.no_grad():
        if dummy:
            fill_dummy_weights(head, seed, dtype)
            if method == EAGLE3:  # a random injective map into the target's vocabulary
                generator = torch.Generator().manual_seed(seed)
                ids = torch.randperm(target.vocab_size, generator=generator)[:len(head.d2t)].sort().values
                head.d2t.copy_(ids - torch.arange(len(ids)))
        else:
            load_checkpoint_weights(head, path, config, ignore=("d2t", "t2d"))
            if method == EAGLE3:
                head.d2t.copy_(_read_d2t(path, len(head.d2t), target.vocab_size))
    return head.eval()


def _read_d2t(path: Path, draft_vocab: int, vocab_size: int) -> torch.Tensor:
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            if "d2t" in f.keys():
                d2t = f.get_tensor("d2t").long()
                break
    else:
        raise ValueError(f"speculative_config: the EAGLE-3 head at {path} has no d2t tensor")
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"speculative_config: d2t has shape {list(d2t.shape)}, draft_vocab_size is {draft_vocab}")
    target_ids = d2t + torch.arange(draft_vocab)
    if target_ids.min() < 0 or target_ids.max() >= vocab_size:
        raise ValueError(f"speculative_config: d2t maps draft ids outside the target's vocabulary of {vocab_size}")
    return d2t
