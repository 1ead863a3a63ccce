"""KV transfer between two processes through the disaggregated engines' shared buffer (executor/kv_transfer.py).

    python benchmarks/kv_link.py --shape llama3-8b --blocks 2048      # one GPU: both processes on it

A sender process copies `--blocks` scattered blocks of a random KV cache into the shared buffer (device -> pinned
shared memory), a receiver copies them into scattered blocks of its own cache (shared memory -> device) and checks
every byte. Each side times its copies with CUDA events (on the CPU, a wall clock): GB/s are the blocks' bytes over
that time. Prints a table and writes benchmarks/results/<date>-kv-link-<shape>-<hardware>.json.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import random
import time
from pathlib import Path

import torch

from batchllm.distributed.shm_queue import create_shared_file
from batchllm.engine.interfaces import BlockTransfers
from batchllm.executor.kv_transfer import HostKVPool

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (30, 3, 64)}  # layers, KV heads, head dim
BLOCK = 16


def _cache(shape: str, num_blocks: int, device: torch.device, seed: int) -> torch.Tensor:
    layers, heads, dim = SHAPES[shape]
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(2, layers, num_blocks, BLOCK, heads, dim, dtype=torch.bfloat16, device=device,
                       generator=generator)


def _timed(pool: HostKVPool, transfers: BlockTransfers, device: torch.device, repeats: int) -> float:
    pool.run(transfers)  # warm-up: allocator, staging
    pool.synchronize()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(pool._stream)
        pool.run(transfers)
        if device.type == "cuda":
            end.record(pool._stream)
            end.synchronize()
            seconds.append(begin.elapsed_time(end) / 1000)
        else:
            seconds.append(time.perf_counter() - start)
    return sorted(seconds)[len(seconds) // 2]


def _side(role: str, args: argparse.Namespace, buffer: Path, pairs: list[tuple[int, int]], queue) -> None:
    device = torch.device(args.device)
    cache = _cache(args.shape, args.cache_blocks, device, seed=0 if role == "send" else 1)
    pool = HostKVPool([cache], args.blocks, device, backing=buffer)
    if role == "send":
        seconds = _timed(pool, BlockTransfers(pairs, []), device, args.repeats)
        queue.put(("send", seconds, pool.bytes_per_block * len(pairs), _block_sums(cache, [d for d, _ in pairs])))
    else:
        loads = [(slot, device_block) for device_block, slot in pairs]
        seconds = _timed(pool, BlockTransfers([], loads), device, args.repeats)
        queue.put(("receive", seconds, pool.bytes_per_block * len(pairs), _block_sums(cache, [d for _, d in loads])))


def _block_sums(cache: torch.Tensor, blocks: list[int]) -> list[int]:
    """Each block's bytes summed, in the order given: the sender's and receiver's must match pair by pair."""
    data = cache.view(torch.uint8)
    return [int(data[:, :, block].sum(dtype=torch.int64)) for block in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=2048, help="blocks moved (2 MiB each for llama3-8b)")
    parser.add_argument("--cache-blocks", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also copy the record here (the device tool's $OUT)")
    args = parser.parse_args()
    layers, heads, dim = SHAPES[args.shape]
    buffer = Path(create_shared_file(args.blocks * 2 * layers * BLOCK * heads * dim * 2))
    rng = random.Random(0)
    pairs = list(zip(rng.sample(range(args.cache_blocks), args.blocks), rng.sample(range(args.blocks), args.blocks)))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    results = {}
    try:
        for role in ("send", "receive"):  # in turn: the receiver reads what the sender wrote
            process = context.Process(target=_side, args=(role, args, buffer, pairs, queue))
            process.start()
            name, seconds, num_bytes, checksum = queue.get(timeout=600)
            process.join()
            results[name] = {"seconds": seconds, "bytes": num_bytes, "gb_per_s": round(num_bytes / seconds / 1e9, 2),
                             "checksum": checksum}
    finally:
        buffer.unlink()
    same = results["send"]["checksum"] == results["receive"]["checksum"]
    print(f"{'direction':26} {'MiB':>8} {'ms':>8} {'GB/s':>7}")
    for name, label in (("send", "device -> shared (sender)"), ("receive", "shared -> device (receiver)")):
        r = results[name]
        print(f"{label:26} {r['bytes'] / 2**20:>8.0f} {r['seconds'] * 1e3:>8.2f} {r['gb_per_s']:>7.2f}")
    print(f"receiver's blocks equal the sender's: {same}")
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import git_sha, hardware, save_record

    machine, details = hardware(args.device)
    name = f"{datetime.date.today()}-kv-link-{args.shape}-{machine}.json"
    path = save_record(name, {"shape": args.shape, "blocks": args.blocks, "hardware": details, "git_sha": git_sha(),
                              "results": results, "same": same}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
