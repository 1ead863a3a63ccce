"""Qwen2.5-VL's vision tower: a ViT over 14x14 patches of any image size, windowed attention, a 2x2 patch merger.

The processor (transformers' Qwen2-VL image processor) hands over `pixel_values [patches, C*T*ps*ps]` with the
patches of every 2x2 merge cell adjacent, and `grid_thw` (temporal, height, width in patches) per image. Most
blocks attend only inside windows of `window_size` pixels; the blocks in `fullatt_block_indexes` attend over the
whole image. Tokens are permuted once so that every window is a contiguous run, which lets both kinds of block
run as attention over contiguous segments; the merger's output is permuted back to raster order at the end.
Parameter names equal the checkpoint's under `model.visual.` (transformers 5) or `visual.` (transformers 4).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchllm import kernels
from batchllm.model.checkpoint_tensor import copy_checked
from batchllm.model.qwen2_5_vl_config import VisionTowerConfig
from batchllm.model.uploads import to_device

_RMS_EPS = 1e-6
_ROPE_THETA = 10000.0
_MAX_TABLE_PATCHES = 1 << 18  # patches whose window order and rotary tables are kept (~84 MB float32)
_PAD = 64  # the MLP's intermediate size is padded to a multiple of this (see _MLP)


def image_token_count(grid_thw_row: Any, spatial_merge_size: int) -> int:
    """How many placeholder tokens (merged cells) one image of this patch grid takes in the prompt."""
    t, h, w = (int(x) for x in grid_thw_row)
    return t * h * w // spatial_merge_size**2


class _RMSNorm(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decoder's fused norm: the variance in float32, the cast back before the weight multiply (HF's order).
        return kernels.rms_norm(x, self.weight, _RMS_EPS)


class _Attention(nn.Module):
    def __init__(self, config: VisionTowerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True, dtype=dtype)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[tuple[int, slice | torch.Tensor]]) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)  # each [tokens, heads, head_dim]
        # The decoder's rotary kernel, in place, each token its own cos/sin row (positions = row numbers).
        q, k = kernels.apply_rotary(torch.arange(q.shape[0], device=q.device), q, k, cos, sin)
        out = torch.empty_like(q)
        for length, where in segments:  # equal-length segments go through one batched call
            if isinstance(where, slice):  # consecutive: views, no gather and no scatter
                qs, ks, vs = (t[where].unflatten(0, (-1, length)).transpose(1, 2) for t in (q, k, v))
                out[where] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).flatten(0, 1)
            else:  # index [segments, length]
                qs, ks, vs = (t[where].transpose(1, 2) for t in (q, k, v))  # [segments, heads, length, head_dim]
                out[where] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.flatten(1))


class _MLP(nn.Module):
    """The gated MLP, its intermediate size zero-padded to a multiple of `_PAD`: the released towers' 3420 is not
    a multiple of 8, so 16-bit GEMMs over it miss the aligned (TMA / 16-byte) kernels and run at a fraction of the
    rate. Padded gate/up rows give silu(0) * 0 = 0 and padded down columns are zero: the output is unchanged."""

    def __init__(self, config: VisionTowerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, size = config.hidden_size, config.intermediate_size
        padded = -(-size // _PAD) * _PAD
        self.gate_proj = nn.Linear(hidden, padded, bias=True, dtype=dtype)
        self.up_proj = nn.Linear(hidden, padded, bias=True, dtype=dtype)
        self.down_proj = nn.Linear(padded, hidden, bias=True, dtype=dtype)
        for linear in (self.gate_proj, self.up_proj):
            linear.weight.checkpoint_shapes = {None: (size, hidden)}
            linear.bias.checkpoint_shapes = {None: (size,)}
        self.down_proj.weight.checkpoint_shapes = {None: (hidden, size)}
        for param in (*self.gate_proj.parameters(), *self.up_proj.parameters(), self.down_proj.weight):
            param.weight_loader = _load_padded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)).mul_(self.up_proj(x)))

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """`load_state_dict` with the checkpoint's unpadded tensors (as the loader's `_load_padded` does)."""
        for name, param in self.named_parameters():
            key, shapes = prefix + name, getattr(param, "checkpoint_shapes", None)
            if shapes is not None and key in state_dict and state_dict[key].shape != param.shape:
                state_dict[key] = _padded_copy(torch.empty_like(param), state_dict[key], shapes[None])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _load_padded(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    """The loader's hook: a checkpoint tensor into the leading corner of its zero-padded parameter."""
    _padded_copy(param.data, loaded, param.checkpoint_shapes[None])


def _padded_copy(target: torch.Tensor, loaded: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """`target` zeroed, with `loaded` (checked to be `shape`) in its leading corner."""
    target.zero_()
    copy_checked(target[tuple(slice(0, n) for n in shape)], loaded)
    return target


class _Block(nn.Module):
    def __init__(self, config: VisionTowerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(config.hidden_size, dtype)
        self.norm2 = _RMSNorm(config.hidden_size, dtype)
        self.attn = _Attention(config, dtype)
        self.mlp = _MLP(config, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[tuple[int, slice | torch.Tensor]]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, config: VisionTowerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        # A Conv3d only to hold the checkpoint's 5-D weight: with stride == kernel it is a linear map over the
        # flattened patch, which a matmul computes without the convolution's reshapes.
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=False, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.flatten(1)
        if pixel_values.shape[-1] != weight.shape[1]:
            raise ValueError(f"pixel_values rows have {pixel_values.shape[-1]} features, the tower's patches "
                             f"{weight.shape[1]} (in_channels * temporal_patch_size * patch_size**2)")
        return pixel_values.to(weight.dtype) @ weight.T


class _PatchMerger(nn.Module):
    def __init__(self, config: VisionTowerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = _RMSNorm(config.hidden_size, dtype)
        self.mlp = nn.Sequential(nn.Linear(merged, merged, dtype=dtype), nn.GELU(),
                                 nn.Linear(merged, config.out_hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The merge**2 patches of a cell are adjacent rows, so a reshape concatenates them.
        return self.mlp(self.ln_q(x).reshape(-1, self.mlp[0].in_features))


class Qwen2_5_VisionTower(nn.Module):
    def __init__(self, vision_config: dict[str, Any] | VisionTowerConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        config = vision_config if isinstance(vision_config, VisionTowerConfig) else VisionTowerConfig.from_hf(
            vision_config)
        dtype = dtype or torch.get_default_dtype()
        self.config = config
        self.patch_embed = _PatchEmbed(config, dtype)
        self.blocks = nn.ModuleList(_Block(config, dtype) for _ in range(config.depth))
        self.merger = _PatchMerger(config, dtype)
        head_dim = config.hidden_size // config.num_heads
        # 2-D rotary: head_dim / 4 frequencies per axis, the h angles then the w angles fill half a head.
        quarter = head_dim // 4
        inv_freq = 1.0 / (_ROPE_THETA ** (torch.arange(quarter, dtype=torch.float32) * 2 / (head_dim // 2)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._tables: dict[tuple[int, int, int], tuple] = {}  # per image size: `_grid_tables`
        self._table_patches = 0

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """`pixel_values [patches, C*T*ps*ps]`, `grid_thw [images, 3]` -> `[patches / merge**2, out_hidden]`,
        the merged cells of all images in image order, each image's in raster order of its merged grid."""
        merge = self.config.spatial_merge_size
        grids = [tuple(int(x) for x in row) for row in torch.as_tensor(grid_thw).reshape(-1, 3).tolist()]
        for i, (t, h, w) in enumerate(grids):
            if min(t, h, w) < 1 or h % merge or w % merge:
                raise ValueError(f"grid_thw row {i} = {(t, h, w)}: positive sizes, h and w multiples of {merge}")
        if sum(t * h * w for t, h, w in grids) != pixel_values.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw describes "
                             f"{sum(t * h * w for t, h, w in grids)}")
        device = pixel_values.device
        order, window_lengths = self._window_order(grids, device)
        order = to_device(order, device)
        unit = merge * merge
        # Cell order -> patch order: each merged cell's `unit` patches stay adjacent.
        patch_order = (order[:, None] * unit + torch.arange(unit, device=device)).flatten()

        x = self.patch_embed(pixel_values)[patch_order]
        cos, sin = self._rotary(grids, device)
        cos, sin = cos[patch_order], sin[patch_order]
        # Full attention per frame (a still image is one frame), as the reference's cu_seqlens.
        frame_segments = _group_segments([h * w for t, h, w in grids for _ in range(t)], device)
        window_segments = _group_segments([n * unit for n in window_lengths], device)
        for i, block in enumerate(self.blocks):
            full = i in self.config.fullatt_block_indexes
            x = block(x, cos, sin, frame_segments if full else window_segments)
        merged = self.merger(x)
        return merged[torch.argsort(order)]

    def _rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[patches, head_dim / 2]` in the processor's patch order: (h, w) of each patch, the merge cells'
        patches adjacent; the angles are [h-angles, w-angles], one per rotate-half pair (neox style)."""
        tables = [self._grid_tables(grid, device) for grid in grids]
        return torch.cat([table[2] for table in tables]), torch.cat([table[3] for table in tables])

    def _window_order(self, grids: list[tuple[int, int, int]],
                      device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """The merged cells of all images, re-ordered window by window (windows in raster order, cells inside a
        window in raster order), and each window's cell count; edge windows are smaller and never cross images."""
        order, lengths, offset = [], [], 0
        for grid in grids:
            local, local_lengths, _, _ = self._grid_tables(grid, device)
            order.append(local + offset)
            lengths += local_lengths
            offset += local.numel()
        return torch.cat(order), lengths

    def _grid_tables(self, grid: tuple[int, int, int], device: torch.device) -> tuple:
        """One image size's window order (host), window lengths and rotary cos/sin (on `device`), computed once
        per size: a step's images mostly share a few sizes, and this Python runs on the host while the device
        waits for the step's image rows. Dropped all at once past `_MAX_TABLE_PATCHES` patches."""
        if grid not in self._tables:
            patches = grid[0] * grid[1] * grid[2]
            if self._table_patches + patches > _MAX_TABLE_PATCHES:
                self._tables.clear()
                self._table_patches = 0
            self._tables[grid] = (*self._local_window_order(grid), *self._local_rotary(grid, device))
            self._table_patches += patches
        return self._tables[grid]

    def _local_rotary(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        merge = self.config.spatial_merge_size
        t, h, w = grid
        hs = torch.arange(h, device=device)[:, None].expand(h, w)
        ws = torch.arange(w, device=device)[None, :].expand(h, w)
        hw = torch.stack((hs, ws), dim=-1).reshape(h // merge, merge, w // merge, merge, 2)
        coords = hw.transpose(1, 2).reshape(-1, 2).repeat(t, 1)
        angles = coords.float()[:, :, None] * self.inv_freq.to(device)  # [patches, 2, quarter]
        angles = angles.flatten(1)  # [patches, head_dim / 2]: the rotate-half pairs' angles
        return angles.cos(), angles.sin()

    def _local_window_order(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, list[int]]:
        merge = self.config.spatial_merge_size
        side = self.config.window_size // self.config.patch_size // merge  # window side in merged cells
        t, h, w = grid
        gh, gw = h // merge, w // merge
        order, lengths = [], []
        for frame in torch.arange(t * gh * gw).reshape(t, gh, gw):
            for top in range(0, gh, side):
                for left in range(0, gw, side):
                    window = frame[top:top + side, left:left + side].flatten()
                    order.append(window)
                    lengths.append(window.numel())
        return torch.cat(order), lengths


def _group_segments(lengths: list[int], device: torch.device) -> list[tuple[int, slice | torch.Tensor]]:
    """Contiguous segments of these lengths, grouped by length, so attention runs one batched call per distinct
    length instead of one per window: `(length, where)`, `where` a slice when the group's segments follow each other
    (images of one size: every window full), else an `index [segments, length]`."""
    starts = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0)
    sizes = torch.tensor(lengths, dtype=torch.long)
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for length in sorted(set(lengths)):
        first = starts[sizes == length]
        if torch.equal(first, first[0] + length * torch.arange(len(first))):
            groups.append((length, slice(int(first[0]), int(first[0]) + length * len(first))))
        else:
            groups.append((length, to_device(first[:, None] + torch.arange(length), device)))
    return groups
