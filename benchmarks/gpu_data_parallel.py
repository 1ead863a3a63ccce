"""Data parallelism on one machine: W1 total tok/s of one engine on one GPU vs `data_parallel_size=N` on N GPUs,
same prompts, same run, random bf16 weights of a model shape.

    python benchmarks/gpu_data_parallel.py --shape llama3-8b                       # W1: 1000 rows x 256 tokens
    python benchmarks/gpu_data_parallel.py --shape llama3-8b --rows 200 --max-tokens 128
    python benchmarks/gpu_data_parallel.py --shape smollm2-135m --rows 8 --max-tokens 4 --device cpu   # smoke run

Systems, one after the other (the replica pool first, so this process has not touched CUDA when its
replicas start):
- `batchllm_dp{N}`: `ReplicaPool(N, shape_dir, engine_kwargs)`: N replica processes, each building its own
  engine on its own GPU (in parallel), fed token-id prompts from one work queue (`pool.generate`).
- `batchllm_1gpu`: `LLM(shape_dir, **engine_kwargs).generate(...)` in this process, on GPU 0.

Each reports build seconds (the pool: every replica ready, builds in parallel; one engine: `LLM(...)`),
warm-up seconds (a few short prompts) and generate seconds. `total_tok_s` = (prompt + output tokens) /
generate seconds; `total_tok_s_with_build` = the same tokens / (build + warm-up + generate). Outputs are
forced to full length (ignore_eos), greedy; `identical_rows` counts rows whose tokens equal the single
engine's (bf16 numerics depend on batch composition, so a few may differ on the GPU).
"""

from __future__ import annotations

import os

# Multicast / NVLS paths are not usable on the lent machines (see the device notes); set before torch loads.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402

from shapes import SHAPES, make_shape_dir  # noqa: E402
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record  # noqa: E402

from batchllm import LLM, SamplingParams  # noqa: E402
from batchllm.connectors.replicas.pool import ReplicaPool  # noqa: E402

WARMUP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def warmup_prompts(count: int) -> list[list[int]]:
    return [list(range(100 + i, 164 + i)) for i in range(count)]


def engine_kwargs(args) -> dict:
    return {"device": args.device, "load_format": "dummy", "skip_tokenizer_init": True,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "enforce_eager": args.enforce_eager}


def run_pool(directory, prompts, params, args) -> tuple[dict, list[list[int]]]:
    times = {}
    start = time.perf_counter()
    with ReplicaPool(args.data_parallel, directory, engine_kwargs(args)) as pool:
        times["build_s"] = time.perf_counter() - start
        start = time.perf_counter()
        pool.generate(warmup_prompts(4 * args.data_parallel), WARMUP)  # small chunks: every replica gets some
        times["warmup_s"] = time.perf_counter() - start
        start = time.perf_counter()
        outs = pool.generate(prompts, params)
        times["generate_s"] = time.perf_counter() - start
        extra = {"replicas": pool.size, "chunk_rows": pool.chunk_rows,
                 "max_in_flight_per_replica": pool.max_in_flight_per_replica,
                 "replica_failures": [f.describe() for f in pool.failures]}
    return {**times, **extra}, [list(o.outputs[0].token_ids) for o in outs]


def run_single(directory, prompts, params, args) -> tuple[dict, list[list[int]]]:
    import torch

    times = {}
    start = time.perf_counter()
    llm = LLM(str(directory), **engine_kwargs(args))
    times["build_s"] = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(warmup_prompts(4), WARMUP, use_tqdm=False)
    times["warmup_s"] = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    times["generate_s"] = time.perf_counter() - start
    stats = llm.stats
    extra = {"steps": stats.num_steps, "preemptions": stats.num_preemptions, "num_kv_blocks": stats.num_kv_blocks}
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {**times, **extra}, [list(o.outputs[0].token_ids) for o in outs]


def add_rates(figures: dict, prompt_tokens: int, outputs: list[list[int]]) -> None:
    output_tokens = sum(map(len, outputs))
    tokens = prompt_tokens + output_tokens
    figures["output_tokens"] = output_tokens
    figures["output_tok_s"] = round(output_tokens / figures["generate_s"], 1)
    figures["total_tok_s"] = round(tokens / figures["generate_s"], 1)
    figures["total_tok_s_with_build"] = round(
        tokens / (figures["build_s"] + figures["warmup_s"] + figures["generate_s"]), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--rows", type=int, help="default: W1's 1000")
    parser.add_argument("--max-tokens", type=int, help="default: W1's 256")
    parser.add_argument("--data-parallel", type=int, default=2, help="replicas, one GPU each")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", default=None, help="also copy the JSON record into this directory")
    args = parser.parse_args()

    workload = WORKLOADS["W1"]
    rows = args.rows or workload.rows
    max_tokens = args.max_tokens or workload.output_tokens
    prompts = make_prompts(workload, rows, SHAPES[args.shape]["vocab_size"])
    prompt_tokens = sum(map(len, prompts))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    directory = make_shape_dir(args.shape)

    single_name = "batchllm_1gpu" if args.device == "cuda" else "batchllm_1engine"
    dp_name = f"batchllm_dp{args.data_parallel}"
    dp, dp_outputs = run_pool(directory, prompts, params, args)
    single, single_outputs = run_single(directory, prompts, params, args)
    add_rates(dp, prompt_tokens, dp_outputs)
    add_rates(single, prompt_tokens, single_outputs)
    dp["identical_rows"] = sum(a == b for a, b in zip(dp_outputs, single_outputs))
    systems = {single_name: single, dp_name: dp}
    speedup = round(dp["total_tok_s"] / single["total_tok_s"], 2)

    hw_name, hw = hardware(args.device)
    record = {"date": datetime.date.today().isoformat(), "git_sha": git_sha(), "shape": args.shape,
              "workload": {"name": "W1", "rows": rows, "output_tokens": max_tokens, "prompt_tokens": prompt_tokens},
              "hardware": hw, "data_parallel_size": args.data_parallel, "systems": systems,
              "dp_speedup_total_tok_s": speedup}
    name = f"{record['date']}-W1-r{rows}-o{max_tokens}-{args.shape}-{hw_name}-dp{args.data_parallel}.json"
    save_record(name, record, args.out)

    print(f"W1 {args.shape} on {hw_name}: {rows} rows, {prompt_tokens} prompt tokens, {max_tokens} output tokens each")
    print(f"{'system':18} {'build s':>8} {'warm s':>7} {'gen s':>8} {'total tok/s':>12} {'incl. build':>12} "
          f"{'same rows':>10}")
    for system, f in systems.items():
        same = f.get("identical_rows", rows)
        print(f"{system:18} {f['build_s']:>8.1f} {f['warmup_s']:>7.1f} {f['generate_s']:>8.2f} "
              f"{f['total_tok_s']:>12.1f} {f['total_tok_s_with_build']:>12.1f} {same:>6}/{rows}")
    print(f"data_parallel_size={args.data_parallel} / one engine, total tok/s: {speedup:.2f}x")
    print(f"record: results/{name}")


if __name__ == "__main__":
    main()
