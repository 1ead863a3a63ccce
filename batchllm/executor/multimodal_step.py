"""A step's images on the runner side: the encoder step, its output cache, and the multimodal positions.

Rows whose scheduled tokens reach into a prompt's images run eagerly: their input embeddings are the token
embeddings with the encoder's rows put at the image placeholders, (multimodal RoPE) their positions are `[3, T]`,
and (Gemma 3) their image tokens' key limits reach their image's end. Every other row of a multimodal model, decode
included, has one position per token (`index + delta` past its last image) and replays CUDA graphs as a text model
does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from batchllm.model.uploads import to_device
from batchllm.multimodal.inputs import ImageInput, MultiModalPrompt

# Encoder outputs kept for reuse, in embedding rows (Qwen2.5-VL-7B: 3,584 bf16 values each, 114 MB for 16,384 rows).
DEFAULT_CACHE_ROWS = 16384


@dataclass(slots=True)
class MultiModalRow:
    """A scheduled row of a request with images: its tokens `[num_computed, num_computed + num_tokens)` sit at
    flat indices `[flat_start, flat_start + num_tokens)` of the step."""

    mm: MultiModalPrompt
    flat_start: int
    num_computed: int
    num_tokens: int


class EncoderCache:
    """Encoder outputs by image content hash, least recently used first out, bounded in rows. The images a step
    needs are encoded together (one encoder call per step) and are never evicted during it."""

    def __init__(self, model: nn.Module, capacity_rows: int = DEFAULT_CACHE_ROWS) -> None:
        self.model = model
        self.capacity_rows = capacity_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.num_encoded = 0  # images run through the encoder (a cache hit is not)

    def get(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        missing = list({image.hash: image for image in images if image.hash not in self._entries}.values())
        if missing:
            for image, rows in zip(missing, self.model.encode_images([image.data for image in missing]), strict=True):
                if rows.shape[0] != image.length:
                    raise RuntimeError(f"the encoder gave {rows.shape[0]} rows for an image of {image.length} "
                                       f"placeholder tokens")
                self._entries[image.hash] = rows
                self._rows += rows.shape[0]
            self.num_encoded += len(missing)
        needed = {image.hash: self._entries[image.hash] for image in images}
        for key in needed:
            self._entries.move_to_end(key)
        while self._rows > self.capacity_rows and len(self._entries) > len(needed):
            key, rows = next(iter(self._entries.items()))
            if key in needed:
                break
            del self._entries[key]
            self._rows -= rows.shape[0]
        return needed


class MultiModalStep:
    def __init__(self, model: nn.Module, uses_mrope: bool, device: torch.device) -> None:
        self.model = model
        self.uses_mrope = uses_mrope
        self.device = device
        self.cache = EncoderCache(model)

    def positions_3d(self, rows: list[MultiModalRow], positions: np.ndarray) -> torch.Tensor:
        """The step's `[3, T]` positions: every token's 1-D position in all three components, but the prompt
        tokens before a row's last image, which take their (temporal, height, width) positions."""
        table = np.repeat(positions[None, :], 3, axis=0)
        for row in rows:
            end = min(row.num_computed + row.num_tokens, row.mm.last_image_end)
            if row.num_computed < end:
                count = end - row.num_computed
                table[:, row.flat_start:row.flat_start + count] = row.mm.mrope_positions[:, row.num_computed:end]
        return to_device(table, self.device)

    def key_limits(self, rows: list[MultiModalRow], positions: np.ndarray) -> torch.Tensor | None:
        """Gemma 3: each token's last visible key position (`AttentionMetadata.key_limit`), its own but for the
        image tokens, which see their whole image (the scheduler never ends a chunk inside one); None when no
        row's images attend both ways."""
        if not any(row.mm.bidirectional for row in rows):
            return None
        limits = positions.astype(np.int32)
        for row in rows:
            if not row.mm.bidirectional:
                continue
            start, end = row.num_computed, row.num_computed + row.num_tokens
            for image in row.mm.images:
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo < hi:
                    first = row.flat_start + lo - start
                    limits[first:first + hi - lo] = image.end - 1
        return to_device(limits, self.device, torch.int32)

    def inputs_embeds(self, input_ids: torch.Tensor, rows: list[MultiModalRow]) -> torch.Tensor:
        """The step's input embeddings: the tokens', with each image's encoder rows at its placeholder tokens
        (a chunk that splits an image takes the rows of its part)."""
        pieces: list[tuple[ImageInput, int, int, int]] = []  # (image, its first row, rows, flat index)
        for row in rows:
            start, end = row.num_computed, row.num_computed + row.num_tokens
            for image in row.mm.images:
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo < hi:
                    pieces.append((image, lo - image.offset, hi - lo, row.flat_start + lo - start))
        hidden = self.model.embed_input_ids(input_ids)
        if not pieces:
            return hidden
        encoded = self.cache.get([image for image, *_ in pieces])
        flat_rows = np.concatenate([np.arange(flat, flat + count) for _, _, count, flat in pieces])
        index = to_device(flat_rows, hidden.device)  # queued behind the running step, never waiting for it
        rows_of = torch.cat([encoded[image.hash][first:first + count] for image, first, count, _ in pieces])
        hidden[index] = rows_of.to(hidden.dtype)
        return hidden
