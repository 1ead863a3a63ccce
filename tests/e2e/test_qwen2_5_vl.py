"""Qwen2.5-VL end to end against HF transformers on a tiny random checkpoint it writes (qwen2_5_vl_checkpoint.py):
greedy tokens equal HF `generate` given the same image processor outputs, for one image, several images, images
of different sizes in one batch, and text-only rows mixed in; then the prefix cache with images, chunked prefill
across image tokens under a small budget, preemption, and the rows whose image does not load.

The reference's prompt is expanded by hand (each image's one `<|image_pad|>` repeated t*h*w / 4 times, from the
grid transformers' image processor gives), so the expansion is checked too. Float32 on both sides.
"""

from __future__ import annotations

import pytest
import torch

from batchllm import LLM, SamplingParams
from tests.e2e.conftest import _default_model
from tests.e2e.qwen2_5_vl_checkpoint import MAX_PIXELS, MIN_PIXELS, png_bytes, random_image, save_tiny_qwen2_5_vl

MAX_NEW = 8
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    ids = save_tiny_qwen2_5_vl(directory, _default_model())
    return directory, ids


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory, ids = checkpoint
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)

    def greedy(text: str, images: list) -> list[int]:
        token_ids = tokenizer(text)["input_ids"]
        kwargs = {}
        if images:
            processed = processor(images=images, return_tensors="pt")
            grids = processed["image_grid_thw"]
            expanded, counts = [], iter(int(g.prod()) // 4 for g in grids)
            for token in token_ids:
                expanded += [token] * next(counts) if token == ids["image"] else [token]
            token_ids = expanded
            # mm_token_type_ids marks the image tokens: without it transformers falls back to 1-D positions.
            kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=grids,
                          mm_token_type_ids=torch.tensor([[int(t == ids["image"]) for t in token_ids]]))
        inputs = torch.tensor([token_ids])
        with torch.no_grad():
            out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=MAX_NEW,
                                 do_sample=False, **kwargs)
        return out[0, len(token_ids):].tolist()

    return greedy


@pytest.fixture(scope="module")
def images():
    return {"small": random_image(1, 100, 80), "tall": random_image(2, 140, 196), "square": random_image(3, 64, 64),
            "other": random_image(4, 100, 80)}


def _llm(directory, **kwargs) -> LLM:
    return LLM(model=str(directory), device="cpu", dtype="float32", num_kv_blocks=kwargs.pop("num_kv_blocks", 256),
               **kwargs)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


def _rows(images):
    """(prompt for LLM.generate, text, images) per row: one image, two of different sizes, a text-only row, and
    the first image again under another text (its encoder output is reused)."""
    rows = [(chat(f"Describe {PAD} briefly."), [images["small"]]),
            (chat(f"Compare {PAD} with {PAD}."), [images["tall"], images["square"]]),
            (chat("No picture here, just text."), []),
            (chat(f"What is in {PAD}?"), [images["small"]])]
    prompts = [{"prompt": text, "multi_modal_data": {"image": [png_bytes(i) for i in imgs]}} if imgs else text
               for text, imgs in rows]
    return prompts, rows


def test_images_match_hf_in_one_batch(checkpoint, hf, images):
    directory, _ = checkpoint
    prompts, rows = _rows(images)
    expected = [hf(text, imgs) for text, imgs in rows]
    assert expected[0] != hf(chat(f"Describe {PAD} briefly."), [images["other"]])  # the image moves the tokens
    llm = _llm(directory)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.runner.multimodal.cache.num_encoded == 3  # four rows, three distinct images


def test_chunked_prefill_across_image_tokens_and_preemption(checkpoint, hf, images):
    """A 16-token budget splits each image's placeholder run over several steps; a pool of few blocks
    preempts rows (recomputed from their images again)."""
    directory, _ = checkpoint
    prompts, rows = _rows(images)
    expected = [hf(text, imgs) for text, imgs in rows]
    llm = _llm(directory, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.stats.num_chunked_prefills > 0
    tight = _llm(directory, num_kv_blocks=7, block_size=16, enable_prefix_caching=False)
    assert _tokens(tight.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert tight.stats.num_preemptions > 0


def test_prefix_cache_keys_blocks_by_their_images(checkpoint, images):
    directory, ids = checkpoint
    llm = _llm(directory)
    text = chat(f"Here is some context before the picture, long enough to fill a block: {PAD} say what you see.")

    def hits(image) -> tuple[int, list[int]]:
        output = llm.generate([{"prompt": text, "multi_modal_data": {"image": png_bytes(image)}}], GREEDY,
                              use_tqdm=False)[0]
        return llm.stats.prefix_cache_hits, output.prompt_token_ids

    assert hits(images["small"])[0] == 0
    full, prompt = hits(images["small"])  # the same image and text: every full block before the last token
    other, _ = hits(images["other"])  # same size, same text, other pixels: only the full blocks before the image
    first_image_token = prompt.index(ids["image"])
    assert full == (len(prompt) - 1) // 16 * 16 >= 32
    assert other == first_image_token // 16 * 16 < full


def test_chat_parts_stream_and_rows_whose_image_fails(checkpoint, hf, images, tmp_path):
    """`LLM.chat` with OpenAI image parts (a data URL) and `{"type": "image"}` parts, `LLM.stream` with a prompt
    dict, and rows whose image is corrupt, missing, or an http URL without the opt-in: those fail alone."""
    import base64

    directory, _ = checkpoint
    llm = _llm(directory)
    small = png_bytes(images["small"])
    expected = hf(chat(f"Describe {PAD} briefly."), [images["small"]])
    url = "data:image/png;base64," + base64.b64encode(small).decode()
    conversations = [[{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                   {"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": " briefly."}]}],
                     [{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                   {"type": "image", "image": images["small"]},
                                                   {"type": "text", "text": " briefly."}]}]]
    assert _tokens(llm.chat(conversations, GREEDY, use_tqdm=False)) == [expected, expected]
    streamed = list(llm.stream([("k", {"prompt": chat(f"Describe {PAD} briefly."),
                                       "multi_modal_data": {"image": small}}, GREEDY)]))
    assert streamed[0][0] == "k" and list(streamed[0][1].outputs[0].token_ids) == expected

    bad = {"corrupt": b"\x89PNG not really", "missing": str(tmp_path / "nowhere.png"),
           "remote": "http://127.0.0.1:9/image.png"}
    prompts = [{"prompt": chat(f"Describe {PAD} briefly."), "multi_modal_data": {"image": source}}
               for source in [*bad.values(), small]]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"] * 3 + ["length"]
    messages = [o.outputs[0].error for o in outputs[:3]]
    assert "prompt 0" in messages[0] and "not a PNG" in messages[0]
    assert "prompt 1" in messages[1] and "not found" in messages[1]
    assert "prompt 2" in messages[2] and "allow_remote_media" in messages[2]
    assert list(outputs[3].outputs[0].token_ids) == expected
    with pytest.raises(ValueError, match="prompt 0 has 0 image placeholder"):
        raise_first_error(llm.generate([{"prompt": "no placeholder", "multi_modal_data": {"image": small}}], GREEDY,
                                       use_tqdm=False))


def raise_first_error(outputs) -> None:
    for output in outputs:
        if output.outputs[0].error:
            raise ValueError(output.outputs[0].error)


@pytest.mark.parametrize("option, named", [({"deterministic": True}, "deterministic=True"),
                                           ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                                            "speculative_config")])
def test_options_that_rule_out_images_refuse_them_by_name_and_text_still_runs(checkpoint, hf, option, named):
    directory, _ = checkpoint
    llm = _llm(directory, **option)
    with pytest.raises(ValueError, match=f"prompt 0 has images: LLM argument {named} does not work with images"):
        llm.generate([{"prompt": chat(f"Describe {PAD} briefly."), "multi_modal_data": {"image": b"x"}}], GREEDY,
                     use_tqdm=False)
    text = chat("No picture here, just text.")
    assert _tokens(llm.generate([text], GREEDY, use_tqdm=False)) == [hf(text, [])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_images_match_hf_on_the_gpu(checkpoint, hf, images):
    """The tower's Triton norm and rotary, the 3-D rotary and CUDA graphs on a GPU, in float32, against HF on the
    CPU; the KV pool NaN-filled so a read of a slot no step wrote shows."""
    directory, _ = checkpoint
    prompts, rows = _rows(images)
    expected = [hf(text, imgs) for text, imgs in rows]
    llm = LLM(model=str(directory), device="cuda", dtype="float32", num_kv_blocks=64, block_size=16)
    llm.runner.kv_cache.tensor.fill_(float("nan"))
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
