"""GPU end-to-end check: batchllm (bf16, Triton kernels, CUDA graphs) against HF transformers (fp32) on the
same random weights, for a mixed batch with chunked prefills, decode rows and preempted-then-recomputed rows.

    python benchmarks/gpu_correctness.py --shape smollm2-135m --shape llama3-8b

batchllm generates greedily with logprobs; HF then scores each finished sequence in one teacher-forced fp32
forward pass. Reported per shape: max / mean |logprob difference| of the chosen tokens, and the share of
positions where HF's argmax equals batchllm's token (random weights make near-ties common, so this is a
statistic, not a pass/fail).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from shapes import make_shape_dir, shape_config
from transformers import AutoModelForCausalLM, LlamaConfig

from batchllm import LLM, SamplingParams


def hf_state_dict(llm: LLM) -> dict[str, torch.Tensor]:
    """Our fused parameters → HF's separate q/k/v and gate/up tensors, as float32."""
    config = llm.runner.model_config
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    out = {}
    for name, param in llm.runner.model.named_parameters():
        tensor = param.detach().float()
        if "qkv_proj" in name:
            q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
            for part, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", part)] = value
        elif "gate_up_proj" in name:
            gate, up = tensor.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = tensor
    return out


def check(shape: str, rows: int, seed: int, device: str) -> dict:
    directory = make_shape_dir(shape)
    rng = random.Random(seed)
    vocab = shape_config(shape)["vocab_size"]
    lengths = [1, 7, 33, 150, 400, 900, 17, 64, 250, 600, 3, 1200][:rows]
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in lengths]
    max_tokens = 12
    # A 256-token budget chunks every long prompt; a pool just above the longest request forces preemption.
    longest = max(lengths) + max_tokens
    start = time.perf_counter()
    llm = LLM(model=str(directory), device=device, load_format="dummy", skip_tokenizer_init=True,
              max_num_batched_tokens=256, num_kv_blocks=-(-longest // 16) + 24, enable_prefix_caching=False)
    ready_s = time.perf_counter() - start
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    stats = llm.stats
    state = hf_state_dict(llm)
    del llm
    _empty_cache(device)

    config = LlamaConfig(**{k: v for k, v in shape_config(shape).items() if k not in ("architectures",)})
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if config.tie_word_embeddings:
        hf.tie_weights()
    hf.eval()
    diffs, agree, total = [], 0, 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            tokens = out.outputs[0].token_ids
            ids = torch.tensor([prompt + tokens], device=device)
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits, dim=-1)
            for step, token in enumerate(tokens):
                ours = out.outputs[0].logprobs[step][token].logprob
                diffs.append(abs(ours - ref[step, token].item()))
                agree += int(ref[step].argmax().item() == token)
                total += 1
    del hf
    _empty_cache(device)
    return {"shape": shape, "rows": len(prompts), "engine_ready_s": round(ready_s, 2),
            "max_abs_logprob_diff": round(max(diffs), 4), "mean_abs_logprob_diff": round(sum(diffs) / len(diffs), 5),
            "greedy_agreement": round(agree / total, 4), "positions": total,
            "preemptions": stats.num_preemptions, "chunked_prefills": stats.num_chunked_prefills}


def _empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=None)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = [check(shape, args.rows, seed=0, device=args.device) for shape in args.shape or ["smollm2-135m"]]
    print(f"{'shape':14} {'max|dlp|':>9} {'mean|dlp|':>9} {'greedy agree':>12} {'preempt':>7} {'chunks':>6}")
    for r in results:
        print(f"{r['shape']:14} {r['max_abs_logprob_diff']:>9} {r['mean_abs_logprob_diff']:>9} "
              f"{r['greedy_agreement']:>12} {r['preemptions']:>7} {r['chunked_prefills']:>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
