"""Throughput on the GPU with random bf16 weights: batchllm vs HF transformers `generate_batch`, same prompts,
same process, plus the share of the physical limit.

    python benchmarks/gpu_throughput.py --shape llama3-8b --workload W1 --rows 200 --max-tokens 128

Weights are random (values do not change throughput), so the peer's weights are its own random init of the
same shape. Roofline figures use the card's measured rates from shared/bench/WORKLOADS.md: bf16 matmul
793 TFLOP/s (W1: 2 × params × total tokens) and copy bandwidth 4.24 TB/s (W3: per decode step the weights
plus every running sequence's K/V, summed over steps).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from shapes import SHAPES, head_dim, hf_config, make_shape_dir, num_params
from throughput import (
    WORKLOADS,
    _plain,
    continuous_batching_attn,
    git_sha,
    hardware,
    make_prompts,
    save_record,
    size_or_auto,
)
from transformers import AutoModelForCausalLM, GenerationConfig

from batchllm import LLM, SamplingParams

MATMUL_FLOPS = 793e12
COPY_BYTES_PER_S = 4.24e12


def run_batchllm(directory, prompts, max_tokens: int, args, async_scheduling: bool | None = None,
                 **llm_options) -> dict:
    times = {}
    start = time.perf_counter()
    llm = LLM(model=str(directory), load_format="dummy", skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              async_scheduling=async_scheduling, **llm_options)
    times["load_s"] = time.perf_counter() - start  # engine ready: weights, profiling, KV pool, graphs
    start = time.perf_counter()
    # Warm-up on the workload's own first rows: Triton compiles its kernels for the prefill and mixed-step
    # shapes here, not inside the timed run (where the first engine of a process would pay for the second).
    llm.generate(prompts[:64], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    times["warmup_s"] = time.perf_counter() - start
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    times["generate_s"] = time.perf_counter() - start
    stats = llm.stats
    completions = [o.outputs[0] for o in outs]
    tpot = sorted(c.metrics.time_per_output_token(len(c.token_ids)) for c in completions)
    ttft = sorted(c.metrics.time_to_first_token for c in completions)
    result = {**times, "output_tokens": sum(len(c.token_ids) for c in completions),
              "tpot_mean_s": sum(tpot) / len(tpot), "tpot_p99_s": _percentile(tpot, 0.99),
              "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p99_s": _percentile(ttft, 0.99),
              "stats": _plain(stats), "num_kv_blocks": stats.num_kv_blocks,
              "peak_kv_blocks": stats.peak_used_blocks, "preemptions": stats.num_preemptions,
              "recomputed_tokens": stats.num_recomputed_tokens,
              "admission_policy": llm.config.scheduler.admission_policy,
              "max_num_seqs": llm.max_num_seqs, "max_num_batched_tokens": llm.max_num_batched_tokens,
              "steps": stats.num_steps, "async_scheduling": llm.engine.async_scheduling,
              "token_ids": [c.token_ids for c in completions] if args.also_sync else None}
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_hf(shape: str, prompts, max_tokens: int) -> dict:
    times = {}
    attn = continuous_batching_attn()
    start = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16,
                                                 attn_implementation=attn).eval()
    times["load_s"] = time.perf_counter() - start
    generation = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    model.generate_batch(inputs=[list(range(100, 164))] * 8,
                         generation_config=GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1))
    times["warmup_s"] = time.perf_counter() - start
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=generation)
    times["generate_s"] = time.perf_counter() - start
    output_tokens = sum(len(r.generated_tokens) for r in results.values())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {**times, "output_tokens": output_tokens, "attn_implementation": attn}


def roofline(shape: str, workload: str, prompts, max_tokens: int, seconds: float) -> dict:
    params, active = num_params(shape), num_params(shape, active=True)
    total_tokens = sum(map(len, prompts)) + len(prompts) * max_tokens
    s = SHAPES[shape]
    kv_bytes_per_token = 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim(shape) * 2
    compute_s = 2 * active * total_tokens / MATMUL_FLOPS
    # Bandwidth bound, assuming every row decodes in lock-step (true for W3's equal lengths): each step reads
    # the weights once (a MoE's every expert: a large batch chooses them all) and each row's K/V so far.
    kv_reads = sum(kv_bytes_per_token * (len(p) + t) for p in prompts for t in range(max_tokens))
    bandwidth_s = (max_tokens * params * 2 + kv_reads) / COPY_BYTES_PER_S
    return {"compute_roofline_s": round(compute_s, 3), "compute_share": round(compute_s / seconds, 3),
            "bandwidth_roofline_s": round(bandwidth_s, 3), "bandwidth_share": round(bandwidth_s / seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--peer", choices=["generate_batch", "none"], default="generate_batch")
    parser.add_argument("--max-num-seqs", type=size_or_auto, default=256, help="a number, or auto: the engine's")
    parser.add_argument("--max-num-batched-tokens", type=size_or_auto, default=None,
                        help="default (or auto): the engine's")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--quantization", default=None, help="batchllm's (fp8, mxfp4, ...); the peer stays bf16")
    parser.add_argument("--also-sync", action="store_true",
                        help="also run batchllm with async_scheduling=False (the default is on for CUDA)")
    parser.add_argument("--admission-policy", choices=["kv_aware", "optimistic"], default="kv_aware",
                        help="batchllm's admission (engine/admission.py): optimistic preempts and recomputes")
    parser.add_argument("--deterministic", action="store_true", help="LLM(deterministic=True): batch-invariant kernels")
    parser.add_argument("--num-decode-steps", type=int, nargs="+", default=[1], metavar="K",
                        help="LLM(num_decode_steps=K), decode bursts; several values run one engine each in this "
                             "process, in turn (the first is `batchllm`, the others `batchllm_steps{K}`)")
    parser.add_argument("--out", default=None, help="also copy the JSON record here")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="the whole run in N fresh processes (PYTHONHASHSEED 0 .. N-1), each its own record, "
                             "and the median: a host-bound run's figure moves with the process's memory layout")
    args = parser.parse_args()
    if args.processes > 1:
        run_processes(args)
        return

    workload = WORKLOADS[args.workload]
    rows = args.rows or workload.rows
    max_tokens = args.max_tokens or workload.output_tokens
    prompts = make_prompts(workload, rows, SHAPES[args.shape]["vocab_size"])
    directory = make_shape_dir(args.shape)
    options = dict(quantization=args.quantization, admission_policy=args.admission_policy)
    if args.deterministic:
        options["deterministic"] = True
    first, *others = args.num_decode_steps
    if others:
        # The process's first engine compiles the kernels of the workload's shapes past the warm-up's (it ran a
        # third as fast as the next on smollm2-135m W1): an engine thrown away first, so that the ratios compare
        # warm engines.
        run_batchllm(directory, prompts, max_tokens, args, num_decode_steps=first, **options)
    systems = {"batchllm": run_batchllm(directory, prompts, max_tokens, args, num_decode_steps=first, **options)}
    names = []
    for steps in others:  # same process, same prompts: the ratio to `batchllm` holds the host's speed fixed
        name = f"batchllm_steps{steps}"
        name += f"_{sum(n.startswith(name) for n in names) + 1}" if name in names else ""
        names.append(name)
        systems[name] = run_batchllm(directory, prompts, max_tokens, args, num_decode_steps=steps, **options)
        systems[name].pop("token_ids")
    if args.also_sync:
        systems["batchllm_sync"] = run_batchllm(directory, prompts, max_tokens, args, async_scheduling=False, **options)
        # bf16 on random weights: a batch of another size may flip a near-tie, so this is a share, not a bound.
        pairs = zip(systems["batchllm"].pop("token_ids"), systems["batchllm_sync"].pop("token_ids"))
        systems["batchllm"]["rows_equal_to_sync"] = sum(a == b for a, b in pairs)
    else:
        systems["batchllm"].pop("token_ids")
    if args.peer == "generate_batch":
        systems["hf_generate_batch"] = run_hf(args.shape, prompts, max_tokens)
    prompt_tokens = sum(map(len, prompts))
    for figures in systems.values():
        seconds = figures["generate_s"]
        figures["output_tok_s"] = round(figures["output_tokens"] / seconds, 1)
        figures["total_tok_s"] = round((prompt_tokens + figures["output_tokens"]) / seconds, 1)
    systems["batchllm"]["roofline"] = roofline(args.shape, args.workload, prompts, max_tokens,
                                               systems["batchllm"]["generate_s"])
    print(f"{args.workload} {args.shape}: {rows} rows, {prompt_tokens} prompt tokens, {max_tokens} output tokens")
    print(f"{'system':20} {'load s':>7} {'warm s':>7} {'gen s':>7} {'out tok/s':>10} {'total tok/s':>11}")
    for name, f in systems.items():
        print(f"{name:20} {f['load_s']:>7.1f} {f['warmup_s']:>7.1f} {f['generate_s']:>7.2f} "
              f"{f['output_tok_s']:>10.1f} {f['total_tok_s']:>11.1f}")
    ours = systems["batchllm"]
    print(f"batchllm: time per output token mean {ours['tpot_mean_s'] * 1e3:.1f} ms, p99 "
          f"{ours['tpot_p99_s'] * 1e3:.1f} ms; time to first token mean {ours['ttft_mean_s']:.2f} s, p99 "
          f"{ours['ttft_p99_s']:.2f} s")
    print(f"batchllm: KV blocks peak {ours['peak_kv_blocks']}/{ours['num_kv_blocks']}, preemptions "
          f"{ours['preemptions']} ({ours['recomputed_tokens']} prompt tokens recomputed, {ours['admission_policy']} "
          f"admission), steps {ours['steps']}, roofline {ours['roofline']}")
    if args.also_sync:
        ratio = ours["total_tok_s"] / systems["batchllm_sync"]["total_tok_s"]
        equal = ours["rows_equal_to_sync"]
        print(f"batchllm async / sync total tok/s: {ratio:.2f}x; greedy rows equal: {equal}/{rows}")
    for name in names:
        ratio = systems[name]["total_tok_s"] / ours["total_tok_s"]
        print(f"{name} / batchllm (num_decode_steps={first}) total tok/s: {ratio:.2f}x")
    if "hf_generate_batch" in systems:
        ratio = ours["total_tok_s"] / systems["hf_generate_batch"]["total_tok_s"]
        print(f"batchllm / HF generate_batch total tok/s: {ratio:.1f}x")
    _, hw = hardware("cuda" if torch.cuda.is_available() else "cpu")
    record = {"date": datetime.date.today().isoformat(), "git_sha": git_sha(), "shape": args.shape,
              "quantization": args.quantization, "deterministic": args.deterministic,
              "admission_policy": args.admission_policy,
              "workload": {"name": args.workload, "rows": rows, "output_tokens": max_tokens,
                           "prompt_tokens": prompt_tokens}, "hardware": hw, "systems": systems}
    card = torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else "cpu"
    budget = f"-b{args.max_num_batched_tokens}" if args.max_num_batched_tokens else ""
    quant = f"-{args.quantization}" if args.quantization else ""
    mode = ("-deterministic" if args.deterministic else "") + ("-optimistic" if args.admission_policy == "optimistic"
                                                                else "")
    seed = f"-hashseed{os.environ['PYTHONHASHSEED']}" if "PYTHONHASHSEED" in os.environ else ""
    seqs = args.max_num_seqs or "auto"
    mode += "-steps" + "-".join(map(str, args.num_decode_steps)) if args.num_decode_steps != [1] else ""
    name = (f"{record['date']}-{args.workload}-r{rows}-o{max_tokens}-{args.shape}{quant}-seqs{seqs}"
            f"{budget}{mode}{seed}-{card}.json")
    save_record(name, record, args.out)


def run_processes(args) -> None:
    """`--processes N`: this script's run in N child processes, one after another, each with its own hash seed
    (so its own layout of Python objects: on a run whose steps wait for the host, the same tree has measured
    155k-292k total tok/s by that layout alone, benchmarks/README.md), then each child's figures and the median."""
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if not skip and not arg.startswith("--processes"):
            argv.append(arg)
        skip = arg == "--processes"  # its value follows
    totals = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.processes):
            out = Path(tmp, str(seed))
            out.mkdir()
            env = {**os.environ, "PYTHONHASHSEED": str(seed)}
            subprocess.run([sys.executable, __file__, *argv, "--out", str(out)], env=env, check=True)
            record_file = next(out.glob("*.json"))
            if args.out:
                shutil.copy(record_file, args.out)
            totals.append(json.loads(record_file.read_text())["systems"]["batchllm"]["total_tok_s"])
    print(f"batchllm total tok/s over {args.processes} processes (hash seeds 0..{args.processes - 1}): "
          + ", ".join(f"{t:,.0f}" for t in totals) + f"; median {statistics.median(totals):,.0f}")


if __name__ == "__main__":
    main()
