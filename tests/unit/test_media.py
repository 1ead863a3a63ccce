"""Image sources → RGB images: every source kind against Pillow's own decode, content hashes, and the errors."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from batchllm.multimodal import media
from batchllm.multimodal.media import MediaError, image_hash, load_image, load_images


def _pixels(seed: int, height: int = 24, width: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def _pillow_decode(data: bytes) -> np.ndarray:
    """The reference: Pillow's own decode of the same bytes."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture
def picture(tmp_path: Path) -> tuple[np.ndarray, bytes, Path]:
    pixels = _pixels(0)
    data = _encode(pixels, "PNG")
    path = tmp_path / "picture.png"
    path.write_bytes(data)
    return pixels, data, path


def test_every_local_source_kind_decodes_to_the_png_pixels(picture):
    pixels, data, path = picture
    data_url = "data:image/png;base64," + base64.b64encode(data).decode()
    sources = [data, bytearray(data), memoryview(data), Image.fromarray(pixels), str(path), path, path.as_uri(),
               data_url, {"bytes": data, "path": None}, {"bytes": None, "path": str(path)},
               {"bytes": data, "path": "/nowhere/else.png"}]  # the dict's bytes win over its path
    for source in sources:
        image = load_image(source)
        assert image.mode == "RGB" and image.size == (32, 24)
        np.testing.assert_array_equal(np.asarray(image), pixels)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF", "BMP"])
def test_other_formats_match_pillows_own_decode(fmt):
    data = _encode(_pixels(1), fmt)
    np.testing.assert_array_equal(np.asarray(load_image(data)), _pillow_decode(data))


def test_modes_other_than_rgb_are_converted():
    gray = Image.fromarray(_pixels(2)[:, :, 0], mode="L")
    rgba = Image.fromarray(np.dstack([_pixels(3), np.full((24, 32), 255, np.uint8)]), mode="RGBA")
    for image in (gray, rgba):
        data = _encode(np.asarray(image), "PNG")
        loaded = load_image(data)
        assert loaded.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(loaded), np.asarray(image.convert("RGB")))


def test_same_picture_one_hash_another_picture_another(picture):
    pixels, data, path = picture
    hashes = {image_hash(load_image(source)) for source in (data, path, Image.fromarray(pixels), path.as_uri())}
    assert len(hashes) == 1
    changed = pixels.copy()
    changed[5, 7, 1] ^= 1
    assert image_hash(Image.fromarray(changed)) not in hashes
    # Same pixel bytes, another shape: another picture.
    assert image_hash(Image.fromarray(pixels.reshape(32, 24, 3))) not in hashes
    # A non-RGB image hashes as its RGB conversion (what the model sees).
    gray = Image.fromarray(pixels[:, :, 0], mode="L")
    assert image_hash(gray) == image_hash(gray.convert("RGB"))


@pytest.mark.parametrize(("source", "words"), [
    (b"not an image at all", "not a PNG/JPEG/WebP/GIF/BMP image (cannot identify image file)"),
    (b"", "empty"),
    ("/no/such/dir/x.png", "file not found: /no/such/dir/x.png"),
    ("file:///no/such/dir/y.png", "file not found: /no/such/dir/y.png"),
    ({"bytes": None, "path": None}, "neither 'bytes' nor 'path'"),
    ({"bytes": b"x", "extra": 1}, "unknown key 'extra'"),
    (12345, "unsupported image source of type int"),
    (np.zeros((2, 2, 3), np.uint8), "unsupported image source of type ndarray"),
    ("http://example.com/a.png", "http(s) URLs are refused unless allow_remote_media=True"),
    ("HTTPS://example.com/a.png", "http(s) URLs are refused unless allow_remote_media=True"),
    ("s3://bucket/a.png", "unsupported scheme 's3'"),
    ("data:text/plain;base64,aGVsbG8=", "not an image/* type"),
    ("data:image/png,rawdata", "must be base64"),
    ("data:image/png;base64,@@@@", "not valid base64"),
])
def test_bad_sources_are_media_errors_naming_the_fault(source, words):
    with pytest.raises(MediaError) as caught:
        load_image(source)
    assert words in str(caught.value)


def test_a_truncated_png_fails_at_load_and_no_bytes_leak_into_the_message(picture):
    _, data, _ = picture
    with pytest.raises(MediaError, match="corrupt or truncated") as caught:
        load_image(data[: len(data) // 2])
    assert "\\x" not in str(caught.value) and "b'" not in str(caught.value)


def test_a_directory_is_not_a_file(tmp_path):
    with pytest.raises(MediaError, match="not a file"):
        load_image(tmp_path)


def test_a_too_large_image_is_refused_before_decoding(picture):
    _, data, path = picture
    for source in (data, path, Image.fromarray(picture[0])):
        with pytest.raises(MediaError, match=r"image of 32x24 pixels exceeds max_image_pixels=700"):
            load_image(source, max_image_pixels=700)
    assert load_image(data, max_image_pixels=32 * 24).size == (32, 24)


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims `width x height` pixels, with almost no data: a decompression bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


def test_a_bomb_header_is_refused_by_its_size_under_the_default_limit():
    with pytest.raises(MediaError, match=r"image of 9000x9000 pixels exceeds max_image_pixels=67108864"):
        load_image(_png_claiming(9000, 9000))
    # Past twice Pillow's own limit, Pillow refuses while opening; still the same kind of error, no allocation.
    with pytest.raises(MediaError, match=r"exceeds max_image_pixels=67108864 \(Image size \(1600000000 pixels\)"):
        load_image(_png_claiming(40000, 40000))


def test_a_long_data_url_is_not_repeated_in_the_message():
    url = "data:image/png;base64," + base64.b64encode(b"x" * 3000).decode()
    with pytest.raises(MediaError) as caught:
        load_image(url)
    assert len(str(caught.value)) < 200


def test_load_images_keeps_order_and_puts_errors_in_their_slots(picture):
    pixels, data, path = picture
    other = _pixels(9)
    sources = [data, b"garbage", _encode(other, "PNG"), "/missing.png", path, "http://example.com/x.png"]
    results = load_images(sources, max_workers=3)
    assert len(results) == len(sources)
    np.testing.assert_array_equal(np.asarray(results[0]), pixels)
    np.testing.assert_array_equal(np.asarray(results[2]), other)
    np.testing.assert_array_equal(np.asarray(results[4]), pixels)
    assert isinstance(results[1], MediaError) and "cannot identify image file" in str(results[1])
    assert isinstance(results[3], MediaError) and "file not found: /missing.png" in str(results[3])
    assert isinstance(results[5], MediaError) and "allow_remote_media=True" in str(results[5])
    assert load_images([]) == []


def test_a_long_missing_path_keeps_its_file_name_in_the_error():
    path = "/data/" + "nested/" * 30 + "photo_0042.png"
    with pytest.raises(MediaError) as error:
        load_image(path)
    message = str(error.value)
    assert message.startswith("file not found: /data/nested/") and message.endswith("/photo_0042.png")
    assert "..." in message and len(message) < 120  # shortened, not the whole path


class _Server:
    """A loopback HTTP server on a thread, serving `routes` (path → bytes); anything else is a 404. A path with
    "unsized" in it is sent without a Content-Length (the body ends when the connection closes)."""

    def __init__(self, routes: dict[str, bytes]) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = routes.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if "unsized" not in self.path:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # keep the test output quiet
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def test_http_with_the_opt_in_loads_from_a_loopback_server(picture, monkeypatch):
    pixels, data, _ = picture
    with _Server({"/a.png": data, "/big.png": b"\0" * 2048, "/big-unsized.png": b"\0" * 2048}) as server:
        url = server.url + "/a.png"
        with pytest.raises(MediaError, match="allow_remote_media=True"):
            load_image(url)
        image = load_image(url, allow_remote_media=True, timeout_s=5)
        np.testing.assert_array_equal(np.asarray(image), pixels)
        with pytest.raises(MediaError, match="HTTP 404"):
            load_image(server.url + "/missing.png", allow_remote_media=True, timeout_s=5)
        loaded = load_images([url, "/missing.png", url], allow_remote_media=True)
        assert isinstance(loaded[1], MediaError)
        assert image_hash(loaded[0]) == image_hash(loaded[2]) == image_hash(Image.fromarray(pixels))
        monkeypatch.setattr(media, "MAX_REMOTE_BYTES", 1024)
        for path in ("/big.png", "/big-unsized.png"):  # refused by its Content-Length, and while reading
            with pytest.raises(MediaError, match="exceeds the 1024-byte limit"):
                load_image(server.url + path, allow_remote_media=True, timeout_s=5)
