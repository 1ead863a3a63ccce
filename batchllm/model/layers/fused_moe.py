"""The Mixture-of-Experts layer: a router's top-k choice, then every chosen expert's gated MLP, in one module.

The experts are held stacked, `w13 [E, 2 * I_rank, H]` (each expert's gate rows, then its up rows) and
`w2 [E, H, I_rank]`, and multiplied by `batchllm.kernels.fused_moe` (the torch reference on the CPU; a Triton
kernel reading only the chosen experts on the GPU). Checkpoints store one tensor per expert and projection
(`experts.{e}.w1/w3/w2` in Mixtral, `experts.{e}.gate_proj/up_proj/down_proj` in the Qwen MoE families): the
loader maps each onto its stacked parameter with the shard id `(expert, part)` (`expert_target`), and the
parameter's `weight_loader` copies this rank's slice into expert e's place.

Tensor parallelism cuts every expert's intermediate dimension, as a column layer then a row layer would: rank r
holds rows `[r * I_rank, (r + 1) * I_rank)` of each expert's gate and up projections and the same columns of
its down projection, so its output is a partial sum and one all-reduce after the layer completes it.

How the experts are stored is their `ExpertMethod` (quantization/experts.py): unquantized, FP8 (an FP8
checkpoint's experts, or `quantization="fp8"` on load), MXFP4 (gpt-oss's checkpoints, or `quantization="mxfp4"`)
or 4- / 8-bit integers (GPTQ, AWQ, compressed-tensors checkpoints), each a `w13_*` / `w2_*` parameter per part
(`weight`, `weight_scale`, `weight_zero`). One expert's checkpoint tensor and its
companions are read by the method's linear reader, as a linear layer's would be (`load_expert_tensor`), then
sliced into place by `weight_loader`.

`local_experts` are the global ids of the experts this rank holds (all of them under tensor parallelism): the
stacked parameters have one entry per local expert, and the loaders skip the others. Under expert parallelism
(`enable_expert_parallel=True`) rank r of n holds experts `[r * E/n, (r + 1) * E/n)` whole, and `forward` sends
the tokens to their experts' ranks and back (expert_parallel.py) instead of all-reducing partial sums.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from batchllm import kernels
from batchllm.distributed.parallel_state import TensorParallel, all_reduce, get_ep, get_tp
from batchllm.model.checkpoint_tensor import CheckpointSlice, copy_checked
from batchllm.model.layers.expert_parallel import expert_parallel_moe
from batchllm.model.quantization.config import QuantConfig
from batchllm.model.quantization.experts import expert_method
from batchllm.model.quantization.method import Reader, loadable
from batchllm.model.quantization.unquantized import check_plain_tensor

GATE, UP, DOWN = "gate", "up", "down"  # an expert's projections: the parts of a shard id (expert, part)
# `<module>.experts.<e>.<projection>.<kind>`: one expert's tensor in an HF checkpoint.
_EXPERT_TENSOR = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>[^.]+)\.(?P<kind>[^.]+)$")


def expert_target(name: str, projections: Mapping[str, str]) -> tuple[str, str, tuple[int, str]] | None:
    """`model.layers.0.mlp.experts.3.up_proj.weight_scale` → (`model.layers.0.mlp.experts`, "weight_scale",
    (3, "up")), given the family's checkpoint projection names → part (`{"gate_proj": "gate", ...}`); None for a
    tensor of no expert."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["projection"] not in projections:
        return None
    return match["module"], match["kind"], (int(match["expert"]), projections[match["projection"]])


def expert_checkpoint_name(param_name: str, shard_id: tuple[int, str], projections: Mapping[str, str]) -> str:
    """The checkpoint tensor behind a stacked parameter's shard, so a missing-tensor error names it."""
    module, _, stacked = param_name.rpartition(".")
    expert, part = shard_id
    projection = next(hf for hf, ours in projections.items() if ours == part)
    return f"{module}.{expert}.{projection}.{stacked.partition('_')[2]}"


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_weights [T, k] float32, topk_ids [T, k])`: softmax over all experts in float32, then the k most
    probable, rescaled to sum to 1 when `renormalize` (HF's `norm_topk_prob`; Mixtral always)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """`forward(hidden [T, H], router_logits [T, E]) -> [T, H]`: each token through its top-k experts, summed
    with their routing weights and across tensor-parallel ranks."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, activation: str = "silu", bias: bool = False,
                 quant_config: QuantConfig | None = None, swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.expert_method = expert_method(quant_config)
        self.ep = get_ep()
        # The split of each expert's features: none under expert parallelism, where each expert is whole on its rank.
        self.tp = get_tp() if self.ep.size == 1 else TensorParallel()
        if intermediate_size % self.tp.size:
            raise ValueError(f"the experts' {intermediate_size} intermediate features cannot be split over "
                             f"tensor_parallel_size={self.tp.size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.activation, self.swiglu_limit = activation, swiglu_limit
        self.intermediate_size = intermediate_size // self.tp.size  # this rank's, per expert
        self.local_experts = self.ep.local_experts(num_experts)
        size, experts = self.intermediate_size, self.local_experts
        gate_up = {(e, part): (intermediate_size, hidden_size) for e in experts for part in (GATE, UP)}
        down = {(e, DOWN): (hidden_size, intermediate_size) for e in experts}
        self._add_parts("w13", 2 * size, hidden_size, gate_up)
        self._add_parts("w2", hidden_size, size, down)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = self._stacked((2 * size,), None, {shard: shape[:1] for shard, shape in gate_up.items()})
            self.w2_bias = self._stacked((hidden_size,), None, {shard: shape[:1] for shard, shape in down.items()})
            self.w13_bias.input_pack = self.w2_bias.input_pack = None

    def _add_parts(self, stacked: str, rows: int, cols: int, shapes: dict[tuple[int, str], tuple[int, int]]) -> None:
        """The parameters of one stacked weight (`w13` / `w2`), as the expert method describes its parts."""
        for name, spec in self.expert_method.parts(rows, cols).items():
            param = self._stacked(spec.shape, spec.dtype, shapes)
            param.input_pack = spec.input_pack
            if name != "weight":
                param.filled_with_weight = True  # a scale: loaded with its weight, never on its own
            else:
                param.weight_loader = self.load_full_weight
            setattr(self, f"{stacked}_{name}", param)

    def _stacked(self, shape: tuple[int, ...], dtype: torch.dtype | None, shapes: Mapping) -> nn.Parameter:
        # torch.empty: the checkpoint (or the dummy initialiser) fills every local expert.
        return loadable(torch.empty(len(self.local_experts), *shape, dtype=dtype), self.weight_loader, shapes)

    def load_expert_tensor(self, name: str, kind: str, tensor: CheckpointSlice, read: Reader,
                           shard_id: tuple[int, str]) -> list[str]:
        """One expert's checkpoint tensor `name` (`kind`: its last name) into place; the names of the parameters
        it filled (none for a companion, which is read with its weight, or for another rank's expert)."""
        method = self.expert_method.linear
        if kind in method.companion_tensors or shard_id[0] not in self.local_experts:
            return []
        stacked = "w2" if shard_id[1] == DOWN else "w13"
        # The tensor that stands for the whole weight: `weight`, or a packed one (GPTQ's `qweight`, ...).
        primary = kind in getattr(method, "weight_tensors", ("weight",))
        param = getattr(self, f"{stacked}_{'weight' if primary else kind}", None) if primary or kind == "bias" else None
        if param is None:
            raise ValueError(f"is a {kind!r} tensor, which MoE experts of this model "
                             f"({self.expert_method.config.method if self.expert_method.config else 'unquantized'}"
                             f") do not have")
        if kind == "bias":
            check_plain_tensor(tensor, param.checkpoint_shapes[shard_id])
            self.weight_loader(param, tensor, shard_id)
            return [f"{stacked}_bias"]
        parts = method.read_weight(name, tensor, read, param.checkpoint_shapes[shard_id])
        for part, value in parts.items():
            self.weight_loader(getattr(self, f"{stacked}_{part}"), value, shard_id)
        return [f"{stacked}_{part}" for part in parts]

    def load_full_weight(self, weight: nn.Parameter, full: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """A full-precision HF weight (random, for `load_format="dummy"`) quantized as the method stores it."""
        stacked = "w2" if shard_id[1] == DOWN else "w13"
        for part, value in self.expert_method.linear.quantize_weight(full).items():
            self.weight_loader(getattr(self, f"{stacked}_{part}"), value, shard_id)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | CheckpointSlice,
                      shard_id: tuple[int, str]) -> None:
        """Copy this rank's slice of expert e's full HF tensor (`[I, H]` gate / up, `[H, I]` down, a bias or a
        scale) into the stacked parameter: gate and up rows `[rank * I_rank, (rank + 1) * I_rank)` into the first
        and second half of `w13[e]`, the same input features of down into `w2[e]` (in stored columns, for a part
        that packs several features in one). Experts of other ranks are skipped."""
        expert, part = shard_id
        if expert not in self.local_experts:
            return
        size, rank = self.intermediate_size, self.tp.rank
        target = param.data[expert - self.local_experts.start]
        if part == DOWN:
            pack = param.input_pack
            if pack is not None:
                loaded_weight = loaded_weight.narrow(loaded_weight.dim() - 1, rank * size // pack, size // pack)
            elif param is self.w2_bias and rank != 0:
                # The down projection's bias joins every rank's partial sum: only rank 0's may carry it.
                loaded_weight = torch.zeros(target.shape, dtype=target.dtype, device=target.device)
            copy_checked(target, loaded_weight)
            return
        offset = 0 if part == GATE else size
        copy_checked(target.narrow(0, offset, size), loaded_weight.narrow(0, rank * size, size))

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(topk_weights [T, k] float32, topk_ids [T, k])` of the router's logits."""
        return select_experts(router_logits, self.top_k, self.renormalize)

    def run_experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the chosen experts' outputs."""
        return kernels.fused_moe(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                                 self.w13_bias, self.w2_bias, self.swiglu_limit,
                                 getattr(self, "w13_weight_scale", None), getattr(self, "w2_weight_scale", None),
                                 getattr(self, "w13_weight_zero", None), getattr(self, "w2_weight_zero", None))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.route(router_logits)
        if self.ep.size > 1:
            return expert_parallel_moe(hidden, topk_weights, topk_ids, self.ep, len(self.local_experts),
                                       self.run_experts)
        return all_reduce(self.run_experts(hidden, topk_weights, topk_ids))
