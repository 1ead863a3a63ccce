"""The quantization vocabulary: linear methods, the checkpoint layouts we read, and `QuantConfig`."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8, INT = "fp8", "int"  # QuantConfig.method
# QuantConfig.method (and checkpoint_format of gpt-oss's checkpoints): MoE experts only, E2M1 with E8M0 block scales
MXFP4 = "mxfp4"
# checkpoint_format values
ON_LOAD, COMPRESSED_TENSORS, FP8_PER_TENSOR, FP8_BLOCK = None, "compressed-tensors", "fp8-per-tensor", "fp8-block"
GPTQ, AWQ = "gptq", "awq"


@dataclass(frozen=True, slots=True)
class QuantConfig:
    method: str  # FP8, INT or MXFP4
    checkpoint_format: str | None = ON_LOAD  # how quantized tensors are stored; None: the checkpoint is not
    block_shape: tuple[int, int] | None = None  # FP8_BLOCK: (rows, cols) of one weight_scale_inv entry
    # INT weights:
    bits: int = 4
    group_size: int = 128  # input features per scale; -1: one group over all of them (per output channel)
    act_order: bool = False  # groups given per input feature by a g_idx tensor, not contiguous
    zero_plus_one: bool = False  # GPTQ v1 checkpoints store zero point - 1

    @property
    def pack(self) -> int:
        """Integer codes per int32 word."""
        return 32 // self.bits
