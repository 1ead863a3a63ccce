"""Embedding a corpus: batchllm (`LLM(task="embed")`) against a length-sorted, padded transformers `AutoModel`
loop, in one process on the same documents.

    python benchmarks/embeddings.py                              # CPU: the real default model, scaled down
    python benchmarks/embeddings.py --model DIR --device cuda    # a GPU: 10,000 documents of 50-2,000 tokens
    python benchmarks/embeddings.py --shape llama3-8b            # the same, random bf16 weights of a WORKLOADS shape

Both systems load the same checkpoint (`--model`, a local HF directory; default: the default model; `--shape`
writes one with random weights first, on the GPU, so nothing large travels to the GPU machine). Documents
are random token ids (seed 6) of uniform length in [--min-len, --max-len]; both systems mean-pool the
final hidden states. The peer sorts the documents by length and runs batches of `--hf-batch-tokens` padded tokens
(at most `--hf-batch-size` rows) through `AutoModel` with an attention mask, SDPA attention, masked mean pooling.
Reports rows/s and tokens/s (real tokens, not padding) of each, and the largest difference between the two
systems' vectors. One JSON record lands in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import time
from pathlib import Path

import numpy as np
import torch
from shapes import SHAPES, write_random_checkpoint
from throughput import git_sha, hardware, save_record

from batchllm import LLM


def documents(count: int, low: int, high: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(6)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(low, high))] for _ in range(count)]


def run_batchllm(args, model: str, docs: list[list[int]], budget: int | None) -> tuple[dict, np.ndarray]:
    start = time.perf_counter()
    llm = LLM(model, device=args.device, task="embed", pooling="mean", normalize=False,
              skip_tokenizer_init=args.shape is not None, max_num_batched_tokens=budget)
    load_s = time.perf_counter() - start
    llm.embed_matrix(docs[:8])  # warm-up
    start = time.perf_counter()
    matrix, errors = llm.embed_matrix(docs)
    seconds = time.perf_counter() - start
    assert not any(errors), errors[:3]
    budget = llm.engine.scheduler.config.max_num_batched_tokens
    result = {"system": f"batchllm (budget {budget} tokens)", "load_s": round(load_s, 2), "seconds": round(seconds, 3),
              "stats_steps": llm.stats.num_steps}
    del llm
    gc.collect()
    return result, matrix


def run_hf(args, model: str, docs: list[list[int]]) -> tuple[dict, np.ndarray]:
    from transformers import AutoModel

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    start = time.perf_counter()
    hf = AutoModel.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
    load_s = time.perf_counter() - start
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
    out = np.zeros((len(docs), hf.config.hidden_size), np.float32)
    start = time.perf_counter()
    position = 0
    with torch.inference_mode():
        while position < len(order):
            width = len(docs[order[position]])
            batch = [order[position]]
            while (position + len(batch) < len(order) and len(batch) < args.hf_batch_size
                   and len(docs[order[position + len(batch)]]) * (len(batch) + 1) <= args.hf_batch_tokens):
                batch.append(order[position + len(batch)])
            width = max(len(docs[i]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, index in enumerate(batch):
                ids[row, : len(docs[index])] = torch.tensor(docs[index])
                mask[row, : len(docs[index])] = 1
            ids, mask = ids.to(args.device), mask.to(args.device)
            hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            out[batch] = pooled.cpu().numpy()
            position += len(batch)
    if args.device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del hf
    gc.collect()
    return {"system": "transformers AutoModel (length-sorted, padded)", "load_s": round(load_s, 2),
            "seconds": round(seconds, 3)}, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF checkpoint directory (default: the default model)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="random bf16 weights of this shape (no tokenizer)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[None],
                        help="batchllm's token budget per step (default: LLM's); several: one batchllm run each")
    parser.add_argument("--docs", type=int, help="documents (default: 10,000; CPU 64)")
    parser.add_argument("--min-len", type=int, default=50)
    parser.add_argument("--max-len", type=int, help="(default: 2,000; CPU 400)")
    parser.add_argument("--hf-batch-tokens", type=int, default=16384, help="the peer's padded tokens per batch")
    parser.add_argument("--hf-batch-size", type=int, default=256, help="the peer's rows per batch, at most")
    parser.add_argument("--out", help="also copy the record here (the device tool's $OUT)")
    args = parser.parse_args()
    gpu = args.device != "cpu"
    args.docs = args.docs or (10_000 if gpu else 64)
    args.max_len = args.max_len or (2000 if gpu else 400)
    from batchllm.model.config import ModelConfig
    from batchllm.model.loader import resolve_model_path

    if args.shape:
        model = str(write_random_checkpoint(args.shape, device=args.device))
    else:
        model = str(resolve_model_path(args.model))
    docs = documents(args.docs, args.min_len, args.max_len, ModelConfig.from_dir(model).vocab_size)
    runs = [run_batchllm(args, model, docs, budget) for budget in args.max_num_batched_tokens]
    theirs, their_vectors = run_hf(args, model, docs)
    tokens = sum(map(len, docs))
    results = [result for result, _ in runs] + [theirs]
    for result in results:
        result.update(rows_per_s=round(len(docs) / result["seconds"], 1), tok_per_s=round(tokens / result["seconds"]))
    difference = max(float(np.abs(vectors - their_vectors).max()) for _, vectors in runs)
    print(f"{args.docs} documents of {args.min_len}-{args.max_len} tokens ({tokens} tokens), {args.device}")
    print(f"{'system':48} {'s':>8} {'rows/s':>8} {'tok/s':>9} {'x':>6}")
    for result in results:
        print(f"{result['system']:48} {result['seconds']:>8.2f} {result['rows_per_s']:>8.1f} {result['tok_per_s']:>9} "
              f"{theirs['seconds'] / result['seconds']:>5.2f}x")
    print(f"largest difference between the two systems' vectors: {difference:.2e}")
    machine, details = hardware(args.device)
    name = f"{datetime.date.today()}-embeddings-{Path(model).name}-d{args.docs}-{machine}.json"
    path = save_record(name, {"model": args.shape or Path(model).name, "random_weights": args.shape is not None,
                              "hf_batch_tokens": args.hf_batch_tokens, "hf_batch_size": args.hf_batch_size,
                              "docs": args.docs, "min_len": args.min_len, "max_len": args.max_len, "tokens": tokens,
                              "hardware": details, "git_sha": git_sha(), "results": results,
                              "max_abs_difference": difference}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
