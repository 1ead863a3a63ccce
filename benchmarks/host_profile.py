"""Host time per engine step, by phase, at a given number of running requests.

    python benchmarks/host_profile.py --shape smollm2-135m --running 256 1024 --max-tokens 64

Every row is a random 100-token prompt (`--prompt-tokens`) decoding `--max-tokens` tokens, `--running` rows at
once (`max_num_seqs`), so most steps are decode steps of exactly that batch; with `--rows` above `--running`,
requests join and leave it as in W4. `--null-model` replaces the forward pass by zeros, so that on the CPU a
step's time is the host's own work. The engine's phases are timed by wrapping them on the instance (nothing in
the library changes):

- schedule: `Scheduler.schedule`;
- launch: the executor's `execute_model_async` / `execute_model`: runner bookkeeping, input preparation,
  sampling tensors and kernel launches (on the CPU also the compute itself);
- wait: `result()` of a launched step: waiting for the device and reading the tokens back;
- apply: `Scheduler.update_from_output` and the detokenizer's `finish` of finished requests;
- mask (`--schema`): `StructuredOutputManager.bitmask`, the grammar bitmask fill; sample (`--schema`): the
  constrained step's sampling, launched once its bitmask is there (in "launch" for unconstrained steps);
- other: the rest of the wall time (the `LLM.generate` loop, outputs).

With asynchronous scheduling "wait" is the GPU time the host could not hide; the host's own work is the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import pstats
import random
import shutil
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch
from shapes import SHAPES, make_shape_dir

from batchllm import LLM, SamplingParams, StructuredOutputsParams
from batchllm.engine.interfaces import AwaitingGrammar

# A JSON string: with random weights a row ends when it samples a token holding a quote, tens of tokens in.
SCHEMA = {"type": "string"}


def timed(totals: dict[str, float], phase: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[phase] += time.perf_counter() - start
    return wrapper


def instrument(llm: LLM, totals: dict[str, float]) -> None:
    engine = llm.engine
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = timed(totals, "apply", engine.scheduler.update_from_output)
    engine.detokenizer.finish = timed(totals, "apply", engine.detokenizer.finish)
    executor = engine.executor
    launch_name = "execute_model_async" if engine.async_scheduling else "execute_model"
    launch = getattr(executor, launch_name)

    def launch_and_wrap(so):
        return wrap_awaiting(timed(totals, "launch", launch)(so), totals, engine.async_scheduling)

    setattr(executor, launch_name, launch_and_wrap)
    if engine.structured is not None:
        engine.structured.bitmask = timed(totals, "mask", engine.structured.bitmask)


def wrap_awaiting(output, totals: dict[str, float], async_scheduling: bool):
    """Times the sampling half of a constrained step, and the wait for its result."""
    if isinstance(output, AwaitingGrammar):
        sample = output.sample

        def timed_sample(grammar):
            pending = timed(totals, "sample", sample)(grammar)
            pending.result = timed(totals, "wait", pending.result)
            return pending
        output.sample = timed_sample
    elif async_scheduling:
        output.result = timed(totals, "wait", output.result)
    return output


def instrument_launch(llm: LLM, totals: dict[str, float]) -> None:
    """Split "launch" (one process only: no tensor parallelism)."""
    runner = llm.runner
    runner.inputs.prepare = timed(totals, "prepare", runner.inputs.prepare)
    runner.inputs.fill_placeholders = timed(totals, "placeholders", runner.inputs.fill_placeholders)
    if runner.graphs is not None:
        runner.graphs.replay = timed(totals, "forward", runner.graphs.replay)
    runner.model.compute_logits = timed(totals, "logits", runner.model.compute_logits)
    runner.sampler = timed(totals, "sample", runner.sampler)


class _NullModel(torch.nn.Module):
    """Zeros, from buffers allocated once: a fresh [rows, vocabulary] float32 tensor per step (39 MB at 200 rows of
    smollm2's 49,152 tokens) and its argmax cost the CPU 8-17 ms a step, more than the host work measured. The
    logits are NULL_VOCAB wide: every row samples token 0 either way."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden = torch.zeros(0, hidden_size)
        self.logits = torch.zeros(0, NULL_VOCAB)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if len(input_ids) > len(self.hidden):
            self.hidden = self.hidden.new_zeros(len(input_ids), self.hidden.shape[1])
        return self.hidden[:len(input_ids)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if len(hidden) > len(self.logits):
            self.logits = self.logits.new_zeros(len(hidden), NULL_VOCAB)
        return self.logits[:len(hidden)]


NULL_VOCAB = 128


def use_null_model(llm: LLM) -> None:
    runner = llm.runner
    runner.model = _NullModel(runner.model_config.hidden_size)
    runner.graphs = None


def _runtime_profiler():
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    return torch.profiler.profile(activities=activities)


def _print_cprofile(profile: cProfile.Profile, steps: int, limit: int) -> None:
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:limit]
    for (filename, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{filename.rsplit('/', 2)[-1]}:{line}({name})"
        print(f"        {1e6 * own / steps:>7.0f} own {1e6 * cumulative / steps:>7.0f} cum "
              f"{calls / steps:>7.1f} calls  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=None, help="rows in all (default: --running); more rows than "
                        "--running make requests join and leave the batch as in W4")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--modes", nargs="+", choices=["async", "sync"], default=["async", "sync"])
    parser.add_argument("--detail", action="store_true", help="also split the launch phase")
    parser.add_argument("--runtime-calls", action="store_true",
                        help="profile the timed run and list the CUDA runtime calls the host spent longest in")
    parser.add_argument("--num-decode-steps", type=int, default=1, help="LLM(num_decode_steps=...): decode bursts")
    parser.add_argument("--null-model", action="store_true",
                        help="replace the forward pass and logits by zeros (no tensor parallelism, no CUDA graphs): "
                             "what is left of a step is the host's work")
    parser.add_argument("--cprofile", type=int, metavar="N", default=0,
                        help="profile the timed run with cProfile and list the N functions with the most own time")
    parser.add_argument("--sync-debug", action="store_true",
                        help="report where the timed run calls a synchronizing CUDA operation, and allocator retries")
    parser.add_argument("--schema", action="store_true",
                        help="every row constrained to a JSON string (the grammar path; needs --tokenizer)")
    parser.add_argument("--tokenizer", type=Path, help="--schema: a tokenizer directory (the grammar needs one)")
    args = parser.parse_args()
    if args.schema and args.tokenizer is None:
        parser.error("--schema needs --tokenizer DIR")
    directory = make_shape_dir(args.shape)
    if args.schema:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (args.tokenizer / name).exists():
                shutil.copy(args.tokenizer / name, directory / name)
    vocab = SHAPES[args.shape]["vocab_size"]
    print(f"{args.shape}, {args.max_tokens} output tokens per row; microseconds per step")
    print(f"{'running':>7} {'mode':>5} {'steps':>5} {'wall':>7} {'schedule':>8} {'launch':>7} {'wait':>7} "
          f"{'apply':>6} {'other':>6}" + (f" {'mask':>6} {'sample':>6}" if args.schema else ""))
    for running in args.running:
        rng = random.Random(running)
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]
                   for _ in range(args.rows or running)]
        for async_scheduling in [mode == "async" for mode in args.modes]:
            llm = LLM(model=str(directory), load_format="dummy", skip_tokenizer_init=not args.schema,
                      device=args.device, max_num_seqs=running, max_num_batched_tokens=max(8192, running),
                      async_scheduling=async_scheduling, num_decode_steps=args.num_decode_steps)
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                                    structured_outputs=StructuredOutputsParams(json=SCHEMA) if args.schema else None)
            # Warm-up on every prompt: Triton compiles for the prefill shapes of this batch here, not in the timed
            # run (on a fresh machine the first engine of a process otherwise pays for it).
            llm.generate(prompts, dataclasses.replace(params, max_tokens=2), use_tqdm=False)
            if args.null_model:
                use_null_model(llm)
            totals: dict[str, float] = defaultdict(float)
            instrument(llm, totals)
            details: dict[str, float] = defaultdict(float)
            if args.detail:
                instrument_launch(llm, details)
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if args.sync_debug:
                    torch.cuda.set_sync_debug_mode("warn")
                profiler = _runtime_profiler() if args.runtime_calls else contextlib.nullcontext()
                python_profiler = cProfile.Profile() if args.cprofile else contextlib.nullcontext()
                with profiler as prof, python_profiler:
                    start = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    wall = time.perf_counter() - start
                if args.sync_debug:
                    torch.cuda.set_sync_debug_mode(0)
            if args.sync_debug:
                places = Counter(f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught
                                 if "synchroniz" in str(w.message))
                retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
                print(f"        syncs: {dict(places.most_common(8))}; allocator retries: {retries}")
            steps = llm.stats.num_steps
            other = wall - sum(totals.values())
            per_step = {k: 1e6 * v / steps for k, v in {**totals, "other": other}.items()}
            mode = "async" if async_scheduling else "sync"
            print(f"{running:>7} {mode:>5} {steps:>5} {1e6 * wall / steps:>7.0f} {per_step['schedule']:>8.0f} "
                  f"{per_step['launch']:>7.0f} {per_step.get('wait', 0):>7.0f} {per_step['apply']:>6.0f} "
                  f"{per_step['other']:>6.0f}" + (f" {per_step.get('mask', 0):>6.0f} {per_step.get('sample', 0):>6.0f}"
                                                  if args.schema else ""))
            if args.runtime_calls:
                calls = [e for e in prof.key_averages() if e.key.startswith("cuda")]
                calls.sort(key=lambda e: -e.self_cpu_time_total)
                print("        runtime: " + ", ".join(f"{e.key} {e.count}x {e.self_cpu_time_total / steps:.0f}"
                                                   for e in calls[:6]))
            if args.cprofile:
                _print_cprofile(python_profiler, steps, args.cprofile)
            if args.detail:
                print("        launch: " + ", ".join(f"{k} {1e6 * v / steps:.0f}" for k, v in details.items()))
            del llm, totals, details
            gc.collect()  # the wrappers make a cycle through the runner: free its KV pool before the next engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
