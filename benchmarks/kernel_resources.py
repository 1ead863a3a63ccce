"""What a launch shape of the paged attention kernel costs an SM, without a GPU: registers, spills, shared memory.

    python benchmarks/kernel_resources.py                      # llama3-8b's decode and prefill tiles, FP8 and bf16
    python benchmarks/kernel_resources.py --caps 128 96 64     # also under register caps (TileConfig.max_registers)

Compiles `paged_attention_kernel` ahead of time for sm_90 (Triton's own compiler and the `ptxas` it ships; no device
needed), with the pointer and stride arguments marked divisible by 16 as a real launch specializes them (without
that hint the K/V tiles load byte by byte and the figures mean nothing), and reads the cubin's resource usage with
the bundled `cuobjdump`. Programs an SM = the fewest that registers (64K a SM), shared memory (228 KB) and warps (64)
allow. Static figures only: whether more programs an SM pay off is `decode_attention.py --sweep-registers`'s to say
on the card. The Triton version here may differ from the GPU machine's.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from batchllm.kernels.attention_kernels import paged_attention_kernel

SM90 = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM, SHARED_PER_SM, WARPS_PER_SM = 65536, 233472, 64
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
INT32_POINTERS = ("query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "key_limit_ptr")
FLOAT32 = ("qk_scale", "v_scale", "soft_cap", "sinks_ptr", "acc_ptr", "max_ptr", "sum_ptr")


def argument_types(kv_fp8: bool) -> dict[str, str]:
    types = {}
    for name in inspect.signature(paged_attention_kernel.fn).parameters:
        pointer = name.endswith("_ptr")
        if name in ("k_cache_ptr", "v_cache_ptr"):
            types[name] = "*fp8e4nv" if kv_fp8 else "*bf16"
        elif name in INT32_POINTERS:
            types[name] = "*i32"
        elif name in FLOAT32:
            types[name] = "*fp32" if pointer else "fp32"
        else:
            types[name] = "*bf16" if pointer else "i32"
    return types


def resources(constants: dict, kv_fp8: bool, warps: int, stages: int, max_registers: int | None) -> dict:
    params = list(inspect.signature(paged_attention_kernel.fn).parameters)
    types = argument_types(kv_fp8)
    signature = {p: "constexpr" if p in constants else types[p] for p in params}
    # What a launch's specialization knows of the arguments that are multiples of 16.
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
               if p not in constants and (types[p].startswith("*") or p.startswith("stride"))}
    source = ASTSource(paged_attention_kernel, signature, {(params.index(k),): v for k, v in constants.items()},
                       attrs=aligned)
    options = dict(num_warps=warps, num_stages=stages)
    if max_registers is not None:
        options["maxnreg"] = max_registers
    kernel = triton.compile(source, target=SM90, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = kernel.metadata.shared
    programs = min(REGISTERS_PER_SM // (registers * 32 * warps), SHARED_PER_SM // max(shared, 1),
                   WARPS_PER_SM // warps)
    return dict(registers=registers, spill_bytes=stack, shared=shared, programs_per_sm=programs,
                warps_per_sm=programs * warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", type=int, nargs="*", default=[], help="register caps to compile under as well")
    parser.add_argument("--group", type=int, default=4, help="query heads a KV head (llama3-8b: 4)")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    group_p2 = triton.next_power_of_2(args.group)
    print(f"{'kv':5} {'tile':>12} {'cap':>5} {'regs':>5} {'spill B':>8} {'smem KB':>8} {'programs/SM':>12} "
          f"{'warps/SM':>9}")
    # The decode tiles, then the prefill tile (tile_config's for batches with prefill tokens), on the general grid.
    tiles = ((16, 128, 4, 3), (16, 64, 4, 3), (16, 32, 4, 3), (16, 32, 2, 3), (max(64, group_p2), 32, 8, 3))
    for kv_fp8, (block_m, tile_n, warps, stages), cap in itertools.product((True, False), tiles, (None, *args.caps)):
        decode = block_m // group_p2 * group_p2 <= 16
        constants = dict(
            BLOCK_SIZE=16, GROUP=args.group, GROUP_P2=group_p2, BLOCK_Q=block_m // group_p2, HEAD_DIM=args.head_dim,
            HEAD_DIM_P2=triton.next_power_of_2(args.head_dim), TILE_N=tile_n, NUM_SPLITS=1, DOT_PRECISION="tf32",
            KV_FP8=kv_fp8, KV_DOT_DTYPE=tl.float16, USE_WINDOW=False, USE_SOFT_CAP=False, USE_SINKS=False,
            HAS_KEY_LIMIT=False, DECODE=decode, NUM_KV_HEADS=8)
        r = resources(constants, kv_fp8, warps, stages, cap)
        print(f"{'fp8' if kv_fp8 else 'bf16':5} {f'{block_m}r{tile_n}x{warps}w{stages}s':>12} {cap or '-':>5} "
              f"{r['registers']:5d} {r['spill_bytes']:8d} {r['shared'] / 1024:8.1f} {r['programs_per_sm']:12d} "
              f"{r['warps_per_sm']:9d}")


if __name__ == "__main__":
    main()
