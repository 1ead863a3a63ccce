"""Prefix caching on workload W2 (shared-prefix) of shared/bench/WORKLOADS.md: caching on vs off, and
prefix-aware admission order on vs off, in one process on the same prompts.

    python benchmarks/prefix_cache.py                 # CPU-sized W2 (40 rows, 16 output tokens)
    python benchmarks/prefix_cache.py --rows 1000 --max-tokens 128 --shape llama3-8b

Each configuration builds its own engine (so no cache carries over) and runs the same prompts once after
a small warm-up. The tight-pool configurations hold only about three of the ten system prompts at a time,
which is where admission order can matter. One JSON file per run lands in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time

import torch
from shapes import SHAPES, make_shape_dir
from throughput import RESULTS, WORKLOADS, _plain, git_sha, hardware, make_prompts, warmup_prompts

from batchllm import LLM, SamplingParams

CONFIGS = {  # name → LLM keyword arguments
    "cache off": dict(enable_prefix_caching=False),
    "cache on, input order": dict(enable_prefix_caching=True, reorder_by_prefix=False),
    "cache on, prefix order": dict(enable_prefix_caching=True, reorder_by_prefix=True),
    "tight pool, input order": dict(enable_prefix_caching=True, reorder_by_prefix=False, tight=True),
    "tight pool, prefix order": dict(enable_prefix_caching=True, reorder_by_prefix=True, tight=True),
}


def run(args, name: str, prompts: list[list[int]]) -> dict:
    options = dict(CONFIGS[name])
    if options.pop("tight", False):
        # Three system prompts' blocks, plus each running row's private suffix and output blocks.
        private_blocks = -(-(100 + args.max_tokens) // 16) + 1
        options["num_kv_blocks"] = 3 * (-(-1000 // 16)) + args.max_num_seqs * private_blocks
    start = time.perf_counter()
    if args.shape:  # a random-weight shape of WORKLOADS.md: no checkpoint, no tokenizer
        options.update(model=str(make_shape_dir(args.shape)), load_format="dummy", skip_tokenizer_init=True)
    else:
        options.update(model=args.model, load_format=args.load_format)
    llm = LLM(device=args.device, max_num_seqs=args.max_num_seqs, **options)
    load_s = time.perf_counter() - start
    llm.generate(warmup_prompts(), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats
    prompt_tokens = sum(map(len, prompts))
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"config": name, "load_s": round(load_s, 2), "generate_s": round(seconds, 3),
              "total_tok_s": round((prompt_tokens + output_tokens) / seconds, 1),
              "output_tok_s": round(output_tokens / seconds, 1),
              "hit_rate": round(stats.prefix_cache_hit_rate, 4), "prefill_tokens": stats.num_prefill_tokens,
              "evicted_blocks": stats.evicted_blocks, "preemptions": stats.num_preemptions,
              "num_kv_blocks": stats.num_kv_blocks, "stats": _plain(stats),
              "outputs": [o.outputs[0].token_ids for o in outs]}
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="random bf16 weights of this shape (GPU runs)")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = parser.parse_args()

    vocab_size = SHAPES[args.shape]["vocab_size"] if args.shape else 49152  # 49152: the default model's
    prompts = make_prompts(WORKLOADS["W2"], args.rows, vocab_size)
    results = [run(args, name, prompts) for name in args.configs]
    reference = results[0]["outputs"]
    print(f"W2 shared-prefix, {args.rows} rows, {args.max_tokens} output tokens")
    print(f"{'config':26} {'generate s':>10} {'total tok/s':>11} {'hit rate':>8} {'prefill tok':>11} "
          f"{'evicted':>7} {'speed-up':>8} {'same out':>8}")
    base = results[0]["generate_s"]
    for r in results:
        print(f"{r['config']:26} {r['generate_s']:>10.2f} {r['total_tok_s']:>11.1f} {r['hit_rate']:>8.3f} "
              f"{r['prefill_tokens']:>11} {r['evicted_blocks']:>7} {base / r['generate_s']:>7.2f}x "
              f"{str(r['outputs'] == reference):>8}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    machine, details = hardware(device)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"{stamp}-W2-prefix-cache-{machine}.json"
    for r in results:
        r.pop("outputs")
    out.write_text(json.dumps({"workload": "W2", "rows": args.rows, "max_tokens": args.max_tokens,
                               "hardware": details, "git_sha": git_sha(), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
