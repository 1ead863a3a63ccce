"""A tiny random Qwen2.5-VL checkpoint written by transformers, with a tokenizer, a chat template and an image
processor config, for the end-to-end tests of image inputs (`test_qwen2_5_vl*.py`).

The tokenizer is the default model's (a real BPE tokenizer) with Qwen's three vision tokens added; the chat template
renders an image part as `<|vision_start|><|image_pad|><|vision_end|>`, as Qwen2.5-VL's does. The vision tower has
windowed and full-attention blocks (window 56 pixels: images over 2 x 2 merged cells span several windows).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_qwen2_5_vl(directory: Path, tokenizer_path: Path) -> dict:
    """Write the checkpoint; returns its token ids: image, vision start and end."""
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    start, image, end = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=76, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1, 3], window_size=56, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=image, video_token_id=image + 100_000, vision_start_token_id=start, vision_end_token_id=end,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the init's 0.02 so that images move the greedy tokens
        for name, param in model.named_parameters():
            if "visual" in name and param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(directory)
    return {"image": image, "start": start, "end": end}


def random_image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
