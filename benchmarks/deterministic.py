"""`deterministic=True` on the GPU: do rows reproduce across batch mixes and restarts, and at what throughput.

    python benchmarks/deterministic.py --shape llama3-8b --rows 1000 --max-tokens 64 --out $OUT

W1's prompts (random weights of the shape, greedy, `ignore_eos`), for each mode (the default, then
`deterministic=True`), in one engine per mode:
(a) all rows in one `generate` call; (b) the same rows in 4 shuffled shards, one call each; (c) the first half of the
rows, then the second half in a fresh engine of the same options (what a job killed and resumed does). A row
reproduces when its token ids in (b) and in (c) equal those of (a). The throughput is (a)'s. Random weights make
near-ties common, so the default mode's share of reproduced rows is low (issue 46: ~12 %); the deterministic mode
must reproduce every row. On the CPU (`--device cpu`, a small shape and few rows) it checks the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import time

import torch
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record

from batchllm import LLM, SamplingParams
from batchllm.kernels import invariant_gemm

SHARDS = 4


def engine(directory, args, deterministic: bool) -> LLM:
    return LLM(model=str(directory), load_format="dummy", skip_tokenizer_init=True, device=args.device,
               dtype="bfloat16", deterministic=deterministic, max_num_seqs=args.max_num_seqs)


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple[int, ...]]:
    return [tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def free_device_memory() -> None:
    """Give a dropped engine's memory back before the next one sizes its KV pool from what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_mode(directory, prompts: list[list[int]], args, deterministic: bool) -> dict:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm = engine(directory, args, deterministic)
    tokens(llm, prompts[:16], params)  # warm-up: kernels compile outside the timed call
    start = time.perf_counter()
    whole = tokens(llm, prompts, params)
    seconds = time.perf_counter() - start
    output_tokens = sum(map(len, whole))
    figures = dict(deterministic=deterministic, rows=len(prompts), generate_s=seconds,
                   output_tok_s=output_tokens / seconds,
                   total_tok_s=(sum(map(len, prompts)) + output_tokens) / seconds)
    if args.throughput_only:
        llm.shutdown()
        del llm
        free_device_memory()
        print(f"deterministic={deterministic!s:5}: {figures['total_tok_s']:10.1f} total tok/s", flush=True)
        return figures
    order = list(range(len(prompts)))
    random.Random(args.seed).shuffle(order)
    sharded: dict[int, tuple[int, ...]] = {}
    for shard in range(SHARDS):
        rows = order[shard::SHARDS]
        sharded.update(zip(rows, tokens(llm, [prompts[i] for i in rows], params)))
    half = len(prompts) // 2
    first = tokens(llm, prompts[:half], params)
    llm.shutdown()
    del llm  # the last reference: its memory must be free for the fresh engine
    free_device_memory()
    resumed = engine(directory, args, deterministic)  # the restart: a fresh engine computes the rest
    second = tokens(resumed, prompts[half:], params)
    resumed.shutdown()
    del resumed
    free_device_memory()
    restarted = first + second
    same_sharded = sum(whole[i] == sharded[i] for i in range(len(prompts)))
    same_restarted = sum(a == b for a, b in zip(whole, restarted))
    figures.update(reproduced_in_shards=same_sharded, reproduced_after_restart=same_restarted)
    print(f"deterministic={deterministic!s:5}: {figures['total_tok_s']:10.1f} total tok/s; rows equal to one batch: "
          f"{same_sharded}/{len(prompts)} in {SHARDS} shuffled shards, {same_restarted}/{len(prompts)} after a "
          f"restart", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0, help="the shard shuffle's")
    parser.add_argument("--throughput-only", action="store_true",
                        help="only (a) in each mode: the throughput cost, for workloads too long to run three times")
    parser.add_argument("--gemm-loads", nargs="+", choices=["tma", "pointers"], default=["tma"],
                        help="how the invariant GEMM loads its tiles on Hopper; the deterministic mode runs once "
                             "per choice (the ratio is the first's)")
    parser.add_argument("--out", default=None, help="also copy the JSON record here")
    args = parser.parse_args()
    prompts = make_prompts(WORKLOADS[args.workload], args.rows, SHAPES[args.shape]["vocab_size"])
    directory = make_shape_dir(args.shape)
    modes = [run_mode(directory, prompts, args, False)]
    for loads in args.gemm_loads:
        invariant_gemm.TMA_ON_HOPPER = loads == "tma"
        print(f"invariant GEMM loads: {loads}", flush=True)
        modes.append(dict(run_mode(directory, prompts, args, True), gemm_loads=loads))
    default, deterministic = modes[:2]
    ratio = deterministic["total_tok_s"] / default["total_tok_s"]
    print(f"deterministic / default throughput: {ratio:.2f}x", flush=True)
    card, hw = hardware(args.device)
    record = {"date": datetime.date.today().isoformat(), "git_sha": git_sha(), "shape": args.shape,
              "workload": {"name": args.workload, "rows": args.rows, "output_tokens": args.max_tokens},
              "hardware": hw, "modes": modes, "throughput_ratio": ratio}
    kind = "-throughput" if args.throughput_only else ""
    save_record(f"{record['date']}-deterministic{kind}-{args.workload}-r{args.rows}-o{args.max_tokens}-{args.shape}-"
                f"{card}.json", record, args.out)


if __name__ == "__main__":
    main()
