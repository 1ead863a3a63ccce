"""Offline throughput of batchllm against HF transformers on one workload of shared/bench/WORKLOADS.md.

    python benchmarks/throughput.py                         # W1, CPU-sized defaults, vs HF static generate
    python benchmarks/throughput.py --workload W4 --rows 512 --peer all

Prompts are random token ids, outputs are forced to full length (ignore_eos / min_new_tokens), and every
system runs the same prompts in the same process, one after the other. On the CPU the workloads are
scaled down (fewer rows, shorter outputs) so a run takes minutes on two cores; --rows and --max-tokens
override. The first N rows of a workload are the same whatever N is. One JSON file per run lands in
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import random
import subprocess
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from batchllm import LLM, SamplingParams
from batchllm.model.default_model import default_model_path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Workload:
    rows: int
    min_len: int  # unique prompt tokens per row, uniform in [min_len, max_len]
    max_len: int
    output_tokens: int
    seed: int
    cpu_rows: int
    cpu_output_tokens: int
    num_prefixes: int = 0  # shared "system prompts"; each row starts with one of them
    prefix_len: int = 0


WORKLOADS = {
    "W1": Workload(1000, 100, 1000, 256, seed=0, cpu_rows=32, cpu_output_tokens=64),
    "W2": Workload(1000, 100, 100, 128, seed=1, cpu_rows=32, cpu_output_tokens=32, num_prefixes=10, prefix_len=1000),
    "W3": Workload(256, 128, 128, 2048, seed=2, cpu_rows=16, cpu_output_tokens=256),
    "W4": Workload(5000, 20, 60, 16, seed=3, cpu_rows=256, cpu_output_tokens=16),
    "W5": Workload(1000, 1000, 1000, 1000, seed=4, cpu_rows=16, cpu_output_tokens=64),
    "W7": Workload(30000, 128, 128, 128, seed=7, cpu_rows=128, cpu_output_tokens=32),
}


def size_or_auto(value: str) -> int | None:
    """An engine size flag: a number, or `auto` (None: the engine chooses; on a GPU by timing steps)."""
    return None if value == "auto" else int(value)


def make_prompts(w: Workload, rows: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(w.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size - 100) for _ in range(n)]

    prefixes = [tokens(w.prefix_len) for _ in range(w.num_prefixes)]
    prompts = []
    for _ in range(rows):
        prefix = rng.choice(prefixes) if prefixes else []
        prompts.append(prefix + tokens(rng.randint(w.min_len, w.max_len)))
    return prompts


@contextlib.contextmanager
def timed(times: dict[str, float], phase: str):
    start = time.perf_counter()
    yield
    times[phase + "_s"] = round(time.perf_counter() - start, 4)


def figures(times: dict[str, float], prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    prompt_tokens = sum(map(len, prompts))
    output_tokens = sum(map(len, outputs))
    seconds = times["generate_s"]
    return {**times, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "output_tok_s": round(output_tokens / seconds, 2),
            "total_tok_s": round((prompt_tokens + output_tokens) / seconds, 2)}


def warmup_prompts() -> list[list[int]]:
    return [list(range(1000, 1016)), list(range(2000, 2040))]


def run_batchllm(args, prompts, max_tokens: int, async_scheduling: bool | None = None
                 ) -> tuple[dict, list[list[int]]]:
    times: dict[str, float] = {}
    with timed(times, "load"):
        llm = LLM(model=args.model, device=args.device, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                  async_scheduling=async_scheduling)
    with timed(times, "warmup"):
        llm.generate(warmup_prompts(), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with timed(times, "generate"):
        outs = llm.generate(prompts, params, use_tqdm=False)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    # The stats include the two warm-up requests; they are too small to move any figure.
    result = {**figures(times, prompts, outputs), "stats": _plain(llm.stats)}
    del llm
    gc.collect()
    return result, outputs


def load_hf(path: Path, device: str, attn: str):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    return model.to(device).eval()


def run_hf_generate(path: Path, device: str, prompts, max_tokens: int, batch_size: int):
    times: dict[str, float] = {}
    with timed(times, "load"):
        model = load_hf(path, device, "sdpa")
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    # min_new_tokens = max_new_tokens suppresses EOS, so every row gets exactly max_tokens new tokens.
    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=pad)

    def generate(batch: list[list[int]]) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return out[:, width:].tolist()

    with timed(times, "warmup"):
        generate(warmup_prompts())
    # Batches of similar lengths waste the least on padding: a favour to the peer that a plain loop over
    # the rows in input order would not get.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    with timed(times, "generate"):
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            for i, tokens in zip(chunk, generate([prompts[i] for i in chunk])):
                outputs[i] = tokens
    return {**figures(times, prompts, outputs), "batch_size": batch_size}, outputs


def continuous_batching_attn() -> str:
    # transformers >= 5.23 runs continuous batching on plain "sdpa"; earlier releases spelled it "paged|sdpa".
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "sdpa" if (major, minor) >= (5, 23) else "paged|sdpa"


def run_hf_generate_batch(path: Path, device: str, prompts, max_tokens: int):
    times: dict[str, float] = {}
    attn = continuous_batching_attn()
    with timed(times, "load"):
        model = load_hf(path, device, attn)

    def generate(batch: list[list[int]], n: int) -> list[list[int]]:
        config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1)
        results = model.generate_batch(inputs=batch, generation_config=config)
        return [r.generated_tokens for r in results.values()]  # in input order

    with timed(times, "warmup"):
        generate(warmup_prompts(), 4)
    with timed(times, "generate"):
        outputs = generate(prompts, max_tokens)
    return {**figures(times, prompts, outputs), "attn_implementation": attn}, outputs


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Greedy fp32 outputs should match; random-token prompts make small numeric drift visible."""
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(ours, theirs)]
    return {"identical_rows": sum(x == y for x, y in zip(ours, theirs)), "rows": len(ours),
            "mean_common_prefix": round(sum(prefix) / len(prefix), 2)}


def _plain(obj):
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    return str(obj)


def hardware(device: str) -> tuple[str, dict]:
    """A short name for file names and the details for the record."""
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count(), "cpu": platform.processor()}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        info["cpu"] = names[0] if names else info["cpu"]
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        return info["gpu"].lower().replace(" ", "-"), info
    return f"cpu{os.cpu_count()}", info


def save_record(name: str, record: dict, copy_to: str | None = None) -> Path:
    """Write a run's JSON record into results/ (and a copy into `copy_to`, e.g. the device tool's $OUT)."""
    text = json.dumps(record, indent=2, default=str) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / name).write_text(text)
    if copy_to:
        Path(copy_to, name).write_text(text)
    return RESULTS / name


def git_sha() -> str:
    repo = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "-uno"], cwd=repo, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--rows", type=int, help="default: the workload's rows (CPU: a scaled-down count)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per row (default: the workload's; CPU: fewer)")
    parser.add_argument("--model", help="local HF model directory (default: the converted default model)")
    parser.add_argument("--shape", help="shape name for the record (default: smollm2-135m or the model dir name)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--peer", choices=["generate", "generate_batch", "all", "async", "none"], default="generate",
                        help="async: batchllm itself with async_scheduling=True (the default is off on the CPU)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="batch size of HF static generate")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--num-kv-blocks", type=int)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON record")
    args = parser.parse_args()

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = device
    workload = WORKLOADS[args.workload]
    on_cpu = device == "cpu"
    rows = args.rows or (workload.cpu_rows if on_cpu else workload.rows)
    max_tokens = args.max_tokens or (workload.cpu_output_tokens if on_cpu else workload.output_tokens)
    path = Path(args.model) if args.model else default_model_path()  # converts the default model once
    shape = args.shape or ("smollm2-135m" if args.model is None else path.name)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(workload, rows, vocab_size)
    print(f"{args.workload}: {rows} rows, prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
          f"{max_tokens} output tokens, {shape} on {device}")

    # Other processes on the same cores (a test run, say) slow every thread-parallel op many times over.
    load_at_start = round(os.getloadavg()[0], 2)
    if load_at_start > 0.5:
        print(f"warning: load average {load_at_start} before the run; the figures will not be representative")
    systems: dict[str, dict] = {}
    systems["batchllm"], ours = run_batchllm(args, prompts, max_tokens)
    if args.peer in ("generate", "all"):
        systems["hf_generate"], theirs = run_hf_generate(path, device, prompts, max_tokens, args.hf_batch_size)
        systems["hf_generate"]["agreement_with_batchllm"] = agreement(ours, theirs)
    if args.peer in ("generate_batch", "all"):
        systems["hf_generate_batch"], theirs = run_hf_generate_batch(path, device, prompts, max_tokens)
        systems["hf_generate_batch"]["agreement_with_batchllm"] = agreement(ours, theirs)
    if args.peer == "async":
        systems["batchllm_async"], theirs = run_batchllm(args, prompts, max_tokens, async_scheduling=True)
        systems["batchllm_async"]["agreement_with_batchllm"] = agreement(ours, theirs)

    print(f"\n{'system':<20}{'load s':>8}{'warmup s':>10}{'generate s':>12}{'output tok/s':>14}{'total tok/s':>13}")
    for name, f in systems.items():
        print(f"{name:<20}{f['load_s']:>8.1f}{f['warmup_s']:>10.1f}{f['generate_s']:>12.1f}"
              f"{f['output_tok_s']:>14.1f}{f['total_tok_s']:>13.1f}")
    print(f"\nbatchllm stats: {systems['batchllm']['stats']}")
    for name, f in systems.items():
        if "agreement_with_batchllm" in f:
            print(f"{name} greedy agreement with batchllm: {f['agreement_with_batchllm']}")

    hw_name, hw_info = hardware(device)
    hw_info["load_average_at_start"] = load_at_start
    today = datetime.date.today().isoformat()
    record = {
        "date": today, "git_sha": git_sha(), "shape": shape, "model": str(path), "device": device,
        "hardware": hw_info,
        "workload": {"name": args.workload, "rows": rows, "output_tokens": max_tokens, "seed": workload.seed,
                     "prompt_tokens": sum(map(len, prompts)), "prompt_len_range": [min(map(len, prompts)),
                                                                                     max(map(len, prompts))]},
        "systems": systems,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{today}-{args.workload}-r{rows}-o{max_tokens}-{shape}-{hw_name}-vs-{args.peer}.json"
    target = args.out / name
    target.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
