"""Image sources → decoded RGB PIL images, each failure a `MediaError` that says what was wrong with which source.

A source is bytes, a PIL image, a local path (str / Path / `file://` URL), a `data:image/...;base64,` URL, an HF
`datasets` Image feature dict (`{"bytes", "path"}`), or, only when the user opts in with `allow_remote_media`, an
http(s) URL. The size is read from the header before the pixels are decoded, so an oversized image (a decompression
bomb) costs a header read, not the memory. Only raster formats a photo or a screenshot comes in are opened: fewer
decoders reachable from untrusted bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from PIL import Image, UnidentifiedImageError

T = TypeVar("T")
R = TypeVar("R")
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_REMOTE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
_SHOWN_CHARS = 80  # how much of a path or URL a message repeats: enough to find it, not a whole data payload
_URL_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+):")
_KNOWN_SCHEMES = ("data", "file", "http", "https")
# What Pillow raises on bytes it cannot decode: a truncated file is an OSError, some broken headers SyntaxError.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


class MediaError(ValueError):
    """An image that cannot be used: its message names the source (kind and a short prefix) and the fault."""


def load_image(source: Any, *, allow_remote_media: bool = False, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               timeout_s: float = 10.0) -> Image.Image:
    """`source` decoded, fully (a truncated file fails here), as an RGB image; MediaError when it cannot be."""
    if isinstance(source, Image.Image):
        _check_pixels(source, "PIL image", max_image_pixels)
        try:
            source.load()
            return source.convert("RGB")
        except _DECODE_ERRORS as exc:
            raise MediaError(f"PIL image: does not decode ({_reason(exc)})") from None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), f"image bytes ({len(source)} B)", max_image_pixels)
    if isinstance(source, dict):
        return _load_feature_dict(source, max_image_pixels)
    if isinstance(source, Path):
        return _load_path(source, max_image_pixels)
    if isinstance(source, str):
        return _load_string(source, allow_remote_media, max_image_pixels, timeout_s)
    raise MediaError(f"unsupported image source of type {type(source).__name__} (give bytes, a PIL image, a path, "
                     f"a data: / file:// URL, or a {{'bytes', 'path'}} dict)")


def load_images(sources: list[Any], *, allow_remote_media: bool = False,
                max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, max_workers: int = 4,
                timeout_s: float = 10.0) -> list[Image.Image | MediaError]:
    """Each source loaded as `load_image` does, on up to `max_workers` threads (Pillow's decoders release the GIL),
    in the order given; a source that fails has its MediaError in its slot, so the caller fails that row alone."""
    sources = list(sources)

    def load(source: Any) -> Image.Image | MediaError:
        try:
            return load_image(source, allow_remote_media=allow_remote_media, max_image_pixels=max_image_pixels,
                              timeout_s=timeout_s)
        except MediaError as exc:
            return exc

    return map_on_threads(load, sources, max_workers)


def map_on_threads(fn: Callable[[T], R], items: list[T], max_workers: int) -> list[R]:
    """`[fn(item) for item in items]` on up to `max_workers` threads (decoding and resizing release the GIL), in
    order; on the caller's thread for one item or one worker."""
    if len(items) <= 1 or max_workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="batchllm-media") as pool:
        return list(pool.map(fn, items))


def image_hash(image: Image.Image) -> str:
    """Hex sha256 of the picture's RGB pixels and size: the same picture has one hash however it was given (PNG
    bytes, a path, a PIL image); any pixel change gives another. Keys the encoder-output and prefix caches."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = hashlib.sha256(f"{rgb.mode}:{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def _decode(data: bytes | Path, what: str, max_image_pixels: int) -> Image.Image:
    if isinstance(data, bytes) and not data:
        raise MediaError(f"{what}: empty")
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data, formats=FORMATS) as image:
            _check_pixels(image, what, max_image_pixels)
            image.load()
            return image.convert("RGB")
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(f"{what}: not a PNG/JPEG/WebP/GIF/BMP image (cannot identify image file)") from None
    except Image.DecompressionBombError as exc:
        # Pillow refuses sizes past twice its own limit while opening, before our check sees the size.
        raise MediaError(f"{what}: image exceeds max_image_pixels={max_image_pixels} ({_reason(exc)})") from None
    except _DECODE_ERRORS as exc:
        raise MediaError(f"{what}: corrupt or truncated image ({_reason(exc)})") from None


def _check_pixels(image: Image.Image, what: str, max_image_pixels: int) -> None:
    width, height = image.size
    if width * height > max_image_pixels:
        raise MediaError(f"{what}: image of {width}x{height} pixels exceeds max_image_pixels={max_image_pixels}")


def _load_string(source: str, allow_remote_media: bool, max_image_pixels: int, timeout_s: float) -> Image.Image:
    scheme = _URL_SCHEME.match(source)
    name = "" if scheme is None else scheme.group(1).lower()
    if name not in _KNOWN_SCHEMES and "://" not in source[:len(name) + 3]:  # "a:b.png" is a file name, not a URL
        return _load_path(Path(source), max_image_pixels)
    if name == "data":
        return _decode(_data_url_bytes(source), "data URL", max_image_pixels)
    if name == "file":
        parsed = urllib.parse.urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"file URL {_short(source)}: names host {parsed.netloc!r}; only local files are read")
        return _load_path(Path(urllib.request.url2pathname(parsed.path)), max_image_pixels)
    if name in ("http", "https"):
        if not allow_remote_media:
            raise MediaError(f"URL {_short(source)}: http(s) URLs are refused unless allow_remote_media=True")
        return _decode(_fetch(source, timeout_s), f"URL {_short(source)}", max_image_pixels)
    raise MediaError(f"URL {_short(source)}: unsupported scheme {name!r} (use a path, file://, data:, or http(s))")


def _load_path(path: Path, max_image_pixels: int) -> Image.Image:
    if not path.exists():
        raise MediaError(f"file not found: {_short(str(path))}")
    if not path.is_file():
        raise MediaError(f"not a file: {_short(str(path))}")
    return _decode(path, f"file {_short(str(path))}", max_image_pixels)


def _load_feature_dict(source: dict, max_image_pixels: int) -> Image.Image:
    """HF `datasets` Image features decode to `{"bytes": ..., "path": ...}`; the bytes are the image when present
    (the path may name a file on the machine that wrote the dataset)."""
    unknown = sorted(set(source) - {"bytes", "path"})
    if unknown:
        raise MediaError(f"image dict: unknown key {unknown[0]!r} (an image dict has 'bytes' and/or 'path')")
    data, path = source.get("bytes"), source.get("path")
    if data is not None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MediaError(f"image dict: 'bytes' must be bytes, got {type(data).__name__}")
        return _decode(bytes(data), f"image dict bytes ({len(data)} B)", max_image_pixels)
    if isinstance(path, (str, Path)):
        return _load_path(Path(path), max_image_pixels)
    raise MediaError("image dict: has neither 'bytes' nor 'path'")


def _data_url_bytes(url: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError("data URL: no ',' between the header and the data")
    media_type, *params = header[len("data:"):].split(";")
    if not media_type.lower().startswith("image/"):
        raise MediaError(f"data URL: media type {media_type[:40]!r} is not an image/* type")
    if "base64" not in (p.lower() for p in params):
        raise MediaError("data URL: the data must be base64 (data:image/...;base64,...)")
    try:
        return base64.b64decode(urllib.parse.unquote("".join(payload.split())), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data URL: the data is not valid base64") from None


def _fetch(url: str, timeout_s: float) -> bytes:
    what = f"URL {_short(url)}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > MAX_REMOTE_BYTES:
                raise MediaError(f"{what}: response of {int(declared)} bytes exceeds the {MAX_REMOTE_BYTES}-byte "
                                 f"limit")
            data = response.read(MAX_REMOTE_BYTES + 1)
    except MediaError:
        raise
    except urllib.error.HTTPError as exc:
        raise MediaError(f"{what}: fetch failed (HTTP {exc.code} {exc.reason})") from None
    except urllib.error.URLError as exc:
        raise MediaError(f"{what}: fetch failed ({exc.reason})") from None
    except (OSError, ValueError) as exc:  # timeouts, resets, malformed URLs
        raise MediaError(f"{what}: fetch failed ({_reason(exc)})") from None
    if len(data) > MAX_REMOTE_BYTES:
        raise MediaError(f"{what}: response exceeds the {MAX_REMOTE_BYTES}-byte limit")
    return data


def _short(text: str) -> str:
    """Both ends of a long text: a path's file name is at its end."""
    if len(text) <= _SHOWN_CHARS:
        return text
    head = _SHOWN_CHARS // 2
    return text[:head] + "..." + text[-(_SHOWN_CHARS - head):]


def _reason(exc: BaseException) -> str:
    """An exception's text without any object reprs Pillow puts in it, cut short."""
    return _short(re.sub(r"<[^>]*>", "", str(exc)).strip() or type(exc).__name__)
