"""Image sources → `ProcessedImage`s: decoding and the model's image processor on worker threads, and the images a
table repeats (a logo, a product shot per variant) processed once.

Pillow's decoders and resizes and numpy's normalisation release the GIL, so a few threads keep up with the GPU.
Sources given as bytes (raw, an HF Image feature's bytes, or a `data:` URL) are remembered by a digest of their
bytes, least recently used first out once the arrays held pass `max_bytes`; paths and URLs are not (the file behind
them may change), nor are PIL images (hashing their pixels costs what processing them does). A failure is never
remembered: the source is tried again when it comes again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from batchllm.multimodal.inputs import ProcessedImage
from batchllm.multimodal.media import MediaError, load_image, map_on_threads

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class ProcessedImages:
    def __init__(self, preprocess: Callable[[Any], ProcessedImage], allow_remote_media: bool = False,
                 max_bytes: int = DEFAULT_MAX_BYTES, max_workers: int = 4) -> None:
        """`preprocess`: a decoded RGB PIL image → its ProcessedImage (the model's image processor); a ValueError
        it raises fails that image, with its message."""
        self.preprocess = preprocess
        self.allow_remote_media = allow_remote_media
        self.max_bytes = max_bytes
        self.max_workers = max_workers
        self.num_hits = 0
        self._held: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self._held_bytes = 0
        self._lock = threading.Lock()  # the server prepares requests on several threads

    def get(self, sources: list[Any]) -> list[ProcessedImage | MediaError]:
        """Each source's ProcessedImage, or the MediaError that says why it cannot be used, in the order given."""
        keys = [_source_key(source) for source in sources]
        results: list[ProcessedImage | MediaError | None] = [None] * len(sources)
        todo: dict[Any, list[int]] = {}  # one job per distinct keyed source; unkeyed sources one each
        with self._lock:
            for i, key in enumerate(keys):
                held = self._held.get(key) if key is not None else None
                if held is not None:
                    self._held.move_to_end(key)
                    self.num_hits += 1
                    results[i] = held
                else:
                    todo.setdefault(key if key is not None else ("unkeyed", i), []).append(i)
        jobs = list(todo.values())
        done = map_on_threads(lambda slots: self._load(sources[slots[0]]), jobs, self.max_workers)
        for slots, result in zip(jobs, done, strict=True):
            for i in slots:
                results[i] = result
            if keys[slots[0]] is not None and isinstance(result, ProcessedImage):
                self._remember(keys[slots[0]], result)
        return results  # type: ignore[return-value]

    def _load(self, source: Any) -> ProcessedImage | MediaError:
        try:
            image = load_image(source, allow_remote_media=self.allow_remote_media)
            return self.preprocess(image)
        except MediaError as exc:
            return exc
        except ValueError as exc:  # the image processor's own refusals (e.g. an image too thin to patch)
            return MediaError(str(exc))

    def _remember(self, key: bytes, image: ProcessedImage) -> None:
        size = sum(getattr(value, "nbytes", 0) for value in image.data.values())
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._held:
                return
            self._held[key] = image
            self._held_bytes += size
            while self._held_bytes > self.max_bytes:
                _, dropped = self._held.popitem(last=False)
                self._held_bytes -= sum(getattr(value, "nbytes", 0) for value in dropped.data.values())


def _source_key(source: Any) -> bytes | None:
    """A digest of the source's bytes where the source is its bytes; None where it names them elsewhere."""
    if isinstance(source, dict) and source.get("bytes"):
        source = source["bytes"]
    if isinstance(source, (bytes, bytearray, memoryview)):
        return b"b" + hashlib.blake2b(source, digest_size=20).digest()
    if isinstance(source, str) and source[:5].lower() == "data:":
        return b"d" + hashlib.blake2b(source.encode(), digest_size=20).digest()
    return None
