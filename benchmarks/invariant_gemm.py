"""The batch-invariant GEMM of `deterministic=True` against cuBLAS, and the launch shapes it could take (GPU).

    python benchmarks/invariant_gemm.py                      # the default config, llama3-8b's shapes, M = 1 ... 8192
    python benchmarks/invariant_gemm.py --sweep --out $OUT   # also every candidate config
    python benchmarks/invariant_gemm.py --small-m --out $OUT # decode-sized tiles that round as the default does

For each weight shape of the model (qkv, o, gate_up, down, the LM head) and each M, `kernels/invariant_gemm.py`'s
`invariant_linear` is timed with `triton.testing.do_bench` (median) against `F.linear` (cuBLAS) on the same
bfloat16 operands. A candidate config is only timed after its invariance is checked: the first rows of the
M-row product must equal, bit for bit, the same rows multiplied alone (M = 1) and inside M = 7.
`--small-m` times, at decode sizes, configs that keep the default's K tiles but change the row and column tiles,
warps and stages: a row's sum runs over the same K tiles in the same order, so such a config may serve small M
beside the default at large M only if its products equal the default's bit for bit, which is checked here on
every row of the M-row product (the tensor cores' instruction shape may change with the tile). The W1 cost of the
mode follows from where the time goes: prefill steps are GEMMs at M in the thousands, decode steps at M = rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from shapes import SHAPES

from batchllm.kernels.invariant_gemm import SMALL_M, GemmConfig, gemm_config, invariant_linear, small_m_config

ROWS = (1, 64, 256, 2048, 8192)
GROUPS = (1, 4, 8, 16)  # row tiles per group of the launch order, timed beside the default's


def weight_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """`name: (N, K)` of one decoder layer's linear layers and the LM head."""
    config = SHAPES[shape]
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    inter = config["intermediate_size"]
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (config["vocab_size"], hidden)}


def candidates():
    for block_m, block_n, block_k, warps, stages in itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4)):
        yield GemmConfig(block_n, block_k, warps, stages, block_m)


def small_m_candidates(default: GemmConfig, tma: bool = False):
    """Decode-sized tiles with the default's K tiles; with `tma`, loaded by TMA, deeper pipelines and the wide
    weights' 128-row tiles too."""
    if not tma:
        for block_m, block_n, warps, stages in itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (3, 4)):
            yield GemmConfig(block_n, default.block_k, warps, stages, block_m)
        return
    for block_m, block_n, stages in itertools.product((32, 64, 128), (64, 128, 256), (3, 4, 5)):
        warps = 8 if block_m * block_n > 64 * 128 else 4
        yield GemmConfig(block_n, default.block_k, warps, stages, block_m, tma=True)


def small_m(args) -> list[dict]:
    """For each weight and decode-sized M: the fastest config whose product equals the default's bit for bit."""
    results = []
    for name, (n, k) in weight_shapes(args.shape).items():
        if args.layers and name not in args.layers:
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        default = gemm_config(n, k, torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = invariant_linear(x, w, config=default)
            cublas_ms = triton.testing.do_bench(lambda: F.linear(x, w), warmup=10, rep=50)
            default_ms = triton.testing.do_bench(lambda: invariant_linear(x, w, config=default), warmup=10, rep=50)
            timed = []
            for config in small_m_candidates(default, args.tma):
                try:
                    equal = torch.equal(invariant_linear(x, w, config=config), want)
                    ms = triton.testing.do_bench(lambda: invariant_linear(x, w, config=config), warmup=5, rep=25)
                except Exception as exc:  # a shape that does not compile (shared memory, registers)
                    results.append(dict(layer=name, m=m, config=str(config), error=type(exc).__name__))
                    continue
                timed.append(dict(layer=name, n=n, k=k, m=m, config=str(config), ms=ms, equal=equal,
                                  default_ms=default_ms, cublas_ms=cublas_ms, vs_cublas=cublas_ms / ms))
            results += timed
            unequal = sum(not r["equal"] for r in timed)
            best = min((r for r in timed if r["equal"]), key=lambda r: r["ms"], default=None)
            print(f"{name:8} M={m:4}: cuBLAS {cublas_ms * 1e3:7.1f} us; default {default_ms * 1e3:7.1f} us; best equal "
                  f"{best and best['config']} {best and best['ms'] * 1e3:.1f} us ({best and best['vs_cublas']:.2f}x "
                  f"of cuBLAS); {unequal} of {len(timed)} configs round differently", flush=True)
    return results


def invariant(x: torch.Tensor, w: torch.Tensor, config: GemmConfig) -> bool:
    """Rows 0..6 of the M-row product equal those rows alone and inside M = 7."""
    full = invariant_linear(x, w, config=config)[:7]
    seven = invariant_linear(x[:7].clone(), w, config=config)
    alone = torch.cat([invariant_linear(x[i:i + 1].clone(), w, config=config) for i in range(7)])
    return torch.equal(full, seven) and torch.equal(full, alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--sweep", action="store_true", help="also time every candidate config")
    parser.add_argument("--small-m", action="store_true", help="decode-sized tiles equal to the default's bits")
    parser.add_argument("--tma", action="store_true", help="--small-m: the candidates loaded by TMA")
    parser.add_argument("--layers", nargs="+", help="--small-m: only these weights (qkv, o, gate_up, down, lm_head)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    if args.small_m:
        rows = args.rows if args.rows != list(ROWS) else [8, 64, 256]
        results = small_m(argparse.Namespace(shape=args.shape, rows=rows, tma=args.tma, layers=args.layers))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            kind = "small-m-tma" if args.tma else "small-m"
            name = f"{time.strftime('%Y-%m-%d')}-invariant-gemm-{kind}-{args.shape}-{device.split()[1].lower()}.json"
            (args.out / name).write_text(json.dumps(dict(device=device, shape=args.shape, results=results), indent=1))
        return
    results = []
    for name, (n, k) in weight_shapes(args.shape).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas_ms = triton.testing.do_bench(lambda: F.linear(x, w), warmup=10, rep=50)
            default = gemm_config(n, k, torch.bfloat16)
            want = invariant_linear(x, w, config=default)
            # The launch order's grouping beside the default's (1: row-major, no grouping): the same bits.
            orders = [dataclasses.replace(default, group_m=g) for g in GROUPS if g != default.group_m]
            # The same tiles loaded by TMA, and at decode sizes the decode-sized tiles both ways: all must equal
            # the default's bits (the sum is the same; only the loads change).
            loaders = {"tma": dataclasses.replace(default, tma=True)}
            if m <= SMALL_M:
                small = small_m_config(n, k, torch.bfloat16)
                loaders.update({"small ptr": small, "small tma": dataclasses.replace(small, tma=True)})
            labels = {config: label for label, config in loaders.items()}
            configs = [default, *loaders.values(), *orders]
            if args.sweep:
                configs += [c for c in candidates() if c != default]
            timed = []
            for config in configs:
                try:
                    ok = m < 7 or invariant(x, w, config)  # M < 7: nothing to compare inside
                    equal = torch.equal(invariant_linear(x, w, config=config), want)
                    ms = triton.testing.do_bench(lambda: invariant_linear(x, w, config=config), warmup=10, rep=50)
                except Exception as exc:  # a shape that does not compile (shared memory, registers)
                    results.append(dict(layer=name, m=m, config=str(config), error=type(exc).__name__))
                    continue
                row = dict(layer=name, n=n, k=k, m=m, config=str(config), default=config == default, ms=ms,
                           group_m=config.group_m, order_only=config in orders, loader=labels.get(config),
                           tma=config.tma, equal_to_default=equal,
                           cublas_ms=cublas_ms, vs_cublas=cublas_ms / ms, invariant=ok,
                           tflops=2 * m * n * k / (ms * 1e-3) / 1e12)
                results.append(row)
                timed.append(row)
            best = max((r for r in timed if r["invariant"]), key=lambda r: r["vs_cublas"])
            by_group = " ".join(f"g{r['group_m']} {r['ms'] * 1e3:.1f}" for r in timed if r["order_only"])
            by_loader = " ".join(f"{r['loader']} {r['ms'] * 1e3:.1f}{'' if r['equal_to_default'] else ' (bits differ)'}"
                                 for r in timed if r["loader"])
            print(f"{name:8} M={m:5}: cuBLAS {cublas_ms * 1e3:8.1f} us; default {timed[0]['ms'] * 1e3:8.1f} us "
                  f"({timed[0]['vs_cublas']:.2f}x of cuBLAS; loaders, us: {by_loader}; other launch orders, us: "
                  f"{by_group}); best "
                  f"{best['config']} {best['ms'] * 1e3:.1f} us ({best['vs_cublas']:.2f}x)", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"{time.strftime('%Y-%m-%d')}-invariant-gemm-{args.shape}-{device.split()[1].lower()}.json"
        (args.out / name).write_text(json.dumps(dict(device=device, shape=args.shape, results=results), indent=1))


if __name__ == "__main__":
    main()
