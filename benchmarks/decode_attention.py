"""Decode attention alone: the paged Triton kernel on decode-only batches, time and K/V bandwidth per launch shape.

    python benchmarks/decode_attention.py                       # GPU: the default cases, default launch shape
    python benchmarks/decode_attention.py --sweep 3 --out $OUT  # also every tile / warps / stages / splits
    python benchmarks/decode_attention.py --sweep 2 --sweep-registers  # the decode tiles under register caps
    python benchmarks/decode_attention.py --cases llama3-8b:fp8:512:192 --mixed 63:128  # a chunked-prefill step
    python benchmarks/decode_attention.py --cases gemma3-12b:bf16:256:8192:1024 gemma3-12b:bf16:256:1024
                                        # a 1,024-token window at 8k context against full attention over 1,024

A case is (model shape, KV dtype, rows, context[, window]): `rows` decode queries, each over `context` keys (W1-like
uniform lengths with `--uniform`), or the last `window` of them (a sliding-window layer), block tables a random
permutation of the pool's blocks, so pages are scattered as in a long run. The floor is the K/V bytes the launch
must read once (rows x min(context, window) x KV heads x head_dim x 2 x bytes per element) over the card's copy
bandwidth, measured in the same call (a device-to-device
copy of 2 GiB, bytes read plus written). Each launch shape's output is checked against the default shape's
(they must agree to float rounding) before it is timed with `triton.testing.do_bench` (median, ms).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch
import triton

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels.attention import TileConfig, paged_attention_triton, tile_config
from batchllm.kernels.reference import FP8_DTYPE

BLOCK_SIZE = 16
# name: (query heads, KV heads, head_dim)
HEADS = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128), "gemma3-12b": (16, 8, 256)}
DEFAULT_CASES = [("smollm2-135m", "bf16", 200, 600), ("llama3-8b", "bf16", 256, 1500), ("llama3-8b", "fp8", 256, 1500),
                 ("llama3-8b", "bf16", 64, 1500), ("llama3-8b", "fp8", 64, 1500), ("llama3-8b", "bf16", 256, 4000),
                 ("llama3-8b", "fp8", 256, 4000)]


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy, counting the read and the write."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def make_case(shape: str, kv: str, rows: int, context: int, uniform: bool, seed: int = 0, window: int | None = None):
    heads, kv_heads, head_dim = HEADS[shape]
    gen = torch.Generator().manual_seed(seed)
    if uniform:
        seq_lens = torch.randint(context // 5, 2 * context - context // 5, (rows,), generator=gen)
    else:
        seq_lens = torch.full((rows,), context)
    blocks_per_seq = math.ceil(int(seq_lens.max()) / BLOCK_SIZE)
    num_blocks = rows * blocks_per_seq + 1
    tables = torch.randperm(num_blocks, generator=gen)[: rows * blocks_per_seq].view(rows, blocks_per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16)
    if kv == "fp8":
        k_cache, v_cache = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    query = torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
        seq_lens=seq_lens.to(torch.int32).cuda(), block_tables=tables.to(torch.int32).cuda(), max_query_len=1,
        max_seq_len=int(seq_lens.max()), query_start_loc_cpu=list(range(rows + 1)), seq_lens_cpu=seq_lens.tolist())
    seen = seq_lens if window is None else seq_lens.clamp(max=window)
    kv_bytes = int(seen.sum()) * kv_heads * head_dim * 2 * k_cache.element_size()
    return query, k_cache, v_cache, metadata, kv_bytes


def run_mixed(case, prefills: int, prompt_len: int, uniform: bool) -> dict:
    """The case's decode rows in one launch with `prefills` fresh prompts of `prompt_len` tokens after them (a chunked
    prefill step's batch, whose decode rows take the prefill tile), against the two parts launched alone."""
    shape, kv, rows, context, _ = case
    heads, kv_heads, head_dim = HEADS[shape]
    gen = torch.Generator().manual_seed(1)
    decode_lens = (torch.randint(context // 5, 2 * context - context // 5, (rows,), generator=gen) if uniform
                   else torch.full((rows,), context))
    seq_lens = torch.cat([decode_lens, torch.full((prefills,), prompt_len)])
    query_lens = torch.cat([torch.ones(rows, dtype=torch.long), torch.full((prefills,), prompt_len)])
    blocks_per_seq = math.ceil(int(seq_lens.max()) / BLOCK_SIZE)
    num_seqs = rows + prefills
    tables = torch.randperm(num_seqs * blocks_per_seq, generator=gen).view(num_seqs, blocks_per_seq)
    cache_shape = (num_seqs * blocks_per_seq, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16)
    if kv == "fp8":
        k_cache, v_cache = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)])
    query = torch.randn(int(starts[-1]), heads, head_dim, device="cuda", dtype=torch.bfloat16)

    def metadata(first: int, last: int, num_decodes: int = 0) -> AttentionMetadata:
        qsl = starts[first : last + 1] - starts[first]
        return AttentionMetadata(num_decodes=num_decodes,
            slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device="cuda"),
            query_start_loc=qsl.to(torch.int32).cuda(), seq_lens=seq_lens[first:last].to(torch.int32).cuda(),
            block_tables=tables[first:last].to(torch.int32).cuda(), max_query_len=int(query_lens[first:last].max()),
            max_seq_len=int(seq_lens[first:last].max()), query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens[first:last].tolist())

    scale = head_dim**-0.5
    times = {}
    # "mixed": one launch, the decode rows in the prefill tile; "engine": as the engine launches a chunked-prefill
    # step, its leading decode rows apart (`AttentionMetadata.num_decodes`).
    for name, first, last, decodes in (("mixed", 0, num_seqs, 0), ("engine", 0, num_seqs, rows),
                                       ("decode", 0, rows, 0), ("prefill", rows, num_seqs, 0)):
        part, meta = query[int(starts[first]) : int(starts[last])], metadata(first, last, decodes)
        times[name] = triton.testing.do_bench(
            lambda part=part, meta=meta: paged_attention_triton(part, k_cache, v_cache, meta, scale),
            warmup=25, rep=100, return_mode="median") * 1e3
    print(f"{case} + {prefills} prompts x {prompt_len}: one launch {times['mixed']:.0f} us, as the engine launches "
          f"{times['engine']:.0f} us; decode rows alone {times['decode']:.0f} + prompts alone {times['prefill']:.0f} = "
          f"{times['decode'] + times['prefill']:.0f} us")
    return dict(shape=shape, kv=kv, rows=rows, context=context, prefills=prefills, prompt_len=prompt_len,
                mixed_us=times["mixed"], engine_us=times["engine"], decode_us=times["decode"],
                prefill_us=times["prefill"])


def launch_shapes(group_p2: int, register_caps: bool = False):
    """None (the library's choice) first, then the sweep: tile rows stay at the decode minimum. `register_caps`: the
    decode tiles under register caps (TileConfig.max_registers), which trade spills for programs an SM."""
    yield None, None
    if register_caps:
        for tile_n, warps, stages, cap in itertools.product((32, 64, 128), (2, 4, 8), (2, 3), (None, 128, 96, 64)):
            yield TileConfig(max(16, group_p2), tile_n, warps, stages, cap), None
        return
    for tile_n, warps, stages, splits in itertools.product((32, 64, 128, 256), (2, 4, 8), (2, 3, 4), (None, 2)):
        yield TileConfig(max(16, group_p2), tile_n, warps, stages), splits


def run_case(case, sweep: bool, uniform: bool, bandwidth: float, register_caps: bool = False) -> list[dict]:
    shape, kv, rows, context, window = case
    query, k_cache, v_cache, metadata, kv_bytes = make_case(shape, kv, rows, context, uniform, window=window)
    group_p2 = triton.next_power_of_2(query.shape[1] // k_cache.shape[2])
    scale = query.shape[-1] ** -0.5
    default_tile = tile_config(1, group_p2, query.shape[-1], query.dtype, k_cache.dtype == FP8_DTYPE)
    reference = None
    results = []
    shapes = launch_shapes(group_p2, register_caps) if sweep else iter([(None, None)])
    for tile, splits in shapes:
        def call():
            return paged_attention_triton(query, k_cache, v_cache, metadata, scale, num_splits=splits, tile=tile,
                                          sliding_window=window)
        try:
            out = call()
            torch.cuda.synchronize()
        except Exception as exc:  # a shape that does not compile (out of shared memory / registers)
            results.append(dict(tile=str(tile), splits=splits, error=type(exc).__name__))
            continue
        if reference is None:
            reference = out.float()
        err = ((out.float() - reference).norm() / reference.norm()).item()
        ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
        results.append(dict(shape=shape, kv=kv, rows=rows, context=context, window=window,
                            tile=str(tile or default_tile),
                            splits=splits, ms=ms, kv_bytes=kv_bytes, tb_s=kv_bytes / (ms * 1e-3) / 1e12,
                            floor_share=(kv_bytes / bandwidth) / (ms * 1e-3), rel_err=err))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=int, default=0, metavar="N",
                        help="also time every launch shape on the first N cases")
    parser.add_argument("--sweep-registers", action="store_true",
                        help="the sweep times the decode tiles under register caps (TileConfig.max_registers) instead")
    parser.add_argument("--uniform", action="store_true", help="context lengths uniform in [0.2, 1.8] x context")
    parser.add_argument("--cases", nargs="*",
                        help="shape:kv:rows:context[:window], e.g. llama3-8b:fp8:256:1500 gemma3-12b:bf16:64:8192:1024")
    parser.add_argument("--mixed", metavar="P:L",
                        help="also time each case's decode rows with P fresh prompts of L tokens in one launch")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = [tuple(c.split(":")) for c in args.cases] if args.cases else DEFAULT_CASES
    cases = [(s, kv, int(r), int(c), int(w[0]) if w else None) for s, kv, r, c, *w in cases]
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    rows_out = []
    for case in cases:
        start = time.perf_counter()
        results = run_case(case, cases.index(case) < args.sweep, args.uniform, bandwidth, args.sweep_registers)
        rows_out += results
        timed = [r for r in results if "ms" in r]
        best = min(timed, key=lambda r: r["ms"])
        default = timed[0]
        print(f"{case}: default {default['tile']} {default['ms'] * 1e3:.0f} us ({default['tb_s']:.2f} TB/s, "
              f"{default['floor_share']:.0%} of floor); best {best['tile']} splits={best['splits']} "
              f"{best['ms'] * 1e3:.0f} us ({best['tb_s']:.2f} TB/s); max rel err {max(r['rel_err'] for r in timed):.1e}"
              f"; {time.perf_counter() - start:.0f} s")
        if args.sweep_registers and len(timed) > 1:
            for cap in (None, 128, 96, 64):
                mine = min((r for r in timed[1:] if f"max_registers={cap})" in r["tile"]), key=lambda r: r["ms"],
                           default=None)
                if mine is None:  # none compiled
                    continue
                print(f"  best with max_registers={cap}: {mine['tile']} {mine['ms'] * 1e3:.0f} us "
                      f"({mine['floor_share']:.0%} of floor)")
    if args.mixed:
        prefills, prompt_len = (int(v) for v in args.mixed.split(":"))
        rows_out += [run_mixed(case, prefills, prompt_len, args.uniform) for case in cases]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"{time.strftime('%Y-%m-%d')}-decode-attention-{device.split()[1].lower()}.json"
        (args.out / name).write_text(json.dumps(dict(device=device, copy_bandwidth=bandwidth, results=rows_out),
                                                indent=1))


if __name__ == "__main__":
    main()
