"""Gemma 3's image encoder: a SigLIP vision transformer and Gemma 3's multimodal projector.

Every image comes in at the tower's fixed `image_size` (the Gemma 3 image processor resizes, and pan-and-scan
crops are images of their own), so the encoder is a plain ViT over `(image_size / patch_size)**2` patches with
full bidirectional attention. The projector average-pools the patch grid down to `mm_tokens_per_image` soft
tokens, normalises them (Gemma's `1 + weight` RMSNorm) and maps them to the language model's width.

Parameter names equal transformers 5's (`model.vision_tower.*`, `model.multi_modal_projector.*`) without
`model.`, which is also what transformers 5 writes to disk; `vision_param_name` maps the other stored spellings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# transformers' SiglipVisionConfig defaults; released Gemma 3 config.json files leave these out.
_SIGLIP_DEFAULTS = {"num_channels": 3, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
# The tanh approximation or the exact erf form, the two GELUs SigLIP checkpoints name.
_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
_DEFAULT_MM_TOKENS_PER_IMAGE = 256  # Gemma3Config's default


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    mm_tokens_per_image: int
    text_hidden_size: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Gemma3VisionConfig:
        """From the whole `Gemma3ForConditionalGeneration` config.json dict (vision_config, text_config and
        the top-level mm_tokens_per_image)."""
        vision = config.get("vision_config")
        text = config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ValueError("config.json of a Gemma 3 vision model needs vision_config and text_config objects")
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                    "patch_size")
        missing = [name for name in required if name not in vision]
        if missing:
            raise ValueError(f"config.json vision_config lacks {', '.join(missing)}")
        if "hidden_size" not in text:
            raise ValueError("config.json text_config lacks hidden_size")
        values = {**_SIGLIP_DEFAULTS, **{k: v for k, v in vision.items() if k in _SIGLIP_DEFAULTS}}
        result = cls(**{name: vision[name] for name in required}, **values,
                     mm_tokens_per_image=config.get("mm_tokens_per_image", _DEFAULT_MM_TOKENS_PER_IMAGE),
                     text_hidden_size=text["hidden_size"])
        result._check()
        return result

    def _check(self) -> None:
        if self.hidden_act not in _GELU_APPROXIMATION:
            raise ValueError(f"config.json vision_config hidden_act must be one of {sorted(_GELU_APPROXIMATION)}, "
                             f"got {self.hidden_act!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"config.json vision_config hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"config.json vision_config image_size {self.image_size} is not a multiple of "
                             f"patch_size {self.patch_size}")
        side = self.tokens_per_side
        if side < 1 or side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"config.json mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose "
                             f"side divides the {self.patches_per_side} patches per image side")


def vision_param_name(stored: str) -> str | None:
    """A checkpoint tensor name -> the encoder's parameter name, or None for a tensor the encoder does not hold
    (the language model's, or SigLIP's attention-pooling head, which Gemma 3 does not use).

    Released Gemma 3 checkpoints store `vision_tower.vision_model.*`, transformers 4.5x `model.vision_tower.
    vision_model.*`, transformers 5 `vision_tower.*` (in memory `model.vision_tower.*`)."""
    name = stored.removeprefix("model.")
    if name.startswith("multi_modal_projector."):
        return name
    if not name.startswith("vision_tower."):
        return None
    name = "vision_tower." + name[len("vision_tower."):].removeprefix("vision_model.")
    return None if name.startswith("vision_tower.head.") else name


class _PatchEmbeddings(nn.Module):
    def __init__(self, config: Gemma3VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values)  # [N, hidden, side, side]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight  # raster order of the grid


class _SelfAttention(nn.Module):
    def __init__(self, config: Gemma3VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        size = config.hidden_size
        self.q_proj = nn.Linear(size, size, dtype=dtype)
        self.k_proj = nn.Linear(size, size, dtype=dtype)
        self.v_proj = nn.Linear(size, size, dtype=dtype)
        self.out_proj = nn.Linear(size, size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, size = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, -1).transpose(1, 2)

        # No mask: every patch sees every patch of its image, and images are separate batch rows.
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, size))


class _MLP(nn.Module):
    def __init__(self, config: Gemma3VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.approximate = _GELU_APPROXIMATION[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class _EncoderLayer(nn.Module):
    def __init__(self, config: Gemma3VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.self_attn = _SelfAttention(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = _MLP(config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, config: Gemma3VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(config, dtype) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _SiglipVisionTower(nn.Module):
    def __init__(self, config: Gemma3VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = _PatchEmbeddings(config, dtype)
        self.encoder = _Encoder(config, dtype)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class _GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, and the scaling happens in float32."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class _MultiModalProjector(nn.Module):
    def __init__(self, config: Gemma3VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.patches_per_side = config.patches_per_side
        self.pool = config.patches_per_side // config.tokens_per_side
        # transformers normalises with the vision config's layer_norm_eps, not the text model's rms_norm_eps.
        self.mm_soft_emb_norm = _GemmaRMSNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(config.hidden_size, config.text_hidden_size, dtype=dtype))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(batch, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, kernel_size=self.pool, stride=self.pool).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3VisionEncoder(nn.Module):
    def __init__(self, config: dict[str, Any] | Gemma3VisionConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config if isinstance(config, Gemma3VisionConfig) else Gemma3VisionConfig.from_hf(config)
        dtype = dtype or torch.get_default_dtype()
        self.vision_tower = _SiglipVisionTower(self.config, dtype)
        self.multi_modal_projector = _MultiModalProjector(self.config, dtype)

    @property
    def tokens_per_image(self) -> int:
        """How many image placeholder tokens each image takes in the prompt."""
        return self.config.mm_tokens_per_image

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`pixel_values [N, C, image_size, image_size]` -> `[N, mm_tokens_per_image, text_hidden_size]`, each
        image's soft tokens in raster order of the pooled grid."""
        c = self.config
        expected = (c.num_channels, c.image_size, c.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values must be [images, {', '.join(map(str, expected))}], "
                             f"got {list(pixel_values.shape)}")
        weight = self.vision_tower.embeddings.patch_embedding.weight
        return self.multi_modal_projector(self.vision_tower(pixel_values.to(weight.dtype)))
