"""The fused MoE layer alone on the GPU: the Triton kernel's time at decode and prefill token counts, as a share of
the card's copy bandwidth (the chosen experts' weights read once) and of its bf16 tensor-core peak (active FLOPs).

    python benchmarks/fused_moe.py --out $OUT          # Qwen3-30B-A3B and gpt-oss-20b expert shapes, bf16

Routing is uniform at random (each token's k experts distinct), weights normal(0, 0.02); the output is checked
against the torch reference before timing (`triton.testing.do_bench`, median).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton

from batchllm.kernels.moe import fused_moe_triton
from batchllm.kernels.moe_reference import fused_moe

# name: (experts, top-k, hidden, expert intermediate, activation)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, "silu"), "gpt-oss-20b": (32, 4, 2880, 2880, "swigluoai")}
BF16_PEAK = {"H100": 989e12, "H200": 989e12}


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def run(shape: str, tokens: int, bandwidth: float, peak: float) -> dict:
    experts, k, hidden, inter, activation = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    weights = torch.rand(tokens, k, device="cuda", generator=gen).softmax(dim=1)
    limit = 7.0 if activation == "swigluoai" else None
    out = fused_moe_triton(x, w13, w2, weights, ids, activation, swiglu_limit=limit)
    expected = fused_moe(x, w13, w2, weights, ids, activation, swiglu_limit=limit)
    error = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    ms = triton.testing.do_bench(lambda: fused_moe_triton(x, w13, w2, weights, ids, activation, swiglu_limit=limit),
                                 return_mode="median")
    chosen = int(torch.unique(ids).numel())
    weight_bytes = chosen * 3 * hidden * inter * 2
    flops = 2 * tokens * k * 3 * hidden * inter
    return dict(shape=shape, tokens=tokens, ms=ms, chosen_experts=chosen, rel_err=error,
                bandwidth_share=weight_bytes / (ms * 1e-3) / bandwidth, peak_share=flops / (ms * 1e-3) / peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    peak = next((v for name, v in BF16_PEAK.items() if name in device), 989e12)
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 peak {peak / 1e12:.0f} TFLOP/s")
    results = []
    for shape in SHAPES:
        for tokens in args.tokens:
            r = run(shape, tokens, bandwidth, peak)
            results.append(r)
            print(f"{shape:14s} T={tokens:5d}: {r['ms'] * 1e3:8.1f} us, {r['chosen_experts']:3d} experts read, "
                  f"{r['bandwidth_share']:.0%} of bandwidth, {r['peak_share']:.0%} of peak, rel err {r['rel_err']:.1e}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"{time.strftime('%Y-%m-%d')}-fused-moe-{device.split()[1].lower()}.json"
        (args.out / name).write_text(json.dumps(dict(device=device, copy_bandwidth=bandwidth, results=results),
                                                indent=1))


if __name__ == "__main__":
    main()
