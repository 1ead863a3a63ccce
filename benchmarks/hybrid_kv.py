"""The hybrid KV cache against the same engine keeping every block, at long context on a model with sliding-window
layers: concurrent sequences and output tok/s, one process, the same prompts (random bf16 weights).

    python benchmarks/hybrid_kv.py --shape gemma3-12b --rows 256 --prompt-tokens 8000 --max-tokens 256 --out $OUT

Each configuration builds its own `LLM` (random weights, no tokenizer, prefix caching off so that no run reuses
another's blocks), warms up on the first rows (4 tokens each), then generates `--max-tokens` greedy tokens per row
(`ignore_eos`). Figures: output tok/s of the timed run, the most sequences running at once (`max_running`), the
pool's blocks and the tokens it holds for one sequence (a hybrid block holds one group of layers), preemptions.
"""

from __future__ import annotations

import argparse
import datetime
import random

from gpu_throughput import run_batchllm
from shapes import SHAPES, make_shape_dir
from throughput import git_sha, hardware, save_record

CONFIGS = {"hybrid": False, "every-block": True}  # name -> disable_hybrid_kv_cache_manager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-12b")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", default=None, help="also copy the JSON record here")
    parser.set_defaults(enforce_eager=False, also_sync=False)  # run_batchllm's own options
    args = parser.parse_args()
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.rows)]
    directory = make_shape_dir(args.shape)
    results = {}
    for name in args.configs:
        result = run_batchllm(directory, prompts, args.max_tokens, args, enable_prefix_caching=False,
                              disable_hybrid_kv_cache_manager=CONFIGS[name])
        result["output_tok_s"] = result["output_tokens"] / result["generate_s"]
        result["max_running"] = result["stats"]["max_running"]
        results[name] = result
        print(f"{name:12s} load {result['load_s']:6.1f} s  gen {result['generate_s']:7.2f} s  "
              f"out {result['output_tok_s']:9.1f} tok/s  max running {result['max_running']:4d}  "
              f"KV blocks {result['num_kv_blocks']}  preemptions {result['preemptions']}", flush=True)
    if len(results) == 2:
        hybrid, plain = results["hybrid"], results["every-block"]
        print(f"hybrid / every block: concurrent sequences {hybrid['max_running'] / plain['max_running']:.2f}x, "
              f"output tok/s {hybrid['output_tok_s'] / plain['output_tok_s']:.2f}x")
    card, hw = hardware("cuda")
    record = {"date": datetime.date.today().isoformat(), "git_sha": git_sha(), "shape": args.shape,
              "rows": args.rows, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "max_num_seqs": args.max_num_seqs, "hardware": hw,
              "systems": {name: {k: v for k, v in r.items() if k != "token_ids"} for name, r in results.items()}}
    save_record(f"{record['date']}-hybrid-kv-{args.shape}-r{args.rows}-p{args.prompt_tokens}-o{args.max_tokens}-"
                f"{card}.json", record, args.out)


if __name__ == "__main__":
    main()
