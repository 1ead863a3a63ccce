"""The engine's per-row host work alone, on the CPU: `RequestStates.gather`, `Scheduler.schedule` and
`Scheduler.update_from_output` for a batch of decode rows, without a model or a runner.

    python benchmarks/host_micro.py --rows 200

gather: `--rows` requests known to the runner, each scheduled for one placeholder token (an asynchronous decode
step), gathered 300 times. schedule / update: an engine of the `tiny-host` shape whose forward pass is replaced by
zeros (host_profile.py's null model) prefills `--rows` prompts of 600 tokens, then the scheduler alone runs 200
synchronous decode steps, each answered with a made-up token per row. Best of 5 repetitions, µs per call: on a
shared CPU only the comparison of two trees in alternating runs means anything (`host_profile.py` times whole steps).
"""

from __future__ import annotations

import argparse
import time

import torch
from host_profile import use_null_model
from shapes import make_shape_dir

from batchllm import LLM, SamplingParams
from batchllm.engine.interfaces import (
    ModelRunnerOutput,
    NewRequestData,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
)
from batchllm.executor.step_batch import RequestStates

REPEATS = 5


def gather_us(rows: int) -> float:
    states = RequestStates(512, max(rows, 1), torch.device("cpu"))
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    ids = [f"r{i}" for i in range(rows)]
    for request_id in ids:
        states.add(request_id, NewRequestData(request_id, list(range(600)), 600, params, None, None, None))
    last_rows = {request_id: i for i, request_id in enumerate(ids)}
    step = SchedulerOutput([ScheduledRequest(request_id, [], 600, [], True, placeholder=True) for request_id in ids],
                           rows)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(300):
            states.gather(step, last_rows)
        best = min(best, (time.perf_counter() - start) / 300)
    return best * 1e6


def scheduler_us(rows: int) -> tuple[float, float]:
    llm = LLM(model=str(make_shape_dir("tiny-host")), load_format="dummy", skip_tokenizer_init=True, device="cpu",
              dtype="float32", max_num_seqs=max(rows, 1), max_model_len=8192, async_scheduling=False)
    use_null_model(llm)
    engine, scheduler = llm.engine, llm.engine.scheduler
    params = SamplingParams(max_tokens=5000, temperature=0, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"r{i}", list(range(3 + i, 603 + i)), params)
    while len(scheduler.running) < rows or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()  # the prompts' prefill
    token = SampledToken(5)
    best_schedule = best_update = float("inf")
    for _ in range(REPEATS):
        schedule = update = 0.0
        for _ in range(200):
            start = time.perf_counter()
            step = scheduler.schedule()
            scheduled = time.perf_counter()
            output = ModelRunnerOutput({r.request_id: token for r in step.requests})
            applying = time.perf_counter()
            scheduler.update_from_output(step, output)
            schedule, update = schedule + scheduled - start, update + time.perf_counter() - applying
        best_schedule, best_update = min(best_schedule, schedule / 200), min(best_update, update / 200)
    return best_schedule * 1e6, best_update * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    gather = gather_us(args.rows)
    schedule, update = scheduler_us(args.rows)
    print(f"{args.rows} decode rows, µs per call: gather {gather:.0f}, schedule {schedule:.0f}, "
          f"update_from_output {update:.0f}")


if __name__ == "__main__":
    main()
