"""Multi-LoRA: throughput with adapters against the base model, one run (issue: multi-LoRA's benchmark).

    python benchmarks/lora.py --shape llama3-8b              # GPU, random bf16 weights and adapters, W1 200 x 128
    python benchmarks/lora.py --shape tiny-host --rows 32    # a CPU smoke run of the same passes

Two engines on one device, built alike (same KV pool, CUDA graphs, no prefix caching): the base model without
LoRA, and one with `enable_lora=True, max_loras=4, max_lora_rank=16`. Passes over W1's first `--rows` prompts
(random token ids), every row writing exactly `--max-tokens` tokens (ignore_eos): the base engine; the LoRA
engine with no adapter; one adapter on every row; 4 adapters spread uniformly; 16 adapters spread uniformly
(16 adapters share 4 device slots: the engine groups rows by adapter and swaps slots in LRU order; the number
of slot loads is reported). Adapters are PEFT-format directories of rank 16 on all seven projections, random
A and B. Reported: total (prompt + output) and output tokens per second, and the total's ratio to the base
engine's pass in the same run (targets: one adapter >= 0.90, 4 adapters >= 0.85).

    python benchmarks/lora.py --kernels --out $OUT           # GPU: the delta kernels alone, fused vs two-kernel

`--kernels` times the kernels instead of engines, at decode sizes T = 1, 16, 64, 256: each LoRA layer of the
shape as the engine builds it (qkv with three slices, o, gate_up with two, down: the seven projections), rank
16 in 4 slots, 1 or 4 adapters (tokens spread uniformly), bf16. Per case, `triton.testing.do_bench` (L2
flushed before each call; `--graph`: `do_bench_cudagraph`, launch overhead excluded as in the decode graphs)
times the base product alone (no LoRA), the base product then the fused kernel, and the base product then the
two-kernel path; the ratios are the base's time to each. A table, and a JSON record.
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path

import torch
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record

from batchllm import LLM, LoRARequest, SamplingParams
from batchllm.model.config import ModelConfig, read_hf_config
from batchllm.model.layers.lora import LoRASlots
from batchllm.model.lora_adapter import write_random_adapter

RANK = 16
KERNEL_TOKENS = (1, 16, 64, 256)
KERNEL_SLOTS = 4


def run_pass(llm: LLM, prompts, params, loras) -> dict:
    lora_manager = getattr(llm.runner, "lora", None)
    loads_before = lora_manager.slot_loads if lora_manager is not None else 0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "total_tok_s": (tokens + sum(len(p) for p in prompts)) / seconds, "steps": llm.stats.num_steps,
            "slot_loads": (lora_manager.slot_loads - loads_before) if lora_manager is not None else 0}


def lora_layers(shape: str) -> dict[str, tuple[int, list[int]]]:
    """The engine's LoRA layers of a Llama-family shape: name → (input features, its sub-projections' sizes)."""
    config = SHAPES[shape]
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"qkv": (hidden, [q, kv, kv]), "o": (q, [hidden]), "gate_up": (hidden, [intermediate, intermediate]),
            "down": (intermediate, [hidden])}


def kernel_case(in_features: int, sizes: list[int], tokens: int, adapters: int, seed: int,
                device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> tuple:
    """`(x, w, out, a, b, sorted_tokens, slot_starts)` of one layer at one step: token t under adapter
    `t % adapters`, slots filled as the engine fills them (block-diagonal B)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    slots = LoRASlots(list(zip(offsets, sizes)), in_features, sum(sizes), KERNEL_SLOTS, RANK, dtype,
                      torch.device(device))
    for slot in range(adapters):
        for index, size in enumerate(sizes):
            a = torch.randn(RANK, in_features, generator=gen, device=device) * in_features ** -0.5
            b = torch.randn(size, RANK, generator=gen, device=device) * 0.01
            slots.write(slot, index, a.to(dtype), b.to(dtype))
    x = torch.randn(tokens, in_features, generator=gen, device=device).to(dtype)
    w = (torch.randn(sum(sizes), in_features, generator=gen, device=device) * in_features ** -0.5).to(dtype)
    slot_of = torch.arange(tokens, device=device) % adapters
    sorted_tokens = torch.argsort(slot_of, stable=True).to(torch.int32)
    counts = torch.bincount(slot_of, minlength=KERNEL_SLOTS)
    slot_starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    out = torch.empty(tokens, sum(sizes), dtype=dtype, device=device)
    return x, w, out, slots.a, slots.b, sorted_tokens, slot_starts


def kernel_benchmark(args: argparse.Namespace) -> None:
    """`--kernels`: base product alone, then with the fused and with the two-kernel LoRA delta (GPU only)."""
    if not torch.cuda.is_available():
        raise SystemExit("--kernels times Triton kernels: it needs a CUDA device")
    from triton.testing import do_bench, do_bench_cudagraph

    from batchllm.kernels.lora import add_lora_shrink_expand
    from batchllm.kernels.lora_fused import add_lora_fused

    def timed_us(fn) -> float:
        bench = do_bench_cudagraph if args.graph else do_bench
        return 1e3 * bench(fn, return_mode="median")

    rows = []
    for adapters in (1, 4):
        for tokens in KERNEL_TOKENS:
            for layer, (in_features, sizes) in lora_layers(args.shape).items():
                x, w, out, *lora_args = kernel_case(in_features, sizes, tokens, adapters, seed=len(rows))
                times = {"base_us": timed_us(lambda: torch.matmul(x, w.T, out=out))}
                for path, delta in (("fused_us", add_lora_fused), ("two_kernel_us", add_lora_shrink_expand)):
                    times[path] = timed_us(lambda: delta(x, torch.matmul(x, w.T, out=out), *lora_args))
                rows.append({"adapters": adapters, "tokens": tokens, "layer": layer, "in": in_features,
                             "out": sum(sizes), **times})
    device_name, device_info = hardware("cuda")
    timer = "do_bench_cudagraph" if args.graph else "do_bench (median, L2 flushed)"
    print(f"LoRA delta kernels, {args.shape}, rank {RANK} in {KERNEL_SLOTS} slots, bf16, {timer}, {device_name}")
    print(f"{'adapters':>8} {'T':>4} {'layer':<8} {'base us':>8} {'+fused':>8} {'+2-kernel':>9} "
          f"{'base/fused':>10} {'base/2k':>8}")
    for r in rows:
        print(f"{r['adapters']:>8} {r['tokens']:>4} {r['layer']:<8} {r['base_us']:>8.1f} {r['fused_us']:>8.1f} "
              f"{r['two_kernel_us']:>9.1f} {r['base_us'] / r['fused_us']:>10.2f} "
              f"{r['base_us'] / r['two_kernel_us']:>8.2f}")
    record = {"benchmark": "lora-kernels", "date": datetime.date.today().isoformat(), "git": git_sha(),
              "hardware": device_name, "hardware_info": device_info, "shape": args.shape, "rank": RANK,
              "slots": KERNEL_SLOTS, "timer": timer, "results": rows}
    name = f"{record['date']}-lora-kernels-{args.shape}{'-graph' if args.graph else ''}-{device_name}.json"
    print(save_record(name, record, args.out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-kv-blocks", type=int, default=12000, help="each engine's KV pool (two share a GPU)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--kernels", action="store_true", help="time the LoRA kernels alone (see above; GPU)")
    parser.add_argument("--graph", action="store_true", help="with --kernels: time inside CUDA graphs")
    args = parser.parse_args()
    if args.kernels:
        return kernel_benchmark(args)
    directory = make_shape_dir(args.shape)
    config = ModelConfig.from_hf_dict(read_hf_config(directory))
    root = Path(tempfile.mkdtemp(prefix="batchllm-adapters-"))
    # Small A and B: the random model's activations stay finite.
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(root / f"a{i}", config, RANK, i, 0.01)))
                for i in range(16)]
    prompts = make_prompts(WORKLOADS["W1"], args.rows, SHAPES[args.shape]["vocab_size"])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    # Prefix caching off: every pass runs the same prompts, and the warm-up would otherwise leave the base engine
    # (and only it: the cache keys K/V by adapter) every prompt's K/V to hit.
    common = dict(model=str(directory), load_format="dummy", skip_tokenizer_init=True,
                  num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engines = {"base": LLM(**common), "lora": LLM(**common, enable_lora=True, max_loras=4, max_lora_rank=RANK)}
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engines["base"].generate(prompts, warm, use_tqdm=False)
    engines["lora"].generate(prompts, warm, use_tqdm=False, lora_request=[adapters[i % 4] for i in range(len(prompts))])
    passes = {"base model": ("base", None), "LoRA engine, no adapter": ("lora", None),
              "1 adapter": ("lora", [adapters[0]] * args.rows),
              "4 adapters": ("lora", [adapters[i % 4] for i in range(args.rows)]),
              "16 adapters, 4 slots": ("lora", [adapters[i % 16] for i in range(args.rows)])}
    results = {name: run_pass(engines[engine], prompts, params, loras) for name, (engine, loras) in passes.items()}
    device_name, device_info = hardware(device)
    base = results["base model"]["total_tok_s"]
    print(f"multi-LoRA, {args.shape} (random weights), rank {RANK} on all 7 projections, W1 {args.rows} rows x "
          f"{args.max_tokens}, {device_name}")
    print(f"{'pass':<26} {'total tok/s':>12} {'out tok/s':>10} {'vs base':>8} {'steps':>6} {'slot loads':>10}")
    for name, r in results.items():
        print(f"{name:<26} {r['total_tok_s']:>12.0f} {r['output_tok_s']:>10.0f} {r['total_tok_s'] / base:>8.2f} "
              f"{r['steps']:>6} {r['slot_loads']:>10}")
    record = {"benchmark": "lora", "date": datetime.date.today().isoformat(), "git": git_sha(),
              "hardware": device_name, "hardware_info": device_info, "shape": args.shape, "rank": RANK,
              "rows": args.rows, "max_tokens": args.max_tokens, "results": results}
    name = f"{record['date']}-lora-W1-r{args.rows}-o{args.max_tokens}-{args.shape}-{device_name}.json"
    print(save_record(name, record, args.out))


if __name__ == "__main__":
    main()
