"""Gemma 3 with images end to end against HF transformers on a tiny random checkpoint it writes: SigLIP and the
projector, each `<start_of_image>` expanded as transformers' processor does, and the image tokens attending to each
other both ways inside the causal model (HF's `token_type_ids` mask) — one image, two images, a text row, a small
step budget (a chunk never ends inside an image), the prefix cache, and preemption.

The reference gets the prompt expanded by hand (transformers' `full_image_sequence`: "\\n\\n", start, the image
tokens, end, "\\n\\n"), the pixel values of transformers' PIL image processor, and `token_type_ids` marking the image
tokens. Eager attention in float32 on both sides.
"""

from __future__ import annotations

import pytest
import torch

from batchllm import LLM, SamplingParams
from tests.e2e.conftest import _default_model
from tests.e2e.qwen2_5_vl_checkpoint import png_bytes, random_image

TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
PER_IMAGE = 16  # 8 x 8 SigLIP patches pooled 2 x 2
MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    directory = tmp_path_factory.mktemp("gemma3_images")
    tokenizer = AutoTokenizer.from_pretrained(str(_default_model()))
    tokenizer.add_special_tokens({"additional_special_tokens": TOKENS})
    boi, eoi, image = tokenizer.convert_tokens_to_ids(TOKENS)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=512,
                query_pre_attn_scalar=16, sliding_window=24, sliding_window_pattern=3, rope_theta=10_000.0,
                rope_local_base_freq=10_000.0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=8, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=PER_IMAGE,
                          boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # beyond the init's zeros, ones and 0.02: greedy tokens that the images move
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.2 if "vision" in name or "projector" in name else 0.1))
        model.model.multi_modal_projector.mm_input_projection_weight.mul_(8.0)  # image rows louder than text's
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Gemma3ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(directory)
    return directory, {"boi": boi, "eoi": eoi, "image": image}


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    directory, ids = checkpoint
    model = Gemma3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    processor = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    sequence = f"\n\n<start_of_image>{'<image_soft_token>' * PER_IMAGE}<end_of_image>\n\n"

    def greedy(text: str, images: list) -> list[int]:
        token_ids = tokenizer(text.replace("<start_of_image>", sequence))["input_ids"]
        inputs = torch.tensor([token_ids])
        kwargs = {}
        if images:
            kwargs = dict(pixel_values=processor(images=images, return_tensors="pt")["pixel_values"],
                          token_type_ids=(inputs == ids["image"]).long())
        with torch.no_grad():
            out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=MAX_NEW,
                                 do_sample=False, **kwargs)
        return out[0, len(token_ids):].tolist()

    return greedy


@pytest.fixture(scope="module")
def rows():
    one, two, three = random_image(5, 90, 70), random_image(6, 64, 64), random_image(7, 120, 80)
    return [("A photo: <start_of_image> What is in it?", [one]),
            ("Compare <start_of_image> and <start_of_image>, please, in detail.", [two, three]),
            ("Just some text without any picture.", []),
            ("Again: <start_of_image> What is in it?", [one])]


def _prompts(rows):
    return [{"prompt": text, "multi_modal_data": {"image": [png_bytes(i) for i in images]}} if images else text
            for text, images in rows]


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def _llm(directory, **kwargs):
    return LLM(model=str(directory), device="cpu", dtype="float32", num_kv_blocks=kwargs.pop("num_kv_blocks", 256),
               **kwargs)


def test_images_match_hf(checkpoint, hf, rows):
    directory, _ = checkpoint
    expected = [hf(text, images) for text, images in rows]
    assert expected[0] != hf(rows[0][0], [random_image(8, 90, 70)])  # the image moves the tokens
    llm = _llm(directory)
    assert _tokens(llm.generate(_prompts(rows), GREEDY, use_tqdm=False)) == expected
    assert llm.runner.multimodal.cache.num_encoded == 3


def test_chunks_never_split_an_image_and_preemption(checkpoint, hf, rows):
    """A 20-token budget holds one image (16 tokens) but not a prompt: chunks end before or after an image, never
    inside one; a pool of few blocks preempts rows."""
    directory, _ = checkpoint
    expected = [hf(text, images) for text, images in rows]
    llm = _llm(directory, max_num_batched_tokens=20, enable_prefix_caching=False)
    assert _tokens(llm.generate(_prompts(rows), GREEDY, use_tqdm=False)) == expected
    assert llm.stats.num_chunked_prefills > 0
    tight = _llm(directory, num_kv_blocks=12, max_num_batched_tokens=20, enable_prefix_caching=False,
                 admission_policy="optimistic")
    assert _tokens(tight.generate(_prompts(rows * 3), GREEDY, use_tqdm=False)) == expected * 3
    assert tight.stats.num_preemptions > 0


def test_prefix_cache_hit_with_the_same_image(checkpoint, hf, rows):
    directory, _ = checkpoint
    llm = _llm(directory)
    text, images = rows[1]
    expected = hf(text, images)
    for _ in range(2):
        assert _tokens(llm.generate(_prompts([(text, images)]), GREEDY, use_tqdm=False)) == [expected]
    assert llm.stats.prefix_cache_hits >= 32


def test_a_step_budget_smaller_than_an_image_refuses_images(checkpoint):
    llm = _llm(checkpoint[0], max_num_batched_tokens=10)
    with pytest.raises(ValueError, match="max_num_batched_tokens=10 is smaller than an image"):
        llm.generate(_prompts([("A photo: <start_of_image>", [random_image(1, 64, 64)])]), GREEDY, use_tqdm=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_images_match_hf_on_the_gpu(checkpoint, hf, rows):
    """The key limit (image tokens see their whole image) in the Triton prefill kernel, under a small step budget
    too, against HF on the CPU; float32, the pool NaN-filled so a read of a slot no step wrote shows."""
    directory, _ = checkpoint
    expected = [hf(text, images) for text, images in rows]
    for budget in (None, 32):
        llm = LLM(model=str(directory), device="cuda", dtype="float32", num_kv_blocks=64, block_size=16,
                  **({"max_num_batched_tokens": budget} if budget else {}))
        llm.runner.kv_cache.tensor.fill_(float("nan"))
        assert _tokens(llm.generate(_prompts(rows), GREEDY, use_tqdm=False)) == expected
