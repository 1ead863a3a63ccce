"""What a table job pins about its images: one SHA-256 over every row's image bytes, in row order.

The input's own fingerprint (`sources.py`) covers images stored in it only as far as the Parquet footer tells (sizes
and statistics), and images named by path (a CSV of paths, a path column, `file://` URLs in messages) not at all.
So a job with images reads each image's bytes once when it starts (and when it resumes) and pins their hash: an
image changed, replaced or added since the job began makes the resume refuse (`ManifestMismatch` on
`images.sha256`) instead of mixing captions of two pictures. Reading the bytes costs one pass over the images,
far less than running the model on them; nothing is decoded.

Not fetched: http(s) URLs are pinned by their text (fetching a remote image twice is the user's call, not the
job's). A file that is missing is pinned as missing: if it appears later, the resume refuses too (the row that
failed on it would be kept otherwise); start a new output to run it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchllm.connectors.cells import is_missing, to_plain
from batchllm.connectors.images import has_image_parts
from batchllm.connectors.options import PromptSpec
from batchllm.multimodal.messages import split_chat_images

_BATCH_ROWS = 256
_MISSING = b"missing"


def images_identity(source: Any, spec: PromptSpec) -> dict[str, Any] | None:
    """`{"column", "sha256", "images"}` for a job whose rows carry images (`image_column`, or a messages column,
    whose image parts are found row by row); None for a job of text only, which keeps its manifest as before."""
    column = spec.image_column or spec.messages_column
    if column is None or (spec.image_column is None and not _may_hold_images(source.schema.field(column).type)):
        return None  # text messages: nothing to read
    digest, count = hashlib.sha256(), 0
    for _, batch in source.batches(_BATCH_ROWS, lambda first, end: False):
        for cell in batch.column(column).to_pylist():
            for image in _images_of(cell, messages=spec.image_column is None):
                digest.update(_image_digest(image))
                count += 1
            digest.update(b"\x00")  # a row boundary: the same images over other rows are another input
    if count == 0 and spec.image_column is None:
        return None  # messages without images: a text job
    return {"column": column, "sha256": digest.hexdigest(), "images": count}


def _may_hold_images(kind: pa.DataType) -> bool:
    """Whether a messages column's type has room for image parts (a struct field `image_url` or `image`)."""
    if pa.types.is_struct(kind):
        return any(field.name in ("image_url", "image") or _may_hold_images(field.type) for field in kind)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _may_hold_images(kind.value_type)
    return False


def _images_of(cell: Any, messages: bool) -> list[Any]:
    value = to_plain(cell)
    if is_missing(value):
        return []
    if not messages:
        return value if isinstance(value, list) else [value]
    if not isinstance(value, list) or not has_image_parts(value):
        return []
    try:
        return split_chat_images(value)[1]
    except ValueError:  # a malformed part fails its row, with nothing to pin
        return []


def _image_digest(image: Any) -> bytes:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return hashlib.sha256(bytes(image)).digest()
    if isinstance(image, dict):  # an HF Image value: its bytes when present, else its file
        data = image.get("bytes")
        return _image_digest(data if data is not None else image.get("path"))
    if isinstance(image, str):
        lowered = image[:8].lower()
        if lowered.startswith(("data:", "http:", "https:")):  # the text is the image (data:) or its only identity
            return hashlib.sha256(image.encode()).digest()
        path = Path(image[len("file://"):] if lowered.startswith("file://") else image)
        return _file_digest(path)
    return hashlib.sha256(repr(image).encode()).digest()  # not an image source: its row fails, as it will again


def _file_digest(path: Path) -> bytes:
    try:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").digest()
    except OSError:
        return hashlib.sha256(_MISSING + str(path).encode()).digest()
