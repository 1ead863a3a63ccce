"""KV memory tiers (`swap_space`): workload W2-large of shared/bench/WORKLOADS.md with the host tier on vs off,
and W3 with swap vs recompute preemption, each in one process on the same prompts.

    python benchmarks/kv_tiers.py --shape llama3-8b --swap-space 32      # one H200, random bf16 weights
    python benchmarks/kv_tiers.py                                        # CPU: the default model, scaled down

W2-large: 200 prefixes of 2,000 tokens, 5,000 rows each with one of them (uniformly at random, seed 5) and a
unique 100-token suffix, 64 output tokens. The limited device pool holds 25 % of the prefixes' blocks plus the
private (suffix and output) blocks of `--max-num-seqs` rows. Rows run in their input order
(`reorder_by_prefix=False`, as they arrive in a stream or a server): sorted by prefix, rows sharing one run
together and even a small pool hits almost every prefix, so the host tier has nothing to add (the
"prefix order" configuration shows it). W3: 256 rows of 128 tokens, 2,048 output tokens, with a device pool
of `--w3-pool-fraction` of the K/V the rows need at their longest, so rows are preempted as they grow.
One JSON record per run lands in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time

import torch
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, Workload, _plain, git_sha, hardware, make_prompts, save_record, warmup_prompts

from batchllm import LLM, SamplingParams

W2_LARGE = Workload(5000, 100, 100, 64, seed=5, cpu_rows=60, cpu_output_tokens=8, num_prefixes=200, prefix_len=2000)
BLOCK = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def run(args, label: str, prompts: list[list[int]], max_tokens: int, **options) -> dict:
    if args.shape:  # a random-weight shape of WORKLOADS.md: no checkpoint, no tokenizer
        options.update(model=str(make_shape_dir(args.shape)), load_format="dummy", skip_tokenizer_init=True)
    start = time.perf_counter()
    llm = LLM(device=args.device, max_num_seqs=args.max_num_seqs, **options)
    load_s = time.perf_counter() - start
    llm.generate(warmup_prompts(), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats
    print(f"  {label}: {seconds:.2f} s, hit rate {stats.prefix_cache_hit_rate:.3f}", flush=True)
    kv = llm.engine.scheduler.kv_cache
    pools = [kv.pool] + ([kv.host.pool] if kv.host is not None else [])
    leaked = sum(pool.num_used_blocks for pool in pools)
    prompt_tokens = sum(map(len, prompts))
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"config": label, "options": {k: v for k, v in options.items() if k != "model"},
              "load_s": round(load_s, 2), "generate_s": round(seconds, 3),
              "total_tok_s": round((prompt_tokens + output_tokens) / seconds, 1),
              "output_tok_s": round(output_tokens / seconds, 1), "hit_rate": round(stats.prefix_cache_hit_rate, 4),
              "host_hit_tokens": stats.host_prefix_hits, "prefill_tokens": stats.num_prefill_tokens,
              "preemptions": stats.num_preemptions, "swap_preemptions": stats.swap_preemptions,
              "transfer_gib": round(stats.kv_transfer_bytes / (1 << 30), 2),
              "transfer_s": round(stats.kv_transfer_seconds, 3), "leaked_blocks": leaked, "stats": _plain(stats),
              "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def w2_large(args) -> list[dict]:
    w = W2_LARGE
    rows = args.rows or (w.rows if args.shape else w.cpu_rows)
    max_tokens = args.max_tokens or (w.output_tokens if args.shape else w.cpu_output_tokens)
    w = Workload(rows, w.min_len, w.max_len, max_tokens, w.seed, rows, max_tokens,
                 args.prefixes or w.num_prefixes, args.prefix_len or w.prefix_len)
    vocab_size = SHAPES[args.shape]["vocab_size"] if args.shape else 49152
    prompts = make_prompts(w, rows, vocab_size)
    private_blocks = cdiv(w.max_len + max_tokens, BLOCK) + 1
    limited = round(0.25 * w.num_prefixes * cdiv(w.prefix_len, BLOCK)) + args.max_num_seqs * private_blocks
    stream = dict(reorder_by_prefix=False)
    configs = [("unlimited pool", dict(stream)),
               ("limited pool", dict(stream, num_kv_blocks=limited)),
               ("limited pool + host tier", dict(stream, num_kv_blocks=limited, swap_space=args.swap_space))]
    if args.prefix_order:
        configs.append(("limited pool, prefix order", dict(num_kv_blocks=limited)))
    print(f"W2-large: {rows} rows, {w.num_prefixes} prefixes x {w.prefix_len} tokens, {max_tokens} output tokens; "
          f"limited pool {limited} blocks", flush=True)
    return [dict(run(args, label, prompts, max_tokens, **options), workload="W2-large") for label, options in configs]


def w3(args) -> list[dict]:
    w = WORKLOADS["W3"]
    rows = args.w3_rows or (w.rows if args.shape else w.cpu_rows)
    max_tokens = args.w3_max_tokens or (w.output_tokens if args.shape else w.cpu_output_tokens)
    vocab_size = SHAPES[args.shape]["vocab_size"] if args.shape else 49152
    prompts = make_prompts(w, rows, vocab_size)
    pool = round(args.w3_pool_fraction * rows * cdiv(w.max_len + max_tokens, BLOCK))
    print(f"W3: {rows} rows x {w.max_len} tokens, {max_tokens} output tokens; pool {pool} blocks", flush=True)
    configs = [("recompute", dict(num_kv_blocks=pool)),
               ("swap", dict(num_kv_blocks=pool, swap_space=args.swap_space, preemption_mode="swap"))]
    return [dict(run(args, label, prompts, max_tokens, **options), workload="W3") for label, options in configs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="random bf16 weights of this shape (GPU runs)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--swap-space", type=float, default=None, help="GiB (default: 32 on a GPU, 1 on the CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--workloads", nargs="*", default=["W2-large", "W3"], choices=["W2-large", "W3"])
    parser.add_argument("--rows", type=int, help="W2-large rows (default: 5000; CPU 60)")
    parser.add_argument("--max-tokens", type=int, help="W2-large output tokens (default: 64; CPU 8)")
    parser.add_argument("--prefixes", type=int, help="W2-large prefixes (default: 200)")
    parser.add_argument("--prefix-len", type=int, help="W2-large prefix tokens (default: 2000)")
    parser.add_argument("--prefix-order", action="store_true", help="also run the limited pool in prefix order")
    parser.add_argument("--w3-rows", type=int)
    parser.add_argument("--w3-max-tokens", type=int)
    parser.add_argument("--w3-pool-fraction", type=float, default=0.4)
    parser.add_argument("--out", help="also copy the record here (the device tool's $OUT)")
    args = parser.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.swap_space is None:
        args.swap_space = 32 if cuda else 1
    results = []
    if "W2-large" in args.workloads:
        results += w2_large(args)
    if "W3" in args.workloads:
        results += w3(args)
    print(f"{'workload':9} {'config':27} {'gen s':>7} {'total tok/s':>11} {'x':>6} {'hit':>6} {'host hit tok':>12} "
          f"{'preempt':>7} {'swapped':>7} {'moved GiB':>9} {'copy s':>6} {'leak':>4} {'same':>4}")
    firsts: dict[str, dict] = {}
    for r in results:
        first = firsts.setdefault(r["workload"], r)
        r["same_outputs_as_first"] = r["outputs"] == first["outputs"]
        base = first if r["workload"] == "W3" else next(
            (x for x in results if x["config"] == "limited pool"), first)
        print(f"{r['workload']:9} {r['config']:27} {r['generate_s']:>7.2f} {r['total_tok_s']:>11.1f} "
              f"{base['generate_s'] / r['generate_s']:>5.2f}x {r['hit_rate']:>6.3f} {r['host_hit_tokens']:>12} "
              f"{r['preemptions']:>7} {r['swap_preemptions']:>7} {r['transfer_gib']:>9.2f} {r['transfer_s']:>6.2f} "
              f"{r['leaked_blocks']:>4} {str(r['same_outputs_as_first'])[0]:>4}")
    for r in results:
        del r["outputs"]
    machine, details = hardware("cuda" if cuda else "cpu")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    workloads = "-".join(sorted({r["workload"] for r in results}))
    name = f"{stamp}-kv-tiers-{workloads}-{args.shape or 'smollm2-135m-real'}-{machine}.json"
    path = save_record(name, {"shape": args.shape, "swap_space_gib": args.swap_space, "hardware": details,
                              "git_sha": git_sha(), "results": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
