"""Tensor-parallel linear layers whose parameters know how to load themselves from HF checkpoint tensors.

Megatron-style sharding over the group of `batchllm.distributed.parallel_state`: a column layer holds its
rank's slice of the output features (no communication), a row layer its slice of the input features and
sums the partial outputs with one all-reduce. A column layer followed by a row layer (q/k/v → o, gate/up →
down) thus costs one all-reduce. With one rank every layer is a plain linear.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the *full* HF
tensor (or a lazily read `CheckpointSlice` of it) and copies this rank's slice of it, and
`checkpoint_shapes` (shard id → full HF shape), which the random initialiser uses to build
rank-independent weights. Fused layers (QKV, gate/up) are filled from several HF tensors, one `shard_id`
each.

Under FP8 quantization (`batchllm.model.quantization`, read while the model is built) `weight` is E4M3 and a
`weight_scale [out]` float32 parameter holds its per-output-channel scales; the scales shard like a bias
(with the output features of a column layer, whole on every rank of a row layer). The loader hands the
weight loader FP8 tensors and their per-channel scales, whatever the checkpoint's own format.

Under integer (GPTQ / AWQ / compressed-tensors, 4- or 8-bit) quantization the layer holds `qweight`, `scales`,
`zeros` (and `g_idx` for act-order) in the layout of `quantization/int_packed.py`: K-packed, so a column layer
splits every part along its last (output) axis and a row layer splits qweight by word rows, the groups by
whole groups, and g_idx by input feature. `finish_loading` then sorts act-order rows once, or on the CPU
replaces the packed parts by the dequantized weight.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from batchllm import kernels
from batchllm.distributed.parallel_state import all_reduce, get_tp, kv_heads_per_rank
from batchllm.model.checkpoint_tensor import copy_checked
from batchllm.model.layers.lora import LoRASlots
from batchllm.model.quantization import FP8, INT, QuantConfig, current_quantization
from batchllm.model.quantization.fp8 import FP8_DTYPE, fp8_linear
from batchllm.model.quantization.int_packed import dense_weight, sort_act_order


class _Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, full_input_size: int | None = None) -> None:
        super().__init__()
        self.tp = get_tp()
        self.input_size, self.output_size = input_size, output_size  # this rank's sizes
        quant = current_quantization()
        fp8 = quant is not None and quant.method == FP8
        self.int_quant: QuantConfig | None = quant if quant is not None and quant.method == INT else None
        self.weight = self.weight_scale = None
        self.qweight = self.scales = self.zeros = self.g_idx = None
        self.perm: torch.Tensor | None = None  # act-order: x's input features in qweight's row order
        self.g_idx_loaded = False
        self.dtype = torch.get_default_dtype()  # the model's: the CPU dequantizes to it
        # torch.empty: the checkpoint (or the dummy initialiser) fills the values, so random init is wasted work.
        if self.int_quant is not None:
            self._make_int_parts(self.int_quant, full_input_size or input_size)
        else:
            weight = torch.empty(output_size, input_size, dtype=FP8_DTYPE if fp8 else None)
            self.weight = _loadable(weight, self.weight_loader)
        if fp8:
            self.weight_scale = _loadable(torch.empty(output_size, dtype=torch.float32), self.weight_loader)
        self.bias = _loadable(torch.empty(output_size), self.weight_loader) if bias else None
        self.lora: LoRASlots | None = None  # set when the engine runs adapters (`executor/lora_slots.py`)

    def _make_int_parts(self, quant: QuantConfig, full_input_size: int) -> None:
        k_local, n = self.input_size, self.output_size
        if k_local % quant.pack:
            raise ValueError(f"{k_local} input features per rank do not pack into words of {quant.pack} "
                             f"{quant.bits}-bit codes")
        if quant.group_size == -1:
            groups = 1  # one scale row over all input features: whole on every rank
        elif quant.act_order:
            groups = -(-full_input_size // quant.group_size)  # a rank's input features may be in any group
        else:
            if k_local % quant.group_size and self.tp.size > 1:
                raise ValueError(f"group_size={quant.group_size} does not divide the {k_local} input features each "
                                 f"of tensor_parallel_size={self.tp.size} ranks holds")
            groups = -(-k_local // quant.group_size)  # the last group may be partial (GPTQ, compressed-tensors)
        self.local_group_size = k_local if quant.group_size == -1 else quant.group_size
        self.qweight = _loadable(torch.empty(k_local // quant.pack, n, dtype=torch.int32), self._int_loader)
        self.scales = _loadable(torch.empty(groups, n, dtype=torch.float32), self._int_loader)
        self.zeros = _loadable(torch.empty(groups, n, dtype=torch.uint8), self._int_loader)
        if quant.act_order:
            self.g_idx = _loadable(torch.empty(k_local, dtype=torch.int32), self._int_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_delta(x, out)
        return out

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias)
        if self.qweight is not None:
            return self._int_matmul(x, bias)
        return F.linear(x, self.weight, bias)

    def _int_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        out = kernels.int_matmul(rows, self.qweight, self.scales, self.zeros, self.int_quant.bits,
                                 self.local_group_size, self.g_idx)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.output_size)

    def _output_part(self, shard_id: Hashable) -> tuple[int, int, int]:
        """(offset in this rank's output features, size, start in the full HF tensor) of HF shard `shard_id`."""
        return 0, self.output_size, 0

    def _input_part(self) -> tuple[int, int]:
        """(start in the full HF input features, size) of this rank's input features."""
        return 0, self.input_size

    def _int_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        """Copy this rank's part of a full `PackedInt` part (`qweight [K / pack, N]`, `scales` / `zeros [G, N]`,
        `g_idx [K]`) of HF shard `shard_id`."""
        k_start, k_size = self._input_part()
        rank_in_k = k_start // k_size
        if param is self.g_idx:
            loaded = loaded.narrow(0, k_start, k_size)
            if self.g_idx_loaded and not torch.equal(param.data.cpu(), loaded.cpu()):
                raise ValueError("has a g_idx unlike the other projections fused with it; batchllm fuses q/k/v and "
                                 "gate/up, which GPTQ's act-order gives one input-feature order (one input)")
            copy_checked(param.data, loaded)
            self.g_idx_loaded = True
            return
        offset, size, start = self._output_part(shard_id)
        loaded = loaded.narrow(1, start, size)
        if param is self.qweight:
            loaded = loaded.narrow(0, k_start // self.int_quant.pack, k_size // self.int_quant.pack)
        elif param.shape[0] != loaded.shape[0]:  # groups split with the input features
            loaded = loaded.narrow(0, rank_in_k * param.shape[0], param.shape[0])
        copy_checked(param.data.narrow(1, offset, size), loaded)

    def finish_loading(self) -> None:
        """After every part is loaded: sort act-order rows once (GPU), or dequantize for the CPU's F.linear."""
        if self.qweight is None:
            return
        quant = self.int_quant
        if self.qweight.device.type != "cuda":
            dense = self.dequantized_weight().to(self.dtype)
            self.weight = nn.Parameter(dense, requires_grad=False)
            self.qweight = self.scales = self.zeros = self.g_idx = None
            return
        if self.g_idx is not None:
            qweight, g_idx, self.perm = sort_act_order(self.qweight.data, self.g_idx.data, quant.bits,
                                                      self.local_group_size)
            self.qweight.data = qweight
            self.g_idx = None if g_idx is None else nn.Parameter(g_idx, requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 `[out, in]` of this rank, in the checkpoint's input-feature order (tests, debugging)."""
        if self.qweight is None:
            scale = 1.0 if self.weight_scale is None else self.weight_scale[:, None]
            return self.weight.float() * scale
        return dense_weight(self.qweight, self.scales, self.zeros, self.int_quant.bits, self.local_group_size,
                            self.g_idx, self.perm)

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA delta `x A^T B^T` on the weight's HF shard `shard_id`: B `[out, r]` is split
        like the weight's output features, A `[r, in]` like its input features."""
        return a, b


class RowLinear(_Linear):
    """`y = x W^T + b`, sharded along the input features; the partial products are summed across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__(_divide(input_size, get_tp().size, "input features"), output_size, bias, input_size)
        _set_checkpoint_shapes(self, {None: output_size}, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self._matmul(x, None)
        if self.lora is not None:
            self.lora.add_delta(x, partial)  # a partial sum too: it joins the all-reduce
        out = all_reduce(partial)
        return out if self.bias is None else out + self.bias  # the bias is added once, after the sum

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a.narrow(1, self.tp.rank * self.input_size, self.input_size), b

    def _input_part(self) -> tuple[int, int]:
        return self.tp.rank * self.input_size, self.input_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        if param.dim() == 2:
            loaded_weight = loaded_weight.narrow(1, self.tp.rank * self.input_size, self.input_size)
        copy_checked(param.data, loaded_weight)


class MergedColumnLinear(_Linear):
    """Several column layers on the same input, fused into one matmul; HF shard i fills output slice i."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool) -> None:
        tp_size = get_tp().size
        self.output_sizes = [_divide(size, tp_size, "output features") for size in output_sizes]
        super().__init__(input_size, sum(self.output_sizes), bias)
        self.output_offsets = [sum(self.output_sizes[:i]) for i in range(len(output_sizes))]
        _set_checkpoint_shapes(self, dict(enumerate(output_sizes)), input_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        offset, size = self.output_offsets[shard_id], self.output_sizes[shard_id]
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, self.tp.rank * size, size))

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.output_sizes[shard_id]
        return a, b.narrow(0, self.tp.rank * size, size)

    def _output_part(self, shard_id: Hashable) -> tuple[int, int, int]:
        size = self.output_sizes[shard_id]
        return self.output_offsets[shard_id], size, self.tp.rank * size


class QKVLinear(_Linear):
    """The q, k and v projections fused into one matmul; this rank's output is `[q | k | v]` of its heads.

    Query heads are split evenly. KV heads are split too; with more ranks than KV heads, each KV head is
    replicated on `tp_size / num_kv_heads` consecutive ranks, which are exactly the ranks whose query heads
    read it.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp()
        self.num_heads = _divide(num_heads, tp.size, "attention heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # Which KV head slice this rank holds: rank r's query heads read KV head (r * heads_per_rank) // group.
        self.kv_shard = tp.rank * self.num_heads // (num_heads // num_kv_heads) // self.num_kv_heads
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        full_kv = num_kv_heads * head_dim
        _set_checkpoint_shapes(self, {"q": num_heads * head_dim, "k": full_kv, "v": full_kv}, hidden_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        offset, size, start = self._output_part(shard_id)
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, start, size))

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, size, start = self._output_part(shard_id)
        return a, b.narrow(0, start, size)

    def _output_part(self, shard_id: Hashable) -> tuple[int, int, int]:
        """(offset in this rank's output, size, start in the full HF tensor) of shard "q", "k" or "v"."""
        if shard_id == "q":
            return 0, self.q_size, self.tp.rank * self.q_size
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return offset, self.kv_size, self.kv_shard * self.kv_size


def _divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{size} {what} cannot be split over tensor_parallel_size={parts}")
    return size // parts


def _loadable(data: torch.Tensor, weight_loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = weight_loader
    return param


def _set_checkpoint_shapes(layer: _Linear, output_sizes: dict[Hashable, int], input_size: int) -> None:
    """Record the full HF tensor shapes behind a layer's parameters, one per shard id (for integer weights, the
    full `PackedInt` shapes the loader converts each HF weight to)."""
    if layer.weight is not None:
        layer.weight.checkpoint_shapes = {shard: (size, input_size) for shard, size in output_sizes.items()}
    for vector in (layer.bias, layer.weight_scale):
        if vector is not None:
            vector.checkpoint_shapes = {shard: (size,) for shard, size in output_sizes.items()}
    quant = layer.int_quant
    if quant is not None:
        groups = 1 if quant.group_size == -1 else -(-input_size // quant.group_size)
        full = {"qweight": lambda n: (input_size // quant.pack, n), "scales": lambda n: (groups, n),
                "zeros": lambda n: (groups, n), "g_idx": lambda n: (input_size,)}
        for part, shape in full.items():
            param = getattr(layer, part)
            if param is not None:
                param.checkpoint_shapes = {shard: shape(size) for shard, size in output_sizes.items()}
