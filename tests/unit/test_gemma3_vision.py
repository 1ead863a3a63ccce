"""Gemma 3's SigLIP tower and multimodal projector against transformers' own model (the reference).

A tiny random `Gemma3ForConditionalGeneration` built by transformers (8x8 patches pooled 4x4 down to 2x2 soft
tokens per image); its `model.get_image_features(pixel_values).pooler_output` is the projector's output. Every
parameter is perturbed away from its init (norms at ones or zeros, biases at zeros) so that each one matters.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchllm.model.gemma3_vision import Gemma3VisionEncoder, vision_param_name

transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

IMAGE_SIZE = 64
TEXT_HIDDEN = 48
MM_TOKENS = 4


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=dict(model_type="gemma3_text", hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=300),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8,
                           vision_use_head=False),
        mm_tokens_per_image=MM_TOKENS, image_token_index=262, boi_token_index=260, eoi_token_index=261)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if not name.startswith("language_model."):
                param.add_(0.1 * torch.randn_like(param))
    return model


def _our_encoder(hf_model) -> Gemma3VisionEncoder:
    encoder = Gemma3VisionEncoder(hf_model.config.to_dict(), torch.float32)
    prefix = "model."
    state = {k[len(prefix):]: v for k, v in hf_model.state_dict().items()
             if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    encoder.load_state_dict(state)  # strict: every name and shape equals transformers'
    return encoder.eval()


def _hf_features(hf_model, pixel_values: torch.Tensor) -> torch.Tensor:
    out = hf_model.model.get_image_features(pixel_values)
    return out.pooler_output  # transformers 5: a BaseModelOutputWithPooling, the projector's output in pooler_output


def _compare(hf_model, pixel_values: torch.Tensor) -> None:
    with torch.no_grad():
        ours = _our_encoder(hf_model)(pixel_values)
        expected = _hf_features(hf_model, pixel_values)
    assert ours.shape == expected.shape == (pixel_values.shape[0], MM_TOKENS, TEXT_HIDDEN)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_processed_images_match_transformers(hf_model):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    rng = np.random.default_rng(0)
    images = [PIL_Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in [(90, 70), (50, 120)]]
    processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    assert pixel_values.shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)
    _compare(hf_model, pixel_values)


def test_random_pixels_match_transformers(hf_model):
    _compare(hf_model, torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1)))


def test_images_are_encoded_independently(hf_model):
    pixel_values = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(2))
    encoder = _our_encoder(hf_model)
    with torch.no_grad():
        torch.testing.assert_close(encoder(pixel_values)[1:], encoder(pixel_values[1:]), atol=1e-6, rtol=1e-6)


def test_checkpoint_names_map_onto_the_encoder(hf_model, tmp_path):
    """What transformers 5 writes to disk, and the released checkpoints' `vision_tower.vision_model.*`."""
    from safetensors import safe_open

    hf_model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = list(f.keys())
    ours = set(_our_encoder(hf_model).state_dict())
    mapped = {vision_param_name(k) for k in stored} - {None}
    assert mapped == ours
    assert vision_param_name("vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight") == \
        "vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    assert vision_param_name("model.vision_tower.vision_model.post_layernorm.bias") == \
        "vision_tower.post_layernorm.bias"
    assert vision_param_name("vision_tower.vision_model.head.probe") is None
    assert vision_param_name("language_model.model.embed_tokens.weight") is None


def test_bad_config_and_input_are_refused(hf_model):
    config = hf_model.config.to_dict()
    with pytest.raises(ValueError, match="mm_tokens_per_image 9"):
        Gemma3VisionEncoder({**config, "mm_tokens_per_image": 9})  # 3 does not divide the 8 patches per side
    with pytest.raises(ValueError, match="pixel_values"):
        _our_encoder(hf_model)(torch.zeros(1, 3, 32, 32))
