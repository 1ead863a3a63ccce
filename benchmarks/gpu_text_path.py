"""The text path's cost: `batchllm.generate` on a pandas column of text against `LLM.generate` on the same
prompts as token ids, one engine, one process. The issue's contract: within 10 % on W4, smollm2-135m, GPU.

    python benchmarks/gpu_text_path.py --tokenizer DIR --out $OUT        # GPU: 5000 rows x 16 tokens
    python benchmarks/gpu_text_path.py --rows 64                         # CPU check (default model's tokenizer)

Model: the smollm2-135m shape with random weights (`load_format="dummy"`) and a real tokenizer: the files
of `--tokenizer DIR` (default: the converted default model's directory, `resolve_model_path(None)`) are
copied next to the shape's config.json. Prompts: W4's random token ids (`make_prompts`, 20-60 per row)
decoded to text with that tokenizer. The ids the text is compared against are that text's own tokenization
(what the text path hands the engine), so both paths run identical prompts; the re-encoded lengths are in
the record (`prompt_len_range`).

Systems, on one LLM (engine defaults except `enable_prefix_caching=False`: every run repeats the same
prompts, and W4 shares no prefixes), warmed up on the first 64 rows of each, then run alternately
`--repeats` (2) times:

- `ids`: `llm.generate(token_id_lists, params)`;
- `text`: `batchllm.generate(pd.DataFrame({"q": texts}), prompt_column="q", llm=llm, sampling_params=params)`;
- `chat_ids`: `llm.generate` on the chat-rendered prompts' ids (SmolLM2's template adds its system prompt);
- `chat_text`: the same `batchllm.generate` with `chat=True`.

params: max_tokens=16, temperature=0, ignore_eos=True. tok/s count each system's own prompt tokens plus the
output tokens. The text/ids ratio compares best runs (`text` / `ids`, `chat_text` / `chat_ids`). The text path's
time is split by wrapping the connector's phases in this process (nothing in the library changes): `read`
(DataFrame -> lists), `render` (chat template), `tokenize` (`PromptEncoder.encode`; for tables of
`mapper.STREAM_MIN_ROWS` rows or more on a worker thread, overlapping the engine), `outputs` (`output_arrays`),
`attach` (lists -> DataFrame), and the rest (the wall time outside every phase but `tokenize`): the engine
plus the per-row loop of `map_columns`.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record

import batchllm
import batchllm.connectors.prompts as prompts_module
import batchllm.connectors.tables.mapper as mapper
import batchllm.connectors.tables.pandas as pandas_connector
from batchllm import LLM, SamplingParams
from batchllm.model.loader import resolve_model_path

SHAPE = "smollm2-135m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
PHASES: dict[str, float] = defaultdict(float)  # seconds of the current text-path call, by phase


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
    if hasattr(mapper, "render_rows"):  # tokenizing happens apart from rendering (on a worker thread for big tables)
        mapper.render_rows = timed("render", mapper.render_rows)
    else:  # an older package: rendering and tokenizing in one call
        mapper.encode_rows = timed("encode_rows", mapper.encode_rows)
    mapper.output_arrays = timed("outputs", mapper.output_arrays)
    prompts_module.PromptEncoder.encode = timed("tokenize", prompts_module.PromptEncoder.encode)


def model_dir(tokenizer_dir: Path) -> Path:
    directory = make_shape_dir(SHAPE)
    copied = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if "tokenizer.json" not in copied:
        raise SystemExit(f"{tokenizer_dir} has no tokenizer.json")
    for name in copied:
        shutil.copy(tokenizer_dir / name, directory / name)
    print(f"shape dir {directory}: {SHAPE} config, tokenizer files from {tokenizer_dir}: {', '.join(copied)}")
    return directory


def run_ids(llm: LLM, ids: list[list[int]], params: SamplingParams) -> tuple[float, list[str], int]:
    start = time.perf_counter()
    outs = llm.generate(ids, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [o.outputs[0].text for o in outs], sum(len(o.outputs[0].token_ids) for o in outs)


def run_text(llm: LLM, texts: list[str], params: SamplingParams, chat: bool) -> tuple[float, list[str], int, dict]:
    frame = pd.DataFrame({"q": texts})
    PHASES.clear()
    start = time.perf_counter()
    result = batchllm.generate(frame, prompt_column="q", chat=chat, llm=llm, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    phases = dict(PHASES)
    if "encode_rows" in phases:
        phases["render"] = phases.pop("encode_rows") - phases.get("tokenize", 0.0)
    # Tokenizing may overlap the engine (worker thread): the rest is the wall time outside the other phases.
    phases["engine_and_loop"] = seconds - sum(v for k, v in phases.items() if k != "tokenize")
    return seconds, result["generated_text"].tolist(), int(result["completion_tokens"].sum()), phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=WORKLOADS["W4"].rows)
    parser.add_argument("--max-tokens", type=int, default=WORKLOADS["W4"].output_tokens)
    parser.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json etc. (default: the default model's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="also copy the JSON record here (e.g. the device tool's $OUT)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer_dir = args.tokenizer or resolve_model_path(None)
    directory = model_dir(Path(tokenizer_dir))
    start = time.perf_counter()
    # No prefix caching: every system runs the same prompts, and a later run must not reuse an earlier one's K/V.
    llm = LLM(model=str(directory), load_format="dummy", enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    tokenizer = llm.tokenizer
    if len(tokenizer) > SHAPES[SHAPE]["vocab_size"]:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} tokens, more than the shape's vocabulary")
    random_ids = make_prompts(WORKLOADS["W4"], args.rows, SHAPES[SHAPE]["vocab_size"])
    texts = tokenizer.batch_decode(random_ids)
    # The token ids the text path gives the engine, computed as it does (connectors/prompts.py).
    ids = tokenizer(texts)["input_ids"]
    chat_texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                add_generation_prompt=True) for t in texts]
    chat_ids = tokenizer(chat_texts, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    systems = {"ids": lambda n: run_ids(llm, ids[:n], params),
               "text": lambda n: run_text(llm, texts[:n], params, chat=False),
               "chat_ids": lambda n: run_ids(llm, chat_ids[:n], params),
               "chat_text": lambda n: run_text(llm, texts[:n], params, chat=True)}
    prompt_tokens = {"ids": sum(map(len, ids)), "chat_ids": sum(map(len, chat_ids))}
    prompt_tokens.update(text=prompt_tokens["ids"], chat_text=prompt_tokens["chat_ids"])
    instrument()
    start = time.perf_counter()
    for run in systems.values():
        run(min(64, args.rows))
    warmup_s = time.perf_counter() - start
    print(f"W4 {SHAPE} on {device}: {args.rows} rows, prompt tokens {prompt_tokens['ids']} "
          f"(chat {prompt_tokens['chat_ids']}), {args.max_tokens} output tokens; load {load_s:.1f} s, "
          f"warm-up {warmup_s:.1f} s")

    runs: dict[str, list[dict]] = defaultdict(list)
    outputs: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        for name, run in systems.items():
            seconds, texts_out, output_tokens, *phases = run(args.rows)
            outputs[name] = texts_out
            total = (prompt_tokens[name] + output_tokens) / seconds
            runs[name].append({"seconds": round(seconds, 4), "output_tokens": output_tokens,
                               "total_tok_s": round(total, 1), **({"phases_s": phases[0]} if phases else {})})
            print(f"  repeat {repeat} {name:10} {seconds:7.3f} s  {total:10.1f} total tok/s")

    summary = {}
    print(f"\n{'system':10} {'best s':>8} {'best tok/s':>11} {'mean tok/s':>11} {'vs ids':>7}  text-path phases "
          f"of the best run (ms)")
    for name, results in runs.items():
        best = min(results, key=lambda r: r["seconds"])
        peer = "ids" if name in ("ids", "text") else "chat_ids"
        ratio = best["total_tok_s"] / min(runs[peer], key=lambda r: r["seconds"])["total_tok_s"]
        mean = sum(r["total_tok_s"] for r in results) / len(results)
        summary[name] = {"best_s": best["seconds"], "best_total_tok_s": best["total_tok_s"],
                         "mean_total_tok_s": round(mean, 1), "ratio_to_" + peer: round(ratio, 4),
                         "best_phases_s": best.get("phases_s")}
        phases = ", ".join(f"{k} {1e3 * v:.0f}" for k, v in (best.get("phases_s") or {}).items())
        print(f"{name:10} {best['seconds']:>8.3f} {best['total_tok_s']:>11.1f} {mean:>11.1f} {ratio:>7.3f}  {phases}")
    for name, peer in (("text", "ids"), ("chat_text", "chat_ids")):
        extra = summary[name]["best_s"] - summary[peer]["best_s"]
        phases = summary[name]["best_phases_s"]
        host = sum(v for k, v in phases.items() if k != "engine_and_loop")
        equal = sum(a == b for a, b in zip(outputs[name], outputs[peer]))
        summary[name].update(extra_s=round(extra, 4), connector_s=round(host, 4), rows_equal_to_ids=equal)
        verdict = "within" if summary[name]["ratio_to_" + peer] >= 0.9 else "NOT within"
        loop = phases["engine_and_loop"] - summary[peer]["best_s"]
        print(f"{name} vs {peer}: {extra * 1e3:+.0f} ms ({verdict} 10 %), of which connector phases "
              f"{host * 1e3:.0f} ms and engine + loop {loop * 1e3:+.0f} ms; generated texts equal: {equal}/{args.rows}")

    hw_name, hw_info = hardware(device)
    lengths = [len(x) for x in ids]
    record = {"date": datetime.date.today().isoformat(), "git_sha": git_sha(), "shape": SHAPE,
              "weights": "dummy", "prefix_caching": False, "tokenizer": str(tokenizer_dir), "device": device,
              "hardware": hw_info,
              "workload": {"name": "W4", "rows": args.rows, "output_tokens": args.max_tokens,
                           "prompt_tokens": prompt_tokens["ids"], "chat_prompt_tokens": prompt_tokens["chat_ids"],
                           "prompt_len_range": [min(lengths), max(lengths)],
                           "prompts": "W4 random token ids decoded to text, re-encoded"},
              "load_s": round(load_s, 2), "warmup_s": round(warmup_s, 2), "async_scheduling":
              llm.engine.async_scheduling, "runs": runs, "summary": summary}
    name = f"{record['date']}-W4-r{args.rows}-o{args.max_tokens}-{SHAPE}-{hw_name}-text-vs-ids.json"
    print(f"wrote {save_record(name, record, args.out)}")


if __name__ == "__main__":
    main()
