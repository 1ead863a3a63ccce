"""Disaggregated prefill / decode against one engine, in one process on the same prompts.

    python benchmarks/disaggregated.py --shape llama3-8b          # one H200: both engines share it
    python benchmarks/disaggregated.py                            # CPU: the default model, scaled down

On one GPU both engines share the card (the prefill engine holds half the memory), so this shows the mechanics
and their cost, not what two GPUs would give: that comparison, against data parallelism on the same GPUs, needs
a two-GPU machine. W1 rows (uniform 100-1000 prompt tokens), greedy, `ignore_eos`. Reports total tok/s, mean time
to first token, the handoffs, and whether the outputs equal the single engine's. One JSON record per run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time

import torch
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record, warmup_prompts

from batchllm import LLM, SamplingParams


def run(args, label: str, prompts: list[list[int]], **options) -> dict:
    if args.shape:
        options.update(model=str(make_shape_dir(args.shape)), load_format="dummy", skip_tokenizer_init=True)
    start = time.perf_counter()
    llm = LLM(device=args.device, **options)
    load_s = time.perf_counter() - start
    llm.generate(warmup_prompts(), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats
    ttft = [o.outputs[0].metrics.first_token_time - o.outputs[0].metrics.arrival_time for o in outs]
    tokens = sum(map(len, prompts)) + sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"config": label, "load_s": round(load_s, 1), "generate_s": round(seconds, 3),
              "total_tok_s": round(tokens / seconds, 1), "mean_ttft_s": round(sum(ttft) / len(ttft), 3),
              "handoffs": stats.kv_handoffs, "handoff_blocks": stats.kv_handoff_blocks,
              "handoffs_recomputed": stats.kv_handoffs_recomputed, "preemptions": stats.num_preemptions,
              "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    print(f"  {label}: {seconds:.2f} s", flush=True)
    llm.shutdown()
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="random bf16 weights of this shape (GPU runs)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", type=int, help="W1 rows (default: 200; CPU 16)")
    parser.add_argument("--max-tokens", type=int, help="output tokens (default: 128; CPU 16)")
    parser.add_argument("--out", help="also copy the record here (the device tool's $OUT)")
    args = parser.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.rows = args.rows or (200 if cuda else 16)
    args.max_tokens = args.max_tokens or (128 if cuda else 16)
    vocab_size = SHAPES[args.shape]["vocab_size"] if args.shape else 49152
    prompts = make_prompts(WORKLOADS["W1"], args.rows, vocab_size)
    results = [run(args, "one engine", prompts),
               run(args, "prefill + decode engines", prompts, disaggregated={"prefill": 1, "decode": 1})]
    print(f"{'config':26} {'gen s':>7} {'total tok/s':>11} {'x':>6} {'TTFT s':>7} {'handoffs':>8} {'blocks':>7} "
          f"{'same':>5}")
    for r in results:
        r["same_outputs_as_one_engine"] = r["outputs"] == results[0]["outputs"]
        print(f"{r['config']:26} {r['generate_s']:>7.2f} {r['total_tok_s']:>11.1f} "
              f"{results[0]['generate_s'] / r['generate_s']:>5.2f}x {r['mean_ttft_s']:>7.3f} {r['handoffs']:>8} "
              f"{r['handoff_blocks']:>7} {str(r['same_outputs_as_one_engine'])[0]:>5}")
    for r in results:
        del r["outputs"]
    machine, details = hardware("cuda" if cuda else "cpu")
    name = f"{datetime.date.today()}-disaggregated-W1-{args.shape or 'smollm2-135m-real'}-{machine}.json"
    path = save_record(name, {"shape": args.shape, "rows": args.rows, "max_tokens": args.max_tokens,
                              "hardware": details, "git_sha": git_sha(), "results": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
