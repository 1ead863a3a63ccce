"""The text path's cost: the same prompts as token ids, as text through `LLM.generate`, through a pandas column
(`batchllm.generate`) and through a Parquet job (`batchllm run`'s path), on one engine in one process.

    # issue 39: llama3-8b shape, W1 prompts (100-1,000 tokens), 1,000 rows x 64 output tokens, on a GPU
    python benchmarks/gpu_text_path.py --shape llama3-8b --workload W1 --rows 1000 --max-tokens 64 --out $OUT
    python benchmarks/gpu_text_path.py --tokenizer DIR --out $OUT      # W4 5000 x 16, smollm2-135m shape
    python benchmarks/gpu_text_path.py --workload W1 --rows 16 --max-tokens 4 --warmup-rows 4 --repeats 1  # CPU

Model: `--shape` (shapes.py) with random weights (`load_format="dummy"`) and a real tokenizer: the files of
`--tokenizer DIR` (default: the converted default model's directory) are copied next to the shape's config.json;
its vocabulary must fit the shape's. Prompts: the workload's random token ids (`make_prompts`, drawn below the
tokenizer's vocabulary size) decoded to text with that tokenizer. The ids the text is compared against are that
text's own tokenization (what the text path hands the engine), so every system runs identical prompts; the
re-encoded lengths are in the record (`prompt_len_range`).

Systems (`--systems`, default ids,text,pandas,job), on one LLM (engine defaults except
`enable_prefix_caching=False`: every run repeats the same prompts), warmed up on the first `--warmup-rows` rows
of each, then run alternately `--repeats` (2) times:

- `ids`: `llm.generate(token_id_lists, params)`;
- `text`: `llm.generate(texts, params)` (tokenized while the engine runs, batchllm/entrypoints/tokenize_ahead.py);
- `pandas`: `batchllm.generate(pd.DataFrame({"q": texts}), prompt_column="q", llm=llm, ...)`;
- `job`: `run_parquet_job(in.parquet, out/, llm=llm, prompt_column="q", ...)`, the path of
  `batchllm run in.parquet out/` without argument parsing and model load (job defaults: 5,000 rows per shard,
  twice max_num_seqs in flight); the input is written once, each run writes a fresh output directory. The
  tokenizer's identity, which a job pins, is computed once per process (the warm-up's run): its cost is
  recorded apart (`job_first_tokenizer_identity_s`), since `batchllm run` pays it in its one job;
- `chat_ids`: `llm.generate` on the chat-rendered prompts' ids; `chat`: `llm.chat` on the same conversations;
  `chat_pandas`: `batchllm.generate(..., chat=True)`.

params: max_tokens=--max-tokens, temperature=0, ignore_eos=True. tok/s count each system's prompt tokens plus
the output tokens. Ratios compare best runs: each text system against its ids peer (`ratio_to_ids` /
`ratio_to_chat_ids`) and the job against `text` (`ratio_to_text`, issue 39: >= 0.9). The pandas path's time is
split by wrapping the connector's phases (nothing in the library changes): `read`, `render`, `tokenize`
(`PromptEncoder.encode`, on a worker thread overlapping the engine), `outputs`, `attach`, and the rest (the
wall time outside every phase but `tokenize`): the engine plus the per-row loop of `map_columns`.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record

import batchllm
import batchllm.connectors.prompts as prompts_module
import batchllm.connectors.tables.mapper as mapper
import batchllm.connectors.tables.pandas as pandas_connector
from batchllm import LLM, SamplingParams
from batchllm.connectors.jobs import identity
from batchllm.connectors.jobs.parquet_job import run_parquet_job
from batchllm.model.loader import resolve_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
SYSTEMS = ("ids", "text", "pandas", "job", "chat_ids", "chat", "chat_pandas")
PEERS = {"text": "ids", "pandas": "ids", "job": "text", "chat": "chat_ids", "chat_pandas": "chat_ids"}
PHASES: dict[str, float] = defaultdict(float)  # seconds of the current pandas call, by phase


def timed(phase: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[phase] += time.perf_counter() - start
    return wrapper


def instrument() -> None:
    """Time the connector's phases; `map_columns` and `batchllm.generate` look these up at call time."""
    pandas_connector.read_columns = timed("read", pandas_connector.read_columns)
    pandas_connector.attach_outputs = timed("attach", pandas_connector.attach_outputs)
    mapper.render_rows = timed("render", mapper.render_rows)
    mapper.output_arrays = timed("outputs", mapper.output_arrays)
    prompts_module.PromptEncoder.encode = timed("tokenize", prompts_module.PromptEncoder.encode)


def model_dir(shape: str, tokenizer_dir: Path) -> Path:
    directory = make_shape_dir(shape)
    copied = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if "tokenizer.json" not in copied:
        raise SystemExit(f"{tokenizer_dir} has no tokenizer.json")
    for name in copied:
        shutil.copy(tokenizer_dir / name, directory / name)
    print(f"shape dir {directory}: {shape} config, tokenizer files from {tokenizer_dir}: {', '.join(copied)}")
    return directory


class Runner:
    """Each system as a function of the row count: (seconds, generated texts, output tokens, pandas phases)."""

    def __init__(self, llm: LLM, texts: list[str], ids: list[list[int]], chat_ids: list[list[int]],
                 params: SamplingParams, workdir: Path) -> None:
        self.llm, self.texts, self.ids, self.chat_ids, self.params = llm, texts, ids, chat_ids, params
        self.workdir, self.job_runs = workdir, 0
        self.inputs: dict[int, Path] = {}

    def run(self, system: str, rows: int) -> tuple[float, list[str], int, dict | None]:
        start = time.perf_counter()
        if system in ("ids", "text", "chat_ids", "chat"):
            if system == "chat":
                outs = self.llm.chat([[{"role": "user", "content": t}] for t in self.texts[:rows]], self.params,
                                     use_tqdm=False)
            else:
                prompts = {"ids": self.ids, "text": self.texts, "chat_ids": self.chat_ids}[system]
                outs = self.llm.generate(prompts[:rows], self.params, use_tqdm=False)
            seconds = time.perf_counter() - start
            return seconds, [o.outputs[0].text for o in outs], sum(len(o.outputs[0].token_ids) for o in outs), None
        if system == "job":
            return self._job(rows)
        PHASES.clear()
        frame = pd.DataFrame({"q": self.texts[:rows]})
        result = batchllm.generate(frame, prompt_column="q", chat=system == "chat_pandas", llm=self.llm,
                                   sampling_params=self.params, use_tqdm=False)
        seconds = time.perf_counter() - start
        phases = dict(PHASES)
        # Tokenizing overlaps the engine (worker thread): the rest is the wall time outside the other phases.
        phases["engine_and_loop"] = seconds - sum(v for k, v in phases.items() if k != "tokenize")
        return seconds, result["generated_text"].tolist(), int(result["completion_tokens"].sum()), phases

    def _job(self, rows: int) -> tuple[float, list[str], int, None]:
        if rows not in self.inputs:  # written once per row count, outside the timed run
            self.inputs[rows] = self.workdir / f"in-{rows}.parquet"
            pq.write_table(pa.table({"q": self.texts[:rows]}), self.inputs[rows])
        self.job_runs += 1
        output = self.workdir / f"out-{self.job_runs}"
        start = time.perf_counter()
        run_parquet_job(self.inputs[rows], output, llm=self.llm, prompt_column="q", sampling_params=self.params,
                        use_tqdm=False)
        seconds = time.perf_counter() - start
        table = pq.read_table(output, columns=["generated_text", "completion_tokens"])
        shutil.rmtree(output)
        output_tokens = pc.sum(table.column("completion_tokens")).as_py()
        return seconds, table.column("generated_text").to_pylist(), output_tokens, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W4")
    parser.add_argument("--rows", type=int, help="default: the workload's rows")
    parser.add_argument("--max-tokens", type=int, help="output tokens per row (default: the workload's)")
    parser.add_argument("--systems", default="ids,text,pandas,job", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json etc. (default: the default model's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup-rows", type=int, default=64)
    parser.add_argument("--out", help="also copy the JSON record here (e.g. the device tool's $OUT)")
    args = parser.parse_args()
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    workload = WORKLOADS[args.workload]
    rows = args.rows or workload.rows
    max_tokens = args.max_tokens or workload.output_tokens

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer_dir = args.tokenizer or resolve_model_path(None)
    directory = model_dir(args.shape, Path(tokenizer_dir))
    start = time.perf_counter()
    # No prefix caching: every system runs the same prompts, and a later run must not reuse an earlier one's K/V.
    llm = LLM(model=str(directory), load_format="dummy", enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    tokenizer = llm.tokenizer
    if len(tokenizer) > SHAPES[args.shape]["vocab_size"]:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} tokens, more than the shape's vocabulary")
    texts = tokenizer.batch_decode(make_prompts(workload, rows, len(tokenizer)))
    # The token ids the text path gives the engine, computed as it does (entrypoints/llm.py, connectors/prompts.py).
    ids = tokenizer(texts)["input_ids"]
    chat_ids = []
    if any(s.startswith("chat") for s in systems):
        chat_texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                    add_generation_prompt=True) for t in texts]
        chat_ids = tokenizer(chat_texts, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompt_tokens = {"ids": sum(map(len, ids)), "chat_ids": sum(map(len, chat_ids))}
    prompt_tokens.update(text=prompt_tokens["ids"], pandas=prompt_tokens["ids"], job=prompt_tokens["ids"],
                         chat=prompt_tokens["chat_ids"], chat_pandas=prompt_tokens["chat_ids"])
    instrument()
    runner = Runner(llm, texts, ids, chat_ids, params, Path(tempfile.mkdtemp(prefix="batchllm-text-path-")))
    start = time.perf_counter()
    for system in systems:
        runner.run(system, min(args.warmup_rows, rows))
    warmup_s = time.perf_counter() - start
    lengths = [len(x) for x in ids]
    print(f"{args.workload} {args.shape} on {device}: {rows} rows, prompt tokens {prompt_tokens['ids']} "
          f"({min(lengths)}..{max(lengths)} per row), {max_tokens} output tokens; load {load_s:.1f} s, "
          f"warm-up {warmup_s:.1f} s")

    runs: dict[str, list[dict]] = defaultdict(list)
    outputs: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        for system in systems:
            seconds, texts_out, output_tokens, phases = runner.run(system, rows)
            outputs[system] = texts_out
            total = (prompt_tokens[system] + output_tokens) / seconds
            runs[system].append({"seconds": round(seconds, 4), "output_tokens": output_tokens,
                                 "total_tok_s": round(total, 1), **({"phases_s": phases} if phases else {})})
            print(f"  repeat {repeat} {system:12} {seconds:8.3f} s  {total:10.1f} total tok/s")
    summary = summarize(runs, outputs)
    # A job pins its tokenizer's identity; a process computes it once per tokenizer, so the timed job runs reuse
    # the warm-up's. `batchllm run`, one job per process, pays it once more than they do:
    identity._definition_sha256.cache_clear()
    start = time.perf_counter()
    identity.tokenizer_identity(tokenizer)
    identity_s = time.perf_counter() - start
    print(f"a job's first tokenizer identity in a process (not in the job's times above): {identity_s * 1e3:.0f} ms")
    hw_name, hw_info = hardware(device)
    record = {"date": datetime.date.today().isoformat(), "git_sha": git_sha(), "shape": args.shape,
              "weights": "dummy", "prefix_caching": False, "tokenizer": str(tokenizer_dir), "device": device,
              "hardware": hw_info,
              "workload": {"name": args.workload, "rows": rows, "output_tokens": max_tokens,
                           "prompt_tokens": prompt_tokens["ids"], "chat_prompt_tokens": prompt_tokens["chat_ids"],
                           "prompt_len_range": [min(lengths), max(lengths)],
                           "prompts": f"{args.workload} random token ids decoded to text, re-encoded"},
              "systems": systems, "load_s": round(load_s, 2), "warmup_s": round(warmup_s, 2),
              "job_first_tokenizer_identity_s": round(identity_s, 4),
              "async_scheduling": llm.engine.async_scheduling, "runs": runs, "summary": summary}
    name = (f"{record['date']}-{args.workload}-r{rows}-o{max_tokens}-{args.shape}-{hw_name}-text-path-"
            f"{'-'.join(systems)}.json")
    print(f"wrote {save_record(name, record, args.out)}")


def summarize(runs: dict[str, list[dict]], outputs: dict[str, list[str]]) -> dict[str, dict]:
    """Best and mean tok/s per system, each text system's ratio to its peer and its generated texts equal to the
    peer's (a peer missing from `--systems` gives no ratio)."""
    best = {name: min(results, key=lambda r: r["seconds"]) for name, results in runs.items()}
    summary = {}
    print(f"\n{'system':12} {'best s':>8} {'best tok/s':>11} {'mean tok/s':>11}  ratio to peer; pandas phases (ms)")
    for name, results in runs.items():
        mean = sum(r["total_tok_s"] for r in results) / len(results)
        entry = summary[name] = {"best_s": best[name]["seconds"], "best_total_tok_s": best[name]["total_tok_s"],
                                 "mean_total_tok_s": round(mean, 1), "best_phases_s": best[name].get("phases_s")}
        peer = PEERS.get(name)
        ratio = ""
        if peer in best:
            entry[f"ratio_to_{peer}"] = round(best[name]["total_tok_s"] / best[peer]["total_tok_s"], 4)
            entry[f"rows_equal_to_{peer}"] = sum(a == b for a, b in zip(outputs[name], outputs[peer]))
            ratio = (f"{entry[f'ratio_to_{peer}']:.3f} x {peer} (texts equal {entry[f'rows_equal_to_{peer}']}/"
                     f"{len(outputs[name])})")
        phases = ", ".join(f"{k} {1e3 * v:.0f}" for k, v in (best[name].get("phases_s") or {}).items())
        print(f"{name:12} {best[name]['seconds']:>8.3f} {best[name]['total_tok_s']:>11.1f} {mean:>11.1f}  {ratio}"
              f"{'; ' + phases if phases else ''}")
    return summary


if __name__ == "__main__":
    main()
