"""Where a GPU run's time goes: kernel time by kind (GEMM, attention, other) against wall time; or, with
`--timeline`, a per-step timeline of host phases and GPU time.

    python benchmarks/gpu_profile.py --shape llama3-8b --workload W1 --rows 200 --max-tokens 128
    python benchmarks/gpu_profile.py --timeline --shape llama3-8b --workload W5 --rows 1000 --max-tokens 1000 \
        --max-num-seqs 512 [--sync] [--out $OUT]
    python benchmarks/gpu_profile.py --timeline --shape smollm2-135m --workload W4 --rows 8 --max-tokens 8  # CPU
    python benchmarks/gpu_profile.py --timeline --images --shape qwen2.5-vl-7b --rows 1000 --max-tokens 128

`--images` (a vision-language shape; `tiny-vl` on the CPU): each row is one synthetic 448 x 448 JPEG and a short
instruction (vision.py's prompts), so the timeline shows the image steps (encoder and prefill) among the decode
steps.

Runs the workload once to warm up, then again under torch.profiler, and prints the share of wall time the
GPU spent in each kind of kernel; the rest is host overhead or idle gaps between steps.

`--timeline` (warm-up: up to 64 rows past the timed ones, 4 tokens) wraps engine methods on the instance with
perf_counter timers (the library is unchanged) and records per engine step (one `EngineCore.step` call):
`schedule`, `launch` (`execute_model_async` until it returns: runner bookkeeping, input preparation, sampling
tensors, kernel launches; on the CPU the compute too), `wait` (`StepOutput.result`; with async scheduling
the previous step's), `apply` (`update_from_output` + detokenizer `finish`), `other` (the rest of `step`),
`loop` (between steps: the `LLM.generate` loop). On CUDA, `torch.cuda.Event`s around each launch give the
step's GPU `span` (first to last work, idle inside included) and `gap` (GPU idle since the previous step's
end). Up to `--kernel-steps` decode steps per batch bucket (after its first 16) run under torch.profiler,
each launch in a `record_function` range; their kernels (linked by correlation id) give `busy` and time by
kind. Those steps and the one after each window are left out of the host and span/gap statistics (the
profiler slows the host). Statistics: median/p90 over decode-only steps, by the launched step's batch size.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, make_prompts

from batchllm import LLM, SamplingParams

KINDS = (("attention", ("attn", "attention")), ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "matmul")),
         ("kv write", ("write_kv", "kv_write")), ("norm/rotary/act", ("rms", "rotary", "silu")),
         ("sampling", ("argmax", "softmax", "topk", "sort")))


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the step budget (default: LLM's)")
    parser.add_argument("--sync", action="store_true", help="async_scheduling=False (the default is on for CUDA)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: the profiler then sees every kernel of a decode step")
    parser.add_argument("--deterministic", action="store_true", help="LLM(deterministic=True): the invariant kernels")
    parser.add_argument("--quantization", default=None, help="LLM(quantization=...): fp8, ...")
    parser.add_argument("--kv-cache-dtype", default="auto", help="LLM(kv_cache_dtype=...): auto or fp8")
    parser.add_argument("--num-decode-steps", type=int, default=1, help="LLM(num_decode_steps=...): decode bursts")
    parser.add_argument("--images", action="store_true", help="vision.py's rows: one JPEG each (a VL shape)")
    parser.add_argument("--timeline", action="store_true", help="per-step host phases and GPU time (CPU too)")
    parser.add_argument("--kernel-steps", type=int, default=64, help="--timeline: profiled decode steps per bucket")
    parser.add_argument("--out", type=Path, help="--timeline: also write the per-step records as JSON here")
    args = parser.parse_args()
    if args.images and not args.timeline:
        parser.error("--images goes with --timeline (its warm-up uses other images than the timed rows)")
    prompts = _prompts(args, args.rows)
    if args.timeline:
        return run_timeline(args, prompts)
    llm = LLM(model=str(make_shape_dir(args.shape)), load_format="dummy", skip_tokenizer_init=True,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              async_scheduling=False if args.sync else None, enforce_eager=args.enforce_eager,
              deterministic=args.deterministic, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              num_decode_steps=args.num_decode_steps)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:32], params, use_tqdm=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if device_us and event.key and not event.key.startswith("ProfilerStep"):
            totals[kind_of(event.key)] += device_us / 1e6
            top[event.key] += device_us / 1e6
    busy = sum(totals.values())
    mode = "async" if llm.engine.async_scheduling else "sync"
    print(f"{args.workload} {args.shape} {args.rows} rows x {args.max_tokens} ({mode}): wall {wall:.2f} s, "
          f"GPU kernels {busy:.2f} s ({busy / wall:.0%}, idle {1 - busy / wall:.0%}), steps {llm.stats.num_steps}")
    for kind, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:16} {seconds:7.2f} s  {seconds / wall:6.1%} of wall")
    for name, seconds in sorted(top.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {seconds:7.3f} s  {name[:100]}")


def _prompts(args, rows: int) -> list:
    """The workload's first `rows` prompts; with --images, rows of one distinct synthetic JPEG each."""
    if not args.images:
        return make_prompts(WORKLOADS[args.workload], rows, SHAPES[args.shape]["vocab_size"])
    from vision import PROMPT_AFTER, PROMPT_BEFORE, synthetic_jpeg

    ids = PROMPT_BEFORE + [SHAPES[args.shape]["image_token_id"]] + PROMPT_AFTER
    return [{"prompt_token_ids": ids, "multi_modal_data": {"image": synthetic_jpeg(i)}} for i in range(rows)]


BUCKETS = ((128, "<128"), (256, "128-255"), (512, "256-511"), (1 << 62, "512+"))
HOST = ("schedule", "launch", "wait", "apply", "other", "loop")


def bucket_of(batch: int) -> str:
    return next(name for limit, name in BUCKETS if batch < limit)


class Timeline:
    """Per `EngineCore.step` call, a dict: host phases (s), the launched step's shape, its CUDA events."""

    def __init__(self, llm: LLM, kernel_steps: int, skip: int = 16) -> None:
        self.steps: list[dict] = []
        self.windows: list = []  # per profiler window: kineto's results
        self.cuda = llm.runner.device.type == "cuda"
        self.kernel_steps, self.skip, self.seen = kernel_steps, skip, defaultdict(int)
        self.current: dict = {}
        self.prof = None
        engine = llm.engine
        engine.step = self._step(engine.step)
        engine.scheduler.schedule = self._timed("schedule", engine.scheduler.schedule)
        engine.scheduler.update_from_output = self._timed("apply", engine.scheduler.update_from_output)
        engine.detokenizer.finish = self._timed("apply", engine.detokenizer.finish)
        llm.runner.execute_model_async = self._launch(llm.runner.execute_model_async)

    def _timed(self, phase, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - start
        return wrapper

    def _step(self, step):
        def wrapper():
            self.current = {"index": len(self.steps), "t0": time.perf_counter(), "batch": 0, "tokens": 0}
            self.steps.append(self.current)
            finished = step()
            self.current["t1"] = time.perf_counter()
            return finished
        return wrapper

    def _launch(self, launch):
        def wrapper(so):
            step = self.current
            decode = so.num_scheduled_tokens == len(so.requests)
            step.update(batch=len(so.requests), tokens=so.num_scheduled_tokens, decode=decode)
            bucket = bucket_of(len(so.requests))
            self.seen[bucket] += decode
            profile = self.cuda and decode and self.skip < self.seen[bucket] <= self.skip + self.kernel_steps
            if profile != (self.prof is not None):
                self._toggle_profiler()
                step["perturbed"] = True
            step["profiled"] = profile
            start = time.perf_counter()
            if self.cuda:
                step["events"] = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                step["events"][0].record()
            with torch.profiler.record_function(f"timeline step {step['index']}") if profile else nullcontext():
                output = launch(so)
            if self.cuda:
                step["events"][1].record()
            step["launch"] = step.get("launch", 0.0) + time.perf_counter() - start
            if hasattr(output, "result"):  # not for a step awaiting its grammar bitmask
                output.result = self._timed("wait", output.result)
            return output
        return wrapper

    def _toggle_profiler(self) -> None:
        if self.prof is None:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.start()
        else:
            self.prof.stop()
            self.windows.append(self.prof.profiler.kineto_results)
            self.prof = None

    def finish(self) -> None:
        """After the run: close the profiler, read the events, attribute the kernels to their steps."""
        if self.prof is not None:
            self._toggle_profiler()
        previous_end, previous_t1 = None, None
        if self.cuda:
            torch.cuda.synchronize()
        for step in self.steps:
            step["other"] = step["t1"] - step["t0"] - sum(step.get(p, 0.0) for p in HOST[:4])
            if previous_t1 is not None:
                step["loop"] = step["t0"] - previous_t1
            previous_t1 = step["t1"]
            events = step.pop("events", None)
            if events is not None:
                step["span"] = events[0].elapsed_time(events[1]) / 1e3
                if previous_end is not None:
                    step["gap"] = previous_end.elapsed_time(events[0]) / 1e3
                previous_end = events[1]
        for results in self.windows:
            self._attribute(results.events())

    def _attribute(self, events) -> None:
        from torch.autograd import DeviceType

        ranges, op_start = [], {}
        for e in events:
            if e.device_type() == DeviceType.CPU and e.linked_correlation_id() == 0:
                op_start[e.correlation_id()] = e.start_ns()
                if e.is_user_annotation() and e.name().startswith("timeline step "):
                    ranges.append((e.start_ns(), e.end_ns(), int(e.name().rsplit(" ", 1)[1])))
        ranges.sort()
        starts = [r[0] for r in ranges]
        for e in events:  # kernels, copies and memsets; not the GPU side of the step ranges
            if e.device_type() != DeviceType.CUDA or e.name().startswith("timeline step ") or e.is_user_annotation():
                continue
            launched = op_start.get(e.linked_correlation_id())
            i = bisect.bisect_right(starts, launched) - 1 if launched is not None else -1
            if i < 0 or launched > ranges[i][1]:
                continue  # a kernel of a step launched before the window opened
            step = self.steps[ranges[i][2]]
            name = e.name()
            kind = "memcpy" if name.startswith(("Memcpy", "Memset")) else kind_of(name)
            kinds = step.setdefault("kinds", defaultdict(float))
            kinds[kind] += e.duration_ns() / 1e9
            step["busy"] = step.get("busy", 0.0) + e.duration_ns() / 1e9


def _ms(values: list[float]) -> str:
    values = sorted(values)
    return f"{1e3 * statistics.median(values):.2f}/{1e3 * values[int(0.9 * (len(values) - 1))]:.2f}" if values else "-"


def _by_bucket(title: str, steps: list[dict], columns: dict) -> None:
    """One line per batch bucket: median/p90 of each column (a function of a step, None where it has no value)."""
    print(f"\n{title}\n{'batch':>8} {'steps':>5}" + "".join(f" {name[:13]:>13}" for name in columns))
    for _, bucket in BUCKETS:
        rows = [s for s in steps if bucket_of(s["batch"]) == bucket]
        if rows:
            cells = (_ms([v for v in map(fn, rows) if v is not None]) for fn in columns.values())
            print(f"{bucket:>8} {len(rows):>5}" + "".join(f" {c:>13}" for c in cells))


def run_timeline(args, prompts) -> None:
    llm = LLM(model=str(make_shape_dir(args.shape)), load_format="dummy", skip_tokenizer_init=True,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              async_scheduling=False if args.sync else None, enforce_eager=args.enforce_eager,
              deterministic=args.deterministic, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              num_decode_steps=args.num_decode_steps)
    # Warm-up on other rows of the workload (up to 64): the timed prompts must not be in the prefix cache.
    n = min(64, args.rows)
    warmup = _prompts(args, args.rows + n)[-n:]
    llm.generate(warmup, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    timeline = Timeline(llm, args.kernel_steps)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - start
    timeline.finish()
    steps, cuda = timeline.steps, timeline.cuda
    mode = "async" if llm.engine.async_scheduling else "sync"
    decode = [s for s in steps if s.get("decode")]
    workload = "images" if args.images else args.workload
    print(f"{workload} {args.shape} {args.rows} rows x {args.max_tokens} ({mode}, {llm.runner.device.type}, "
          f"max_num_seqs {args.max_num_seqs}): wall {wall:.2f} s, {len(steps)} steps, {len(decode)} decode-only, "
          f"preemptions {llm.stats.num_preemptions}")
    if cuda:
        spans = sum(s.get("span", 0) for s in steps)
        gaps = [sum(s.get("gap", 0) for s in steps if bool(s.get("perturbed")) == p) for p in (False, True)]
        print(f"GPU step spans {spans:.2f} s ({spans / wall:.0%} of wall), idle between steps {gaps[0]:.2f} s "
              f"(+ {gaps[1]:.2f} s while the profiler started or stopped)")
    clean = [s for s in decode if not s.get("profiled") and not s.get("perturbed")]
    columns = {"period": lambda s: s["t1"] - s["t0"] + s.get("loop", 0.0)}
    columns.update({phase: (lambda s, p=phase: s.get(p, 0.0)) for phase in HOST})
    gpu = ("span", "gap") if cuda else ()
    columns.update({c: (lambda s, c=c: s.get(c)) for c in gpu})
    _by_bucket(f"ms per step, median/p90 over decode-only steps{' not profiled' if cuda else ''}", clean, columns)
    mixed = [s for s in steps if s["batch"] and not s.get("decode")]
    if mixed and cuda:  # steps with prefill tokens run eagerly: do they leave the GPU idle (item 3 of issue 13)?
        share = sum(s.get("span", 0) + s.get("gap", 0) for s in mixed) / wall
        print(f"\nsteps with prefill tokens (eager): {len(mixed)}, {share:.0%} of wall; ms median/p90: "
              + ", ".join(f"{c} {_ms([s[c] for s in mixed if c in s])}" for c in ("launch", "span", "gap"))
              + f"; tokens median {statistics.median(s['tokens'] for s in mixed):.0f}")
    profiled = [s for s in decode if "busy" in s]
    if profiled:
        kinds = sorted({k for s in profiled for k in s["kinds"]})
        columns = {"busy": lambda s: s["busy"], "idle in step": lambda s: s["span"] - s["busy"]}
        columns.update({k: (lambda s, k=k: s["kinds"].get(k, 0.0)) for k in kinds})
        _by_bucket("GPU ms per profiled decode step by kernel kind, median/p90 (idle in step: span - busy)",
                   profiled, columns)
    good = {s["index"] for s in clean}
    middle = next((i for i in range(len(steps) // 2, len(steps) - 10) if good.issuperset(range(i, i + 10))),
                  max(0, len(steps) // 2 - 5))
    print(f"\n10 consecutive steps from the middle (ms)\n{'step':>5} {'batch':>5} {'tokens':>6}"
          + "".join(f" {c:>8}" for c in HOST + gpu))
    for s in steps[middle:middle + 10]:
        print(f"{s['index']:>5} {s['batch']:>5} {s['tokens']:>6}" + "".join(
            f" {1e3 * s[c]:>8.2f}" if c in s else f" {'-':>8}" for c in HOST + gpu))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        target = args.out / f"timeline-{workload}-r{args.rows}-o{args.max_tokens}-{args.shape}-{mode}.json"
        records = [{k: (dict(v) if k == "kinds" else v) for k, v in s.items()} for s in steps]
        target.write_text(json.dumps({"wall_s": wall, "mode": mode, "steps": records}) + "\n")
        print(f"wrote {target}")

if __name__ == "__main__":
    main()
