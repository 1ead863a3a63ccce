"""FP8 weights, 4-bit weights and FP8 KV cache against bf16 on the GPU: throughput in one run, and logprob quality.

    python benchmarks/quantized.py --shape llama3-8b --workload W5 --max-num-seqs 512
    python benchmarks/quantized.py --shape llama3-8b --quality     # |Δ logprob| vs an fp32 HF reference

Throughput: the same random weights (the loader's seeded dummy values; the FP8 engines quantize exactly those
values per channel) and the same prompts, one engine after another in one process, each built alike
(`gpu_throughput.run_batchllm`: CUDA graphs, async loop, warm-up on the workload's first rows, every row
writing exactly `max_tokens` tokens). Configurations: `bf16`, `fp8` (FP8 weights, bf16 KV), `fp8-kv` (FP8
weights and FP8 KV cache), `kv` (FP8 KV cache only), `w4` (4-bit GPTQ-layout weights, symmetric, groups of
128: the same values rounded to nearest, through the Triton W4A16 GEMM), `w4-kv` (and FP8 KV cache). Reported:
output and total tok/s, the ratio to bf16, the KV pool and its peak use,
preemptions. `--profile` adds, per configuration, the top CUDA kernels of a short eager run
(`--profile-rows` rows x 16 tokens after a prefill), the breakdown asked for when a target is missed.

Quality (`--quality`): a shape with the model's widths but `--quality-layers` layers (random weights in a
deep stack drown any signal), teacher-forced over `--quality-rows` random prompts of 256 tokens: the
log-probability of every next token from our bf16, fp8 and fp8-kv models and from HF transformers in fp32 on
the same weights (our dummy weights copied into HF's unfused layout). Reported: mean and max |Δ logprob| of
each against fp32 HF, over all tokens and the whole vocabulary's top-1.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging

import torch
from gpu_throughput import run_batchllm
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record, size_or_auto

CONFIGS = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8-kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
           "kv": {"kv_cache_dtype": "fp8"}, "w4": {"quantization": "gptq"},
           "w4-kv": {"quantization": "gptq", "kv_cache_dtype": "fp8"}}


def throughput(args) -> dict:
    workload = WORKLOADS[args.workload]
    rows = args.rows or workload.rows
    max_tokens = args.max_tokens or workload.output_tokens
    prompts = make_prompts(workload, rows, SHAPES[args.shape]["vocab_size"])
    directory = make_shape_dir(args.shape)
    prompt_tokens = sum(map(len, prompts))
    systems = {}
    for name, policy in itertools.product(args.configs, args.admission_policies):
        figures = run_batchllm(directory, prompts, max_tokens, args, admission_policy=policy, **CONFIGS[name])
        if len(args.admission_policies) > 1:
            name = f"{name}-{policy}"
        figures.pop("token_ids", None)
        figures["output_tok_s"] = round(figures["output_tokens"] / figures["generate_s"], 1)
        figures["total_tok_s"] = round((prompt_tokens + figures["output_tokens"]) / figures["generate_s"], 1)
        if args.profile:
            figures["kernels"] = profile_kernels(directory, prompts[: args.profile_rows], args, CONFIGS[name])
        systems[name] = figures
        print(f"{name:8} load {figures['load_s']:6.1f} s  gen {figures['generate_s']:7.2f} s  "
              f"out {figures['output_tok_s']:9.1f} tok/s  total {figures['total_tok_s']:9.1f} tok/s  "
              f"KV {figures['peak_kv_blocks']}/{figures['num_kv_blocks']}  preempt {figures['preemptions']}  "
              f"recomputed {figures['recomputed_tokens']}  steps {figures['steps']}  seqs {figures['max_num_seqs']}  "
              f"step tokens {figures['max_num_batched_tokens']}", flush=True)
    base = systems.get("bf16")
    if base:
        for name, figures in systems.items():
            figures["output_vs_bf16"] = round(figures["output_tok_s"] / base["output_tok_s"], 3)
            figures["total_vs_bf16"] = round(figures["total_tok_s"] / base["total_tok_s"], 3)
            print(f"{name:8} vs bf16: output {figures['output_vs_bf16']:.2f}x, total {figures['total_vs_bf16']:.2f}x")
    return {"workload": {"name": args.workload, "rows": rows, "output_tokens": max_tokens,
                         "prompt_tokens": prompt_tokens, "max_num_seqs": args.max_num_seqs}, "systems": systems}


def profile_kernels(directory, prompts, args, options: dict) -> list[dict]:
    """The top CUDA kernels by total time over an eager run (graphs hide their kernels from the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from batchllm import LLM, SamplingParams

    llm = LLM(model=str(directory), load_format="dummy", skip_tokenizer_init=True, max_num_seqs=len(prompts),
              enforce_eager=True, **options)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) or 1
    top = [{"kernel": e.key[:90], "ms": round(e.self_device_time_total / 1e3, 2), "calls": e.count,
            "share": round(e.self_device_time_total / total, 3)} for e in events[:12]]
    for row in top:
        print(f"    {row['ms']:9.2f} ms {row['share']:6.1%} {row['calls']:6d}  {row['kernel']}")
    del llm
    torch.cuda.empty_cache()
    return top


def quality(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from batchllm.model.loader import load_model
    from tests.unit.test_model_vs_hf import PagedRunner

    directory = make_shape_dir(args.shape)
    config_path = directory / "config.json"
    hf_dict = json.loads(config_path.read_text())
    small = directory.parent / f"{directory.name}-{args.quality_layers}layers"
    small.mkdir(exist_ok=True)
    (small / "config.json").write_text(json.dumps({**hf_dict, "num_hidden_layers": args.quality_layers}))
    vocab = hf_dict["vocab_size"]
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, vocab - 100, (256,), generator=generator).tolist() for _ in range(args.quality_rows)]

    def our_logprobs(quantization, kv_dtype):
        model, config = load_model(small, "cuda", torch.bfloat16, load_format="dummy", quantization=quantization)
        out = []
        for i, ids in enumerate(prompts):
            with torch.device("cuda"):
                runner = PagedRunner(model, config, num_blocks=24, block_size=16, kv_dtype=kv_dtype)
                logits = runner.step([(i, ids, 0)])[0]
            out.append(logits.float().log_softmax(-1))
        return model, out

    bf16_model, bf16 = our_logprobs(None, None)
    hf = LlamaForCausalLM(LlamaConfig(**{**hf_dict, "num_hidden_layers": args.quality_layers})).float().cuda().eval()
    state = unfused_state_dict(bf16_model, hf_dict)
    hf.load_state_dict({name: state[name] for name in hf.state_dict()})  # a KeyError if one is missing
    del bf16_model
    with torch.no_grad():
        reference = [hf(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1) for ids in prompts]
    del hf
    results = {"bf16": bf16}
    _, results["fp8"] = our_logprobs("fp8", None)
    _, results["fp8-kv"] = our_logprobs("fp8", torch.float8_e4m3fn)
    _, results["w4"] = our_logprobs("gptq", None)
    figures = {}
    for name, logprobs in results.items():
        delta = torch.cat([(ours - ref).abs() for ours, ref in zip(logprobs, reference, strict=True)])
        top1 = torch.cat([ours.argmax(-1) == ref.argmax(-1) for ours, ref in zip(logprobs, reference, strict=True)])
        # |Δ logprob| of the reference's most likely token, and over the whole vocabulary.
        ref_top = torch.cat([ref.argmax(-1) for ref in reference])
        at_top = delta.gather(1, ref_top[:, None])
        figures[name] = {"mean_abs_dlogprob_top": round(at_top.mean().item(), 5),
                         "max_abs_dlogprob_top": round(at_top.max().item(), 4),
                         "mean_abs_dlogprob_vocab": round(delta.mean().item(), 5),
                         "max_abs_dlogprob_vocab": round(delta.max().item(), 4),
                         "top1_agreement": round(top1.float().mean().item(), 4)}
        print(f"{name:8} vs fp32 HF: {figures[name]}")
    return {"quality": figures, "quality_layers": args.quality_layers, "quality_tokens": 256 * len(prompts)}


def unfused_state_dict(model, hf_dict: dict) -> dict:
    """Our (bf16, unquantized) parameters under HF's names: q/k/v and gate/up split again, in float32."""
    heads, kv_heads = hf_dict["num_attention_heads"], hf_dict["num_key_value_heads"]
    head_dim = hf_dict.get("head_dim") or hf_dict["hidden_size"] // heads
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.float()
        if "qkv_proj" in name:
            q, k, v = tensor.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            for part, value in zip("qkv", (q, k, v), strict=True):
                state[name.replace("qkv_proj", f"{part}_proj")] = value
        elif "gate_up_proj" in name:
            gate, up = tensor.chunk(2)
            state[name.replace("gate_up_proj", "gate_proj")], state[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            state[name] = tensor
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def main() -> None:
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("batchllm.engine.build").setLevel(logging.INFO)  # the calibrated step sizes and their times
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W5")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["bf16", "fp8", "fp8-kv"])
    parser.add_argument("--max-num-seqs", type=size_or_auto, default=256, help="a number, or auto: the engine's")
    parser.add_argument("--max-num-batched-tokens", type=size_or_auto, default=8192,
                        help="a number, or auto: the engine's")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--admission-policies", nargs="+", choices=["kv_aware", "optimistic"], default=["kv_aware"],
                        help="each configuration under each admission policy (engine/admission.py)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=256)
    parser.add_argument("--quality", action="store_true", help="measure |Δ logprob| instead of throughput")
    parser.add_argument("--quality-layers", type=int, default=4)
    parser.add_argument("--quality-rows", type=int, default=8)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=None, help="also copy the JSON record here")
    parser.set_defaults(also_sync=False)  # gpu_throughput.run_batchllm's own option
    args = parser.parse_args()
    figures = quality(args) if args.quality else throughput(args)
    card, hw = hardware("cuda")
    record = {"date": datetime.date.today().isoformat(), "git_sha": git_sha(), "shape": args.shape,
              "hardware": hw, **figures}
    kind = "quality" if args.quality else f"{args.workload}-seqs{args.max_num_seqs or 'auto'}"
    save_record(f"{record['date']}-quant-{kind}-{args.shape}-{card}{args.tag}.json", record, args.out)


if __name__ == "__main__":
    main()
