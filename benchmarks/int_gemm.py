"""W4A16 GEMM: `int_matmul`'s paths against bf16 cuBLAS (`F.linear`) on llama3-8b's projection shapes (GPU only).

    python benchmarks/int_gemm.py --out $OUT            # the table, and a JSON record in results/ (and $OUT)
    python benchmarks/int_gemm.py --sweep --out $OUT    # also a few block configurations per (shape, M)

Shapes `(K, N)`: qkv (4096, 6144), o (4096, 4096), gate_up (4096, 28672), down (14336, 4096), at M = 1, 16,
64, 128, 256, 4096; 4-bit, group 128, symmetric (zero point 8), bfloat16 activations (`--bits 8`, `--act-order` for
the other formats). Each call is timed inside a CUDA graph (launch overhead excluded, as in the engine's
decode steps) replayed several times, the median replay taken. The graph cycles over enough copies of the
weight that they do not fit in the 50 MB L2 together, since each layer of a model reads its own weight from
HBM (a 4-bit weight of a few MB alone would stay in L2 and be timed too fast). Paths per M: `split-k` (up to
M = 64), `tiled` (from M = 16), `dequantize` (all M), each in its default configuration; `auto` is the one
`int_matmul` takes.
"""

from __future__ import annotations

import argparse
import datetime
import math

import torch
import torch.nn.functional as F
from throughput import git_sha, hardware, save_record

from batchllm.kernels import int_gemm

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = (1, 16, 64, 128, 256, 4096)
GROUP_SIZE = 128
DEVICE = "cuda"
COLD_BYTES = 256 << 20  # weight copies per graph: at least this many bytes of weights, five times the L2


def time_us(fn, calls: list[tuple], target_ms: float = 8.0) -> float:
    """Median microseconds of one `fn(*call)`, in a CUDA graph cycling through `calls`."""
    for call in calls:  # compile, and allocate outside the graph
        fn(*call)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*calls[0])
    end.record()
    end.synchronize()
    rounds = max(1, min(50, math.ceil(target_ms / max(start.elapsed_time(end), 1e-3) / len(calls))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                fn(*call)
    graph.replay()
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (rounds * len(calls)))
    del graph
    return sorted(times)[len(times) // 2]


def make_weights(k: int, n: int, bits: int, act_order: bool, copies: int) -> list[tuple]:
    """`copies` random symmetric weights `(qweight, scales, zeros, g_idx)` on the GPU."""
    out = []
    for i in range(copies):
        gen = torch.Generator(device=DEVICE).manual_seed(i)
        qweight = torch.randint(-2**31, 2**31 - 1, (k * bits // 32, n), generator=gen, device=DEVICE,
                                dtype=torch.int32)
        scales = torch.rand(k // GROUP_SIZE, n, generator=gen, device=DEVICE) * 0.02 / 2**bits
        zeros = torch.full((k // GROUP_SIZE, n), 2 ** (bits - 1), dtype=torch.uint8, device=DEVICE)
        g_idx = None
        if act_order:
            perm = torch.randperm(k, generator=gen, device=DEVICE)
            g_idx = (torch.argsort(perm) // GROUP_SIZE).to(torch.int32)
        out.append((qweight, scales, zeros, g_idx))
    return out


def path_fn(path: str, bits: int, config: int_gemm.GemmConfig | None = None):
    """`fn(x, qweight, scales, zeros, g_idx)` taking `path` ("auto": `int_matmul_triton`'s own choice), with
    `config` or the path's default configuration."""
    def run(x, qweight, scales, zeros, g_idx):
        if path == "auto":
            return int_gemm.int_matmul_triton(x, qweight, scales, zeros, bits, GROUP_SIZE, g_idx)
        if path == "dequantize":
            return x @ int_gemm.dequantize_int_triton(qweight, scales, zeros, bits, GROUP_SIZE, g_idx, dtype=x.dtype)
        chosen = config or int_gemm.gemm_config(path, x.shape[0], qweight.shape[1], x.shape[1])
        return int_gemm.int_gemm_triton(x, qweight, scales, zeros, bits, GROUP_SIZE, g_idx, chosen)

    return run


def sweep_configs(m: int) -> list[int_gemm.GemmConfig]:
    """Candidates around the default rules, with K splits from 1 to 16."""
    if m <= 32:
        blocks = [(16 if m <= 16 else 32, bn, bk, w, s) for bn, bk, w, s in (
            (32, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 5), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3))]
        splits = (1, 2, 4, 8, 16)
    elif m <= 128:
        blocks = [(64, 64, 64, 4, 3), (64, 64, 128, 4, 4), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4),
                  (32, 64, 128, 4, 4), (128, 64, 64, 4, 3)]
        splits = (1, 2, 4, 8)
    else:
        blocks = [(128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 64, 64, 4, 3)]
        splits = (1, 2, 4) if m <= 256 else (1,)
    return [int_gemm.GemmConfig(bm, bn, bk, sk, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in blocks for sk in splits]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--act-order", action="store_true", help="with a g_idx (act-order groups)")
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="also time a few block configurations per (shape, M)")
    parser.add_argument("--out", default=None, help="a folder for a copy of the JSON record (the device's $OUT)")
    args = parser.parse_args()
    results, sweeps = [], []
    print(f"{'shape':<8} {'K':>6} {'N':>6} {'M':>5} {'path':<11} {'bf16 us':>8} {'int us':>8} {'speedup':>7} "
          f"{'int GB/s':>8}  config", flush=True)
    for name in args.shapes:
        k, n = SHAPES[name]
        int_bytes = k * n * args.bits // 8
        weights = make_weights(k, n, args.bits, args.act_order, max(1, math.ceil(COLD_BYTES / int_bytes)))
        dense = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
                 for _ in range(max(1, math.ceil(COLD_BYTES / (2 * k * n))))]
        for m in args.rows:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            bf16_us = time_us(F.linear, [(x, w) for w in dense])
            calls = [(x, *w) for w in weights]
            auto = int_gemm.choose_path(m)
            paths = ["auto"] + [p for p, ok in (("split-k", m <= 64), ("tiled", m >= 16), ("dequantize", True)) if ok]
            for path in paths:
                gemm_path = auto if path == "auto" else path
                config = None if gemm_path == "dequantize" else int_gemm.gemm_config(gemm_path, m, n, k)
                us = time_us(path_fn("auto" if path == "auto" else gemm_path, args.bits, config), calls)
                label = f"auto={auto}" if path == "auto" else path
                results.append({"shape": name, "k": k, "n": n, "m": m, "path": label, "bf16_us": bf16_us,
                                "int_us": us, "speedup": bf16_us / us, "int_weight_gb_s": int_bytes / us / 1e3,
                                "config": config.__dict__ if config else None})
                print(f"{name:<8} {k:>6} {n:>6} {m:>5} {label:<11} {bf16_us:>8.1f} {us:>8.1f} {bf16_us / us:>7.2f} "
                      f"{int_bytes / us / 1e3:>8.0f}  {config or ''}", flush=True)
            if args.sweep:
                timed = []
                for config in sweep_configs(m):
                    try:
                        timed.append((time_us(path_fn("config", args.bits, config), calls), config))
                    except Exception as error:  # a configuration that does not compile (shared memory, registers)
                        print(f"  {config}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                timed.sort(key=lambda t: t[0])
                sweeps.append({"shape": name, "m": m, "bf16_us": bf16_us,
                               "timed": [{"us": us, **config.__dict__} for us, config in timed]})
                for us, config in timed[:4]:
                    print(f"  sweep {name} M={m}: {us:7.1f} us  speedup {bf16_us / us:5.2f}  {config}", flush=True)
    device_name, device_info = hardware(DEVICE)
    record = {"benchmark": "int_gemm", "date": datetime.date.today().isoformat(), "git": git_sha(),
              "hardware": device_name, "hardware_info": device_info, "bits": args.bits, "group_size": GROUP_SIZE,
              "act_order": args.act_order, "symmetric": True, "dtype": "bfloat16", "timing": __doc__.split("\n\n")[2],
              "constants": {name: getattr(int_gemm, name) for name in (
                  "SPLIT_K_MAX_M", "DEQUANT_MIN_M", "SPLIT_K_BLOCKS", "TILED_BLOCKS", "SPLIT_K_ROWS", "MIN_PROGRAMS",
                  "MAX_SPLIT_K", "PARTIAL_ROWS")},
              "results": results, "sweep": sweeps}
    suffix = f"w{args.bits}{'-act' if args.act_order else ''}{'-sweep' if args.sweep else ''}"
    print(save_record(f"{record['date']}-int-gemm-{suffix}-{device_name}.json", record, args.out))


if __name__ == "__main__":
    main()
