"""Qwen2-VL's multimodal RoPE positions for a prompt with images: (temporal, height, width) per token.

Pure numpy, no torch: the engine's preprocessing computes these when a request arrives. Text tokens count up
from the previous maximum + 1 in all three sections alike; an image's run of placeholder tokens (one per merged
cell, raster order) takes its cell's (t, h, w) grid coordinates, offset by the position where the run starts. A
token generated at prompt index i >= len(prompt) sits at position i + delta in all three sections.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(input_ids: Sequence[int], image_grid_thw: Sequence[tuple[int, int, int]], image_token_id: int,
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """`([3, len(input_ids)] int64 positions, delta)` with delta = max position + 1 - len(input_ids)."""
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    runs = _image_runs(ids == image_token_id)
    if len(runs) != len(image_grid_thw):
        raise ValueError(f"prompt has {len(runs)} runs of image token {image_token_id}, image_grid_thw "
                         f"{len(image_grid_thw)} images")
    positions = np.empty((3, len(ids)), dtype=np.int64)
    next_position, cursor = 0, 0
    for i, ((start, end), grid) in enumerate(zip(runs, image_grid_thw)):
        t, h, w = (int(x) for x in grid)
        if h % spatial_merge_size or w % spatial_merge_size or min(t, h, w) < 1:
            raise ValueError(f"image_grid_thw[{i}] = {(t, h, w)}: positive, h and w multiples of "
                             f"{spatial_merge_size}")
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if end - start != t * gh * gw:
            raise ValueError(f"image {i}: {end - start} image tokens at prompt index {start}, its grid "
                             f"{(t, h, w)} needs t*h*w / {spatial_merge_size}**2 = {t * gh * gw}")
        positions[:, cursor:start] = next_position + np.arange(start - cursor)
        base = next_position + start - cursor
        cell_t, cell_h, cell_w = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[:, start:end] = base + np.stack((cell_t.ravel(), cell_h.ravel(), cell_w.ravel()))
        next_position = int(positions[:, start:end].max()) + 1
        cursor = end
    positions[:, cursor:] = next_position + np.arange(len(ids) - cursor)
    delta = (int(positions.max()) + 1 if len(ids) else 0) - len(ids)
    return positions, delta


def _image_runs(is_image: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of image tokens."""
    edges = np.diff(np.concatenate(([0], is_image.astype(np.int8), [0])))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
