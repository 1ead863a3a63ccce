"""Images through the table doors (pandas, Arrow, HF datasets, row dicts) on the tiny Qwen2.5-VL checkpoint: each
row's greedy tokens equal HF `generate` given the same processor outputs (the `hf` fixture of test_qwen2_5_vl.py),
for image bytes, paths, HF `Image` values (as dicts and as PIL images), lists of images, messages with image parts
and prompts that place their own placeholder; a bad or missing image fails its row alone.

The reference prompts are written by hand from the checkpoint's chat template, not by the code under test."""

from __future__ import annotations

import base64

import datasets
import pandas as pd
import pyarrow as pa
import pytest

import batchllm
from batchllm import LLM
from tests.e2e.qwen2_5_vl_checkpoint import png_bytes, random_image
from tests.e2e.test_qwen2_5_vl import MAX_NEW, PAD, chat, checkpoint, hf  # noqa: F401  (fixtures)

GREEDY = {"max_tokens": MAX_NEW, "temperature": 0.0}
CAPTION = "Describe the image."


# They name the image model (`model=`), which replaces the engine cache's entry: put the default model's back after.
pytestmark = pytest.mark.usefixtures("keep_the_engine_cache")


@pytest.fixture(scope="module")
def vl(checkpoint):  # noqa: F811
    return LLM(model=str(checkpoint[0]), device="cpu", dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def pictures():
    return [random_image(11, 64, 64), random_image(12, 100, 80), random_image(13, 140, 196)]


def _expected(hf, text, images):  # noqa: F811
    return hf(chat(PAD * len(images) + text), images)


def _check(frame, hf, rows, llm):  # noqa: F811
    """`rows`: {row: images} of the rows whose text must be HF's; every other row must carry an error and no text."""
    for row in range(len(frame)):
        if row in rows:
            assert pd.isna(frame["error"].iloc[row]), frame["error"].iloc[row]
            want = llm.tokenizer.decode(_expected(hf, CAPTION, rows[row]), skip_special_tokens=True)
            assert frame["generated_text"].iloc[row] == want
        else:
            assert isinstance(frame["error"].iloc[row], str) and pd.isna(frame["generated_text"].iloc[row])


def test_pandas_with_bytes_and_paths_and_bad_rows(vl, hf, pictures, tmp_path):  # noqa: F811
    paths = []
    for i, picture in enumerate(pictures):
        paths.append(str(tmp_path / f"{i}.png"))
        picture.save(paths[-1])
    frame = pd.DataFrame({"img": [png_bytes(pictures[0]), paths[1], b"not an image", str(tmp_path / "missing.png"),
                                  png_bytes(pictures[2]), None]})
    out = frame.pipe(batchllm.generate, prompt_template=CAPTION, image_column="img", llm=vl, use_tqdm=False,
                     **GREEDY)
    _check(out, hf, {0: [pictures[0]], 1: [pictures[1]], 4: [pictures[2]]}, vl)
    assert "not a PNG/JPEG" in out["error"].iloc[2]
    assert "file not found" in out["error"].iloc[3] and "missing.png" in out["error"].iloc[3]
    assert out["error"].iloc[5] == "image column 'img' is null in this row"


def test_hf_dataset_image_feature_as_dicts_and_as_pil(vl, hf, pictures, tmp_path):  # noqa: F811
    paths = []
    for i, picture in enumerate(pictures[:2]):
        paths.append(str(tmp_path / f"{i}.png"))
        picture.save(paths[-1])
    dataset = datasets.Dataset.from_dict({"q": [CAPTION, CAPTION], "img": paths}).cast_column("img", datasets.Image())
    out = batchllm.generate(dataset, prompt_column="q", image_column="img", llm=vl, use_tqdm=False, **GREEDY)
    texts = out["generated_text"]
    want = [vl.tokenizer.decode(_expected(hf, CAPTION, [p]), skip_special_tokens=True) for p in pictures[:2]]
    assert texts == want and out["error"] == [None, None]
    # dataset[:] decodes the Image feature to PIL images.
    decoded = pd.DataFrame(dataset[:])
    assert all(hasattr(image, "convert") for image in decoded["img"])
    frame = decoded.pipe(batchllm.generate, prompt_column="q", image_column="img", llm=vl, use_tqdm=False, **GREEDY)
    assert frame["generated_text"].tolist() == want


def test_arrow_list_of_images_with_own_placeholders(vl, hf, pictures):  # noqa: F811
    two = [png_bytes(pictures[0]), png_bytes(pictures[1])]
    own = chat(f"First {PAD} then {PAD}: compare.")
    table = pa.table({"q": [own, CAPTION, own], "img": [two, [png_bytes(pictures[2])], two[:1]]})
    out = batchllm.generate(table, prompt_column="q", image_column="img", llm=vl, use_tqdm=False, **GREEDY)
    texts, errors = out.column("generated_text").to_pylist(), out.column("error").to_pylist()
    decode = vl.tokenizer.decode
    assert texts[0] == decode(hf(own, pictures[:2]), skip_special_tokens=True)  # used as given
    assert texts[1] == decode(_expected(hf, CAPTION, [pictures[2]]), skip_special_tokens=True)
    assert errors[:2] == [None, None]
    assert "2 image placeholder token(s)" in errors[2] and "for 1 image(s)" in errors[2]


def test_messages_with_image_parts(vl, hf, pictures):  # noqa: F811
    url = "data:image/png;base64," + base64.b64encode(png_bytes(pictures[1])).decode()
    rows = [{"m": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": CAPTION}]}]},
            {"m": [{"role": "user", "content": [{"type": "image", "image": png_bytes(pictures[0])},
                                                 {"type": "text", "text": CAPTION}]}]},
            {"m": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                                                 {"type": "text", "text": CAPTION}]}]},
            {"m": [{"role": "user", "content": [{"type": "audio"}]}]}]
    out = batchllm.generate(rows, messages_column="m", llm=vl, use_tqdm=False, **GREEDY)
    decode = vl.tokenizer.decode
    assert out[0]["generated_text"] == decode(_expected(hf, CAPTION, [pictures[1]]), skip_special_tokens=True)
    assert out[1]["generated_text"] == decode(_expected(hf, CAPTION, [pictures[0]]), skip_special_tokens=True)
    assert "allow_remote_media" in out[2]["error"]
    assert "'audio'" in out[3]["error"]  # the text-only check names the part it cannot take


def test_call_level_refusals(vl, tmp_path):
    frame = pd.DataFrame({"img": [b"x"]})
    with pytest.raises(ValueError, match="unknown column 'image'"):
        batchllm.generate(frame, prompt_template=CAPTION, image_column="image", llm=vl)
    text_only = LLM(device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="takes text only"):
        batchllm.generate(frame, prompt_template=CAPTION, image_column="img", llm=text_only)


def test_two_data_parallel_replicas_carry_the_images(checkpoint, vl, hf, pictures):  # noqa: F811
    """The rows' images are prepared here and travel to the replica processes with their rows (a bad one too)."""
    frame = pd.DataFrame({"img": [png_bytes(p) for p in pictures] + [b"not an image"]})
    out = batchllm.generate(frame, prompt_template=CAPTION, image_column="img", model=checkpoint[0],
                            data_parallel_size=2, engine_kwargs={"device": "cpu", "dtype": "float32",
                                                                 "num_kv_blocks": 64}, use_tqdm=False, **GREEDY)
    _check(out, hf, {i: [p] for i, p in enumerate(pictures)}, vl)
    assert "not a PNG/JPEG" in out["error"].iloc[3]


def test_ray_predictor_numpy_batch(checkpoint, hf, pictures):  # noqa: F811
    import numpy as np

    from batchllm.ray import LLMPredictor

    predictor = LLMPredictor(model=str(checkpoint[0]), engine_kwargs={"device": "cpu", "dtype": "float32",
                                                                      "num_kv_blocks": 64},
                             image_column="img", prompt_template=CAPTION, use_tqdm=False, **GREEDY)
    out = predictor({"img": np.array([png_bytes(pictures[0]), b"broken"], dtype=object)})
    want = predictor.llm.tokenizer.decode(_expected(hf, CAPTION, [pictures[0]]), skip_special_tokens=True)
    assert list(out["generated_text"][:1]) == [want] and out["error"][0] is None
    assert "not a PNG/JPEG" in out["error"][1]
