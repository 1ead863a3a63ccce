"""`ProcessedImages`: decoded and processed on worker threads, in order, errors in their slots; an image given as
bytes (raw, an HF feature dict, a data: URL) processed once however often it repeats, within a call and across
calls, until the byte budget pushes it out; paths processed every time; failures never remembered."""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest
from PIL import Image

from batchllm.multimodal.image_cache import ProcessedImages
from batchllm.multimodal.inputs import ProcessedImage
from batchllm.multimodal.media import MediaError


def _png(seed: int, size: int = 16) -> tuple[np.ndarray, bytes]:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return pixels, buffer.getvalue()


class _Counting:
    """A stand-in image processor: the pixels as an array, every call counted (from the worker threads)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, image: Image.Image) -> ProcessedImage:
        with self.lock:
            self.calls += 1
        if image.width == 1:
            raise ValueError("too thin to patch")
        return ProcessedImage(f"{image.width}x{image.height}", 1, {"pixel_values": np.asarray(image)})


def test_order_errors_and_repeats_processed_once(tmp_path):
    (a, a_png), (b, b_png) = _png(1), _png(2)
    path = tmp_path / "b.png"
    path.write_bytes(b_png)
    data_url = "data:image/png;base64," + base64.b64encode(a_png).decode()
    counting = _Counting()
    images = ProcessedImages(counting, max_workers=3)
    got = images.get([a_png, b"garbage", str(path), a_png, {"bytes": a_png, "path": None}, b_png, data_url])
    for slot, pixels in ((0, a), (2, b), (3, a), (4, a), (5, b), (6, a)):
        np.testing.assert_array_equal(got[slot].data["pixel_values"], pixels)
    assert isinstance(got[1], MediaError) and "cannot identify image file" in str(got[1])
    # a_png (raw and as the feature dict's bytes: the same bytes), the path, b_png, the data: URL; garbage tried.
    assert counting.calls == 4
    again = images.get([a_png, b_png, data_url, str(path), b"garbage"])
    assert counting.calls == 5  # only the path again: its file may have changed
    assert images.num_hits == 3 and isinstance(again[4], MediaError)


def test_the_processors_refusal_fails_that_image_and_is_not_remembered():
    thin = io.BytesIO()
    Image.new("RGB", (1, 40)).save(thin, format="PNG")
    counting = _Counting()
    images = ProcessedImages(counting)
    for _ in range(2):
        (got,) = images.get([thin.getvalue()])
        assert isinstance(got, MediaError) and str(got) == "too thin to patch"
    assert counting.calls == 2


def test_the_byte_budget_evicts_the_least_recently_used():
    pngs = [_png(seed)[1] for seed in range(3)]
    counting = _Counting()
    one_image = 16 * 16 * 3
    images = ProcessedImages(counting, max_bytes=2 * one_image, max_workers=1)
    images.get(pngs[:2])
    images.get([pngs[0]])  # 0 is now the most recently used
    images.get([pngs[2]])  # pushes 1 out
    assert counting.calls == 3
    images.get([pngs[0], pngs[2]])
    assert counting.calls == 3
    images.get([pngs[1]])
    assert counting.calls == 4


@pytest.mark.parametrize("max_workers", [1, 4])
def test_a_call_without_images_and_one_image(max_workers):
    images = ProcessedImages(_Counting(), max_workers=max_workers)
    assert images.get([]) == []
    pixels, png = _png(5)
    np.testing.assert_array_equal(images.get([png])[0].data["pixel_values"], pixels)
