"""Where a GPU run's time goes: kernel time by kind (GEMM, attention, other) against wall time.

    python benchmarks/gpu_profile.py --shape llama3-8b --workload W1 --rows 200 --max-tokens 128

Runs the workload once to warm up, then again under torch.profiler, and prints the share of wall time the
GPU spent in each kind of kernel; the rest is host overhead or idle gaps between steps.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, make_prompts

from batchllm import LLM, SamplingParams

KINDS = (("attention", ("attn", "attention")), ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "matmul")),
         ("kv write", ("write_kv", "kv_write")), ("norm/rotary/act", ("rms", "rotary", "silu")),
         ("sampling", ("argmax", "softmax", "topk", "sort")))


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--sync", action="store_true", help="async_scheduling=False (the default is on for CUDA)")
    args = parser.parse_args()
    prompts = make_prompts(WORKLOADS[args.workload], args.rows, SHAPES[args.shape]["vocab_size"])
    llm = LLM(model=str(make_shape_dir(args.shape)), load_format="dummy", skip_tokenizer_init=True,
              max_num_seqs=args.max_num_seqs, async_scheduling=False if args.sync else None)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:32], params, use_tqdm=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if device_us and event.key and not event.key.startswith("ProfilerStep"):
            totals[kind_of(event.key)] += device_us / 1e6
            top[event.key] += device_us / 1e6
    busy = sum(totals.values())
    mode = "async" if llm.engine.async_scheduling else "sync"
    print(f"{args.workload} {args.shape} {args.rows} rows x {args.max_tokens} ({mode}): wall {wall:.2f} s, "
          f"GPU kernels {busy:.2f} s ({busy / wall:.0%}, idle {1 - busy / wall:.0%}), steps {llm.stats.num_steps}")
    for kind, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:16} {seconds:7.2f} s  {seconds / wall:6.1%} of wall")
    for name, seconds in sorted(top.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {seconds:7.3f} s  {name[:100]}")


if __name__ == "__main__":
    main()
