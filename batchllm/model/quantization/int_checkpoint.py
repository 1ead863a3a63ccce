"""Reading integer-weight checkpoint tensors: GPTQ, AWQ and compressed-tensors packings → `PackedInt`.

The integer linear method (`int_method.py`) meets each quantized linear at its primary tensor (`qweight`, or
`weight_packed`) and asks `int_weight` for the whole HF weight, reading its other tensors through `read` (they may
sit in another file).
Each packing, as its producer writes it (`out = N` output features, `in = K` input features, `pack = 32 / bits`):

- GPTQ: `qweight [K / pack, N]` int32 packed along K (our layout as is); `qzeros [G, N / pack]` packed along N,
  holding `zero - 1` in the "gptq" (v1) checkpoint_format (subtracted from whole words, as GPTQModel does) and `zero`
  in "gptq_v2"; `scales [G, N]` fp16;
  `g_idx [K]` the group of each input feature (trivial, `k // group_size`, without desc_act).
- AWQ GEMM: `qweight [K, N / 8]` packed along N in AutoAWQ's interleaved order (nibble i of word j holds column
  `8 j + _AWQ_ORDER[i]`); `qzeros [G, N / 8]` the same way; `scales [G, N]`.
- compressed-tensors pack-quantized: `weight_packed [N, K / pack]` packed along K, codes offset by
  2**(bits-1) (signed values stored unsigned); `weight_scale [N, G]`; `weight_zero_point [N / pack, G]`
  (asymmetric only) packed along N, offset the same way; `weight_shape [2]`; `weight_g_idx [K]` (act-order).
"""

from __future__ import annotations

import torch

from batchllm.kernels.reference import unpack_int
from batchllm.model.quantization import AWQ, COMPRESSED_TENSORS, GPTQ, QuantConfig
from batchllm.model.quantization.int_packed import PackedInt, pack_int
from batchllm.model.quantization.method import Reader

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def int_weight(name: str, read: Reader, config: QuantConfig,
               shape: tuple[int, int]) -> PackedInt:
    """The HF weight `[N, K] = shape` whose primary tensor is `name`, in our layout; ValueError on a mismatch."""
    prefix = name.rsplit(".", 1)[0] + "."
    out_features, in_features = shape
    groups = 1 if config.group_size == -1 else -(-in_features // config.group_size)  # the last one may be partial
    if config.checkpoint_format == GPTQ:
        packed = _gptq(prefix, read, config)
    elif config.checkpoint_format == AWQ:
        packed = _awq(prefix, read, config)
    elif config.checkpoint_format == COMPRESSED_TENSORS:
        packed = _compressed_tensors(prefix, read, config, shape)
    else:
        raise ValueError("holds integer weights, but config.json has no quantization_config saying how they are packed")
    expected = {"qweight": (in_features // config.pack, out_features), "scales": (groups, out_features),
                "zeros": (groups, out_features)}
    for part, want in expected.items():
        got = tuple(getattr(packed, part).shape)
        if got != want:
            raise ValueError(f"unpacks to {part} of shape {got}, expected {want} for a {out_features} x {in_features} "
                             f"weight in {config.bits}-bit groups of {config.group_size}")
    return PackedInt(packed.qweight, packed.scales, packed.zeros, _group_index(packed.g_idx, config, in_features,
                                                                              groups))


def _gptq(prefix: str, read: Reader, config: QuantConfig) -> PackedInt:
    qzeros = read(prefix + "qzeros")
    if config.zero_plus_one:
        # v1 stores zero - 1, subtracted from whole words (0x11111111 for 4 bits, borrows included): adding it
        # back to the word, modulo 2**32, is the exact inverse, a zero point of 0 included.
        ones = sum(1 << (config.bits * i) for i in range(config.pack))
        words = (qzeros.to(torch.int64) + ones) % 2**32
        qzeros = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    zeros = _unpack_columns(qzeros, config.bits)
    return PackedInt(read(prefix + "qweight"), read(prefix + "scales").float(), zeros.to(torch.uint8),
                     read(prefix + "g_idx", required=False))


def _awq(prefix: str, read: Reader, config: QuantConfig) -> PackedInt:
    codes = _awq_columns(read(prefix + "qweight"))
    return PackedInt(pack_int(codes, config.bits), read(prefix + "scales").float(),
                     _awq_columns(read(prefix + "qzeros")).to(torch.uint8), None)


def _compressed_tensors(prefix: str, read: Reader, config: QuantConfig,
                        shape: tuple[int, int]) -> PackedInt:
    stored_shape = tuple(int(v) for v in read(prefix + "weight_shape").tolist())
    if stored_shape != shape:
        raise ValueError(f"weight_shape is {stored_shape}, expected {shape}")
    scales = read(prefix + "weight_scale").float().T.contiguous()
    packed_zeros = read(prefix + "weight_zero_point", required=False)
    if packed_zeros is None:  # symmetric: the signed zero point 0, stored offset like the codes
        zeros = torch.full(scales.shape, 2 ** (config.bits - 1))
    else:
        zeros = unpack_int(packed_zeros, config.bits)[: shape[0]].T
    return PackedInt(read(prefix + "weight_packed").T.contiguous(), scales, zeros.to(torch.uint8).contiguous(),
                     read(prefix + "weight_g_idx", required=False))


def _unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`[R, C / pack]` int32 packed along columns → codes `[R, C]`."""
    return unpack_int(packed.T.contiguous(), bits).T.contiguous()


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's `[R, C / 8]` interleaved nibbles → codes `[R, C]` in column order."""
    interleaved = _unpack_columns(packed, 4)
    columns = torch.arange(interleaved.shape[1]).reshape(-1, 8)
    destination = (columns // 8 * 8 + torch.tensor(_AWQ_ORDER)).reshape(-1)
    codes = torch.empty_like(interleaved)
    codes[:, destination] = interleaved
    return codes


def _group_index(g_idx: torch.Tensor | None, config: QuantConfig, in_features: int, groups: int
                 ) -> torch.Tensor | None:
    """An act-order layer's g_idx, checked; None for other layers (whose g_idx, if stored, must be trivial)."""
    if g_idx is None:
        if config.act_order:
            raise ValueError("is act-order (desc_act / actorder 'group') but has no g_idx tensor")
        return None
    g_idx = g_idx.to(torch.int32).reshape(-1)
    if g_idx.numel() != in_features or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"g_idx must hold {in_features} group numbers in [0, {groups}); got {g_idx.numel()} in "
                         f"[{int(g_idx.min())}, {int(g_idx.max())}]")
    if config.act_order:
        return g_idx
    size = in_features if config.group_size == -1 else config.group_size
    if not torch.equal(g_idx, torch.arange(in_features, dtype=torch.int32) // size):
        raise ValueError("has a g_idx that is not input feature // group_size, but the config is not act-order "
                         "(desc_act false)")
    return None
