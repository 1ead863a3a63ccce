"""Integer (4- or 8-bit) weights with 16-bit activations: the one layout every checkpoint format becomes.

`PackedInt` holds one linear weight `[out = N, in = K]` as
- `qweight [K / pack, N]` int32, K-packed: code (k, n) sits at bits `bits * (k % pack)` of word `(k // pack, n)`;
- `scales [G, N]` float32 and `zeros [G, N]` uint8, the unsigned zero point of each group (2**(bits-1) for
  symmetric weights), so `w[n, k] = (code - zero) * scale` exactly, in float32;
- `g_idx [K]` int32 when groups are given per input feature (GPTQ act-order): row k is in group `g_idx[k]`,
  otherwise in group `k // group_size`.

It is GPTQ's own qweight layout with the zero points unpacked (they are a few kilobytes, and a uint8 per group
keeps GPTQ v1's "stored zero + 1", which can be 16, and every tensor-parallel split simple). Scales stay float32
so fp16 checkpoint scales are exact in a bf16 model. The GEMM is `batchllm.kernels.int_matmul`; the CPU
dequantizes once on load.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from batchllm.kernels.reference import dequantize_int, unpack_int


@dataclass(frozen=True, slots=True)
class PackedInt:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor | None


# The parts by name: an integer linear layer holds one parameter of each (`g_idx` for act-order layers only).
PACKED_PARTS = tuple(field.name for field in fields(PackedInt))


def pack_int(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes `[K, N]` (0 .. 2**bits - 1) → K-packed int32 `[K / pack, N]` (the inverse of `unpack_int`)."""
    pack = 32 // bits
    rows, cols = codes.shape
    if rows % pack:
        raise ValueError(f"{rows} input features do not pack into int32 words of {pack} {bits}-bit codes")
    words = codes.to(torch.int64).reshape(rows // pack, pack, cols)
    shifts = torch.arange(pack, device=codes.device, dtype=torch.int64)[None, :, None] * bits
    packed = (words << shifts).sum(dim=1)  # disjoint bit fields: the sum is an OR
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the same 32 bits, signed


def quantize_int_rtn(weight: torch.Tensor, bits: int, group_size: int) -> PackedInt:
    """Symmetric round-to-nearest quantization of `weight [N, K]` per group of `group_size` input features
    (-1: all of them): the random weights of `load_format="dummy"`, the same values the unquantized model gets."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    group_of = torch.arange(in_features, device=weight.device) // size  # the last group may be partial
    absmax = torch.zeros(out_features, int(group_of[-1]) + 1, device=weight.device)
    absmax.scatter_reduce_(1, group_of.expand(out_features, -1), weight.float().abs(), "amax")
    half = 2 ** (bits - 1)
    scale = (absmax / (half - 1)).clamp_min(1e-12)
    codes = (weight.float() / scale[:, group_of]).round().clamp(-half, half - 1) + half
    zeros = torch.full_like(scale, half, dtype=torch.uint8)
    return PackedInt(pack_int(codes.T, bits), scale.T.contiguous(), zeros.T.contiguous(), None)


def sort_act_order(qweight: torch.Tensor, g_idx: torch.Tensor, bits: int, group_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reorder an act-order weight's input features so each group's rows are contiguous, once, at load:
    `(qweight', g_idx' or None, perm)` with `x[:, perm] @ w'` equal to `x @ w`. g_idx' is None when the sorted
    groups are exactly `k // group_size` (the whole checkpoint on one rank), so the GEMM reads one scale row
    per group; a rank's slice of a row-parallel layer keeps it (its groups are partial)."""
    perm = torch.sort(g_idx, stable=True).indices
    codes = unpack_int(qweight, bits).index_select(0, perm)
    sorted_groups = g_idx.index_select(0, perm)
    in_order = torch.arange(len(g_idx), device=g_idx.device) // group_size
    return pack_int(codes, bits), (None if torch.equal(sorted_groups, in_order) else sorted_groups), perm


def dense_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                 g_idx: torch.Tensor | None, perm: torch.Tensor | None) -> torch.Tensor:
    """Float32 `[N, K]` in the checkpoint's input-feature order (undoing `sort_act_order`'s `perm`)."""
    w = dequantize_int(qweight, scales, zeros, bits, group_size, g_idx)
    if perm is not None:
        unsorted = torch.empty_like(w)
        unsorted[perm] = w
        w = unsorted
    return w.T
