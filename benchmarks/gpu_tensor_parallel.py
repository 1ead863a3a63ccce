"""Tensor parallelism on the GPUs of one host: throughput and agreement of TP=N against TP=1, random weights.

    python benchmarks/gpu_tensor_parallel.py --shape llama3-8b --rows 200 --max-tokens 128 --tp 1 2
    python benchmarks/gpu_tensor_parallel.py --shape llama3-70b --rows 200 --max-tokens 128 --tp 2

Every size runs the same W1 prompts in the same process, one engine after the other. Random weights are
generated per checkpoint tensor from its name, so every TP size holds the same model and greedy outputs
are comparable: the agreement columns compare each size with the first one (first generated token, and
whole rows). Bf16 sums in a different order flip near-ties, and on random weights every distribution is
nearly flat, so later tokens diverge once one flips.
"""

from __future__ import annotations

import os

# NVLink multicast is unavailable on the lent machines: NCCL and torch must not try it (every process).
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import datetime  # noqa: E402
import faulthandler  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from shapes import SHAPES, make_shape_dir, num_params  # noqa: E402
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record  # noqa: E402

from batchllm import LLM, SamplingParams  # noqa: E402

MATMUL_FLOPS = 793e12  # bf16 dense, one H200 (shared/bench/WORKLOADS.md)


def run(directory, tp: int, prompts, max_tokens: int, args) -> tuple[dict, list[list[int]]]:
    start = time.perf_counter()
    llm = LLM(model=str(directory), load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=tp,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, device=args.device)
    ready_s = time.perf_counter() - start
    llm.generate([list(range(100, 164))] * 8, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    stats = llm.stats
    tokens = [o.outputs[0].token_ids for o in outs]
    llm.shutdown()
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    total = sum(map(len, prompts)) + sum(map(len, tokens))
    return {"tp": tp, "ready_s": round(ready_s, 1), "generate_s": round(generate_s, 2),
            "total_tok_s": round(total / generate_s, 1), "output_tok_s": round(sum(map(len, tokens)) / generate_s, 1),
            "num_kv_blocks": stats.num_kv_blocks, "kv_tokens": stats.num_kv_blocks * stats.block_size,
            "peak_kv_blocks": stats.peak_used_blocks, "preemptions": stats.num_preemptions,
            "steps": stats.num_steps}, tokens


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    first = sum(a[:1] == b[:1] for a, b in zip(reference, other)) / len(reference)
    rows = sum(a == b for a, b in zip(reference, other)) / len(reference)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) / len(a)
              for a, b in zip(reference, other)]
    return {"first_token": round(first, 3), "identical_rows": round(rows, 3),
            "mean_matching_prefix": round(sum(prefix) / len(prefix), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", default=None, help="also copy the JSON record here")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` shows where a hang is

    workload = WORKLOADS["W1"]
    prompts = make_prompts(workload, args.rows, SHAPES[args.shape]["vocab_size"])
    directory = make_shape_dir(args.shape)
    results, outputs = [], []
    for tp in args.tp:
        figures, tokens = run(directory, tp, prompts, args.max_tokens, args)
        if outputs:
            figures["agreement_with_tp%d" % args.tp[0]] = agreement(outputs[0], tokens)
        total_tokens = sum(map(len, prompts)) + args.rows * args.max_tokens
        figures["compute_share"] = round(2 * num_params(args.shape) * total_tokens / (MATMUL_FLOPS * tp)
                                         / figures["generate_s"], 3)
        results.append(figures)
        outputs.append(tokens)
        print(json.dumps(figures), flush=True)

    print(f"W1 {args.shape}: {args.rows} rows, {sum(map(len, prompts))} prompt tokens, {args.max_tokens} out")
    print(f"{'tp':>3} {'ready s':>8} {'gen s':>7} {'total tok/s':>12} {'vs first':>9} {'KV blocks':>10} "
          f"{'roofline':>9} {'agreement (first token / rows)':>31}")
    for f in results:
        agree = f.get("agreement_with_tp%d" % args.tp[0])
        agree_text = f"{agree['first_token']:.3f} / {agree['identical_rows']:.3f}" if agree else "-"
        print(f"{f['tp']:>3} {f['ready_s']:>8.1f} {f['generate_s']:>7.2f} {f['total_tok_s']:>12.1f} "
              f"{f['total_tok_s'] / results[0]['total_tok_s']:>8.2f}x {f['num_kv_blocks']:>10} "
              f"{f['compute_share']:>9.3f} {agree_text:>31}")
    hw_name, hw = hardware("cuda" if args.device == "cuda" else "cpu")
    record = {"date": datetime.date.today().isoformat(), "git_sha": git_sha(), "shape": args.shape,
              "workload": {"name": "W1", "rows": args.rows, "output_tokens": args.max_tokens,
                           "prompt_tokens": sum(map(len, prompts))},
              "hardware": hw, "gpus": torch.cuda.device_count(), "tensor_parallel": results}
    tps = "-".join(map(str, args.tp))
    name = f"{record['date']}-W1-r{args.rows}-o{args.max_tokens}-{args.shape}-{hw_name}-tp{tps}.json"
    save_record(name, record, args.out)


if __name__ == "__main__":
    main()
