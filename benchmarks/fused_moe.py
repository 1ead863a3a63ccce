"""The fused MoE layer alone on the GPU: the Triton kernel's time at decode and prefill token counts, as a share of
the card's copy bandwidth (the chosen experts' weights read once, in their format's bytes) and of its bf16
tensor-core peak (active FLOPs), timed replaying a CUDA graph as the engine's decode steps do (and eagerly).

    python benchmarks/fused_moe.py --out $OUT          # Qwen3-30B-A3B (bf16, FP8) and gpt-oss-20b (bf16, MXFP4)
    python benchmarks/fused_moe.py --sweep --tokens 256 8192 --cases gpt-oss-20b:mxfp4   # tile configurations

Routing is uniform at random (each token's k experts distinct), weights normal(0, 0.02); the output is checked
against the torch reference before timing (`triton.testing.do_bench`, median).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch
import triton

from batchllm.kernels import moe
from batchllm.kernels.moe_reference import fused_moe

CHOOSE_TILES = moe.choose_tiles  # `sweep` swaps the module's own for each configuration, then restores it
EXPANDS_EXPERTS = moe.expands_experts  # formats "mxfp4-expanded" / "mxfp4-registers" swap it (below)
FORCED = {"mxfp4-expanded": True, "mxfp4-registers": False}  # MXFP4 expanded to bf16 / decoded in registers always

# name: (experts, top-k, hidden, expert intermediate, activation)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, "silu"), "gpt-oss-20b": (32, 4, 2880, 2880, "swigluoai")}
BF16_PEAK = {"H100": 989e12, "H200": 989e12}


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def expert_weights(experts: int, rows: int, cols: int, fmt: str, gen: torch.Generator) -> tuple:
    """Random `[E, rows, cols]` experts in `fmt` (bf16, fp8 with per-row scales, mxfp4 with block scales), and
    their bytes per expert."""
    if fmt == "bf16":
        w = torch.randn(experts, rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        return w, None, rows * cols * 2
    if fmt == "fp8":
        w = (torch.randn(experts, rows, cols, device="cuda", generator=gen) * 64).to(torch.float8_e4m3fn)
        return w, torch.full((experts, rows), 0.02 / 64, device="cuda"), rows * cols + rows * 4
    # "mxfp4" (the kernel's own choice of path), "mxfp4-expanded", "mxfp4-registers"
    packed = torch.randint(0, 256, (experts, rows, cols // 2), device="cuda", dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 121, (experts, rows, cols // 32), device="cuda", dtype=torch.uint8, generator=gen)
    return packed, scales, rows * cols // 2 + rows * cols // 32


def run(shape: str, tokens: int, fmt: str, bandwidth: float, peak: float, check: bool = True) -> dict:
    # Forced for MXFP4 only: the expanded experts go through the call again as bf16, which must not expand.
    moe.expands_experts = ((lambda w_format, *_, forced=FORCED[fmt]: forced and w_format == moe.MXFP4)
                           if fmt in FORCED else EXPANDS_EXPERTS)
    experts, k, hidden, inter, activation = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13, s13, bytes13 = expert_weights(experts, 2 * inter, hidden, fmt, gen)
    w2, s2, bytes2 = expert_weights(experts, hidden, inter, fmt, gen)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    weights = torch.rand(tokens, k, device="cuda", generator=gen).softmax(dim=1)
    limit = 7.0 if activation == "swigluoai" else None

    def call():
        return moe.fused_moe_triton(x, w13, w2, weights, ids, activation, swiglu_limit=limit, w13_scale=s13,
                                    w2_scale=s2)

    out, error = call(), None
    if check:
        expected = fused_moe(x, w13, w2, weights, ids, activation, swiglu_limit=limit, w13_scale=s13, w2_scale=s2)
        error = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    ms = triton.testing.do_bench(call, return_mode="median")
    graph_ms = _graph_ms(call)
    chosen = int(torch.unique(ids).numel())
    flops = 2 * tokens * k * 3 * hidden * inter
    return dict(shape=shape, tokens=tokens, format=fmt, ms=ms, graph_ms=graph_ms, chosen_experts=chosen,
                rel_err=error, bandwidth_share=chosen * (bytes13 + bytes2) / (graph_ms * 1e-3) / bandwidth,
                peak_share=flops / (graph_ms * 1e-3) / peak)


def _graph_ms(call) -> float:
    """The call's time replayed from a CUDA graph, as the engine's decode steps run it (no launch overhead)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return triton.testing.do_bench(graph.replay, return_mode="median")


def sweep(shape: str, tokens: int, fmt: str, bandwidth: float, peak: float) -> list[dict]:
    """Every tile configuration of a small grid for this case, fastest first (replayed from a CUDA graph)."""
    experts, k = SHAPES[shape][:2]
    rows = tokens * k / experts
    block_ms = [16] if rows <= 16 else [16, 32] if rows <= 64 else [64, 128]
    results = []
    for block_m, block_n, block_k, warps, stages in itertools.product(block_ms, (64, 128), (64, 128), (4, 8), (3, 4)):
        tiles = moe.Tiles(block_m, block_n, block_k, warps, stages)
        moe.choose_tiles = lambda *_, tiles=tiles: tiles
        try:
            r = run(shape, tokens, fmt, bandwidth, peak, check=False)  # the default tiles' run checks
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile (shared memory) is skipped
            print(f"  {tiles}: {type(exc).__name__}")
            continue
        results.append({**r, "tiles": dataclasses.asdict(tiles)})
    moe.choose_tiles = CHOOSE_TILES
    return sorted(results, key=lambda r: r["graph_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    parser.add_argument("--cases", nargs="+", default=["qwen3-30b-a3b:bf16", "qwen3-30b-a3b:fp8", "gpt-oss-20b:bf16",
                                                       "gpt-oss-20b:mxfp4-registers", "gpt-oss-20b:mxfp4-expanded"],
                        help="shape:format (mxfp4: the kernel's choice; mxfp4-registers: decoded in registers, "
                             "tl.dot_scaled; mxfp4-expanded: expanded to bf16 for the dense kernel)")
    parser.add_argument("--sweep", action="store_true", help="time a grid of tile configurations per case")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    peak = next((v for name, v in BF16_PEAK.items() if name in device), 989e12)
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 peak {peak / 1e12:.0f} TFLOP/s")
    results = []
    for case in args.cases:
        shape, fmt = case.split(":")
        for tokens in args.tokens:
            if args.sweep:
                ranked = sweep(shape, tokens, fmt, bandwidth, peak)
                results.append(dict(shape=shape, format=fmt, tokens=tokens, sweep=ranked))
                for r in ranked[:3]:
                    print(f"{case:20s} T={tokens:5d}: {r['graph_ms'] * 1e3:8.1f} us {r['tiles']}")
                continue
            r = run(shape, tokens, fmt, bandwidth, peak)
            results.append(r)
            print(f"{case:20s} T={tokens:5d}: {r['graph_ms'] * 1e3:8.1f} us graph ({r['ms'] * 1e3:7.1f} eager), "
                  f"{r['chosen_experts']:3d} experts read, {r['bandwidth_share']:.0%} of bandwidth, "
                  f"{r['peak_share']:.0%} of peak, rel err {r['rel_err']:.1e}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"{time.strftime('%Y-%m-%d')}-fused-moe{'-sweep' if args.sweep else ''}-{device.split()[1].lower()}.json"
        (args.out / name).write_text(json.dumps(dict(device=device, copy_bandwidth=bandwidth, results=results),
                                                indent=1))


if __name__ == "__main__":
    main()
