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

Experts are unquantized (the model's dtype) whatever the rest of the model runs in: `quantization="fp8"` on a
MoE model quantizes the attention and dense MLP linears on load and leaves the experts as they are, and the
experts of a quantized checkpoint are refused (`check_expert_quantization`).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping

import torch
from torch import nn

from batchllm import kernels
from batchllm.distributed.parallel_state import all_reduce, get_tp
from batchllm.model.checkpoint_tensor import CheckpointSlice, copy_checked
from batchllm.model.quantization.config import ON_LOAD, QuantConfig
from batchllm.model.quantization.method import loadable

GATE, UP, DOWN = "gate", "up", "down"  # an expert's projections: the parts of a shard id (expert, part)
# `<module>.experts.<e>.<projection>.<weight|bias>`: one expert's tensor in an HF checkpoint.
_EXPERT_TENSOR = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>[^.]+)\.(?P<kind>[^.]+)$")


def expert_target(name: str, projections: Mapping[str, str]) -> tuple[str, Hashable] | None:
    """`model.layers.0.mlp.experts.3.up_proj.weight` → (`model.layers.0.mlp.experts.w13_weight`, (3, "up")),
    given the family's checkpoint projection names → part (`{"gate_proj": "gate", "up_proj": "up", ...}`); None
    for a tensor of no expert. A quantized expert's tensor (`qweight`, `weight_scale`, ...) is refused by name."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["projection"] not in projections:
        return None
    if match["kind"] not in ("weight", "bias"):
        raise ValueError(f"{name}: quantized MoE experts ({match['kind']!r} tensors) are not supported; only "
                         f"unquantized (bf16 / fp16 / fp32) experts load")
    part = projections[match["projection"]]
    stacked = "w2" if part == DOWN else "w13"
    return f"{match['module']}.{stacked}_{match['kind']}", (int(match["expert"]), part)


def expert_checkpoint_name(param_name: str, shard_id: tuple[int, str], projections: Mapping[str, str]) -> str:
    """Inverse of `expert_target`, so a missing-tensor error names the checkpoint tensor."""
    module, _, stacked = param_name.rpartition(".")
    expert, part = shard_id
    projection = next(hf for hf, ours in projections.items() if ours == part)
    return f"{module}.{expert}.{projection}.{stacked.partition('_')[2]}"


def check_expert_quantization(quant_config: QuantConfig | None) -> None:
    """Experts stay unquantized: fine when the model is quantized on load, refused for a quantized checkpoint,
    whose experts are stored in a format this layer does not read."""
    if quant_config is not None and quant_config.checkpoint_format is not ON_LOAD:
        raise ValueError(f"MoE experts of a quantized checkpoint ({quant_config.checkpoint_format}, "
                         f"{quant_config.method}) are not supported yet; use the unquantized (bf16) checkpoint, "
                         f"optionally with quantization='fp8' (which leaves the experts unquantized)")


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
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        check_expert_quantization(quant_config)
        self.tp = get_tp()
        if intermediate_size % self.tp.size:
            raise ValueError(f"the experts' {intermediate_size} intermediate features cannot be split over "
                             f"tensor_parallel_size={self.tp.size}")
        self.num_experts, self.top_k, self.renormalize, self.activation = num_experts, top_k, renormalize, activation
        self.intermediate_size = intermediate_size // self.tp.size  # this rank's, per expert
        size, experts = self.intermediate_size, range(num_experts)
        gate_up = [(e, part) for e in experts for part in (GATE, UP)]
        # torch.empty: the checkpoint (or the dummy initialiser) fills every expert.
        self.w13_weight = loadable(torch.empty(num_experts, 2 * size, hidden_size), self.weight_loader,
                                   {shard: (intermediate_size, hidden_size) for shard in gate_up})
        self.w2_weight = loadable(torch.empty(num_experts, hidden_size, size), self.weight_loader,
                                  {(e, DOWN): (hidden_size, intermediate_size) for e in experts})
        self.w13_bias = loadable(torch.empty(num_experts, 2 * size), self.weight_loader,
                                 {shard: (intermediate_size,) for shard in gate_up}) if bias else None
        self.w2_bias = loadable(torch.empty(num_experts, hidden_size), self.weight_loader,
                                {(e, DOWN): (hidden_size,) for e in experts}) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | CheckpointSlice,
                      shard_id: tuple[int, str]) -> None:
        """Copy this rank's slice of expert e's full HF tensor (`[I, H]` gate / up, `[H, I]` down, or a bias) into
        the stacked parameter: gate and up rows `[rank * I_rank, (rank + 1) * I_rank)` into the first and second
        half of `w13[e]`, the same columns of down into `w2[e]`."""
        expert, part = shard_id
        size, rank = self.intermediate_size, self.tp.rank
        target = param.data[expert]
        if part == DOWN:
            if loaded_weight.dim() == 2:
                loaded_weight = loaded_weight.narrow(1, rank * size, size)
            elif rank != 0:
                # The down projection's bias joins every rank's partial sum: only rank 0's may carry it.
                loaded_weight = torch.zeros(target.shape, dtype=target.dtype, device=target.device)
            copy_checked(target, loaded_weight)
            return
        offset = 0 if part == GATE else size
        copy_checked(target.narrow(0, offset, size), loaded_weight.narrow(0, rank * size, size))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = kernels.fused_moe(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                                self.w13_bias, self.w2_bias)
        return all_reduce(out)
