"""Prefix-cache hit rates of W2-large through the real scheduler and KV-cache manager, without a model.

    python benchmarks/kv_tier_hit_rates.py                  # the H200 llama3-8b configurations of kv_tiers.py
    python benchmarks/kv_tier_hit_rates.py --rows 2000 --prefixes 80 --host-blocks 6553

Which blocks the tiers keep is decided by the engine alone (it imports no torch): a stand-in runner that samples
a fixed token gives the same hit rates, prefill tokens, preemptions and copies as the GPU in seconds, so a
caching policy can be tried on the full workload before any device time is spent. Time is not modelled.
Defaults: W2-large (5,000 rows, 200 prefixes of 2,000 tokens, a unique 100-token suffix, 64 output tokens), the
limited device pool of kv_tiers.py on one H200 (9,322 blocks of 16 tokens) and 32 GiB of host tier for llama3-8b
(2 MiB a block: 16,384 blocks).
"""

from __future__ import annotations

import argparse
import random
import time

from batchllm.config import SchedulerConfig
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.interfaces import ModelRunnerOutput, SampledToken, SchedulerOutput
from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.engine.request import Request, RequestStatus
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams

BLOCK = 16


class _TokenRunner:
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput({r.request_id: SampledToken(7) for r in so.requests if r.sample})


class _NoText:
    def finish(self, request: Request) -> str:
        return ""


def _stop_at_max_tokens(request: Request) -> bool:
    if request.num_output_tokens >= request.sampling_params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def simulate(rows: int, prefixes: int, prefix_len: int, device_blocks: int, host_blocks: int,
             max_num_seqs: int = 256, output_tokens: int = 64, seed: int = 5) -> dict:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 128_000) for _ in range(n)]

    shared = [tokens(prefix_len) for _ in range(prefixes)]
    kv = KVCacheManager(device_blocks, BLOCK, enable_caching=True, num_host_blocks=host_blocks)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, 8192, 4096), kv, _stop_at_max_tokens)
    engine = EngineCore(scheduler, _TokenRunner(), _NoText(), async_scheduling=False)
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    for row in range(rows):
        engine.add_request(str(row), rng.choice(shared) + tokens(100), params)
    while engine.has_unfinished():
        engine.step()
    tier = kv.host.stats if kv.host is not None else None
    return {"hit_rate": round(kv.stats.hits / kv.stats.queries, 4),
            "prefill_tokens": scheduler.stats.num_prefill_tokens, "steps": scheduler.stats.num_steps,
            "max_running": scheduler.stats.max_running, "preemptions": scheduler.stats.num_preemptions,
            "spilled_blocks": tier.spilled_blocks if tier else 0, "loaded_blocks": tier.loaded_blocks if tier else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--prefixes", type=int, default=200)
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--device-blocks", type=int, default=9322, help="the limited pool")
    parser.add_argument("--unlimited-blocks", type=int, default=55_168, help="the whole H200 pool for llama3-8b")
    parser.add_argument("--host-blocks", type=int, default=16_384)
    args = parser.parse_args()
    configs = [("unlimited pool", args.unlimited_blocks, 0), ("limited pool", args.device_blocks, 0),
               ("limited pool + host tier", args.device_blocks, args.host_blocks)]
    print(f"{'config':26} {'hit':>6} {'prefill tok':>11} {'steps':>6} {'preempt':>7} {'spilled':>8} {'loaded':>8}")
    for label, device_blocks, host_blocks in configs:
        start = time.perf_counter()
        r = simulate(args.rows, args.prefixes, args.prefix_len, device_blocks, host_blocks)
        print(f"{label:26} {r['hit_rate']:>6.3f} {r['prefill_tokens']:>11} {r['steps']:>6} {r['preemptions']:>7} "
              f"{r['spilled_blocks']:>8} {r['loaded_blocks']:>8}   ({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
