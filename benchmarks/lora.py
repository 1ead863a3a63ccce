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
from batchllm.model.lora_adapter import write_random_adapter

RANK = 16


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-kv-blocks", type=int, default=12000, help="each engine's KV pool (two share a GPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
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
