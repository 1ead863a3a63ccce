"""Structured outputs: throughput with a JSON schema per row against the same rows unconstrained, one run.

    python benchmarks/structured.py --shape llama3-8b --tokenizer DIR     # GPU, random bf16 weights, W1 200 rows
    python benchmarks/structured.py --shape smollm2-135m --tokenizer DIR
    python benchmarks/structured.py                                       # CPU, the real default model

Passes over the same prompts on one engine: unconstrained, one schema for every row, and ten schemas spread
over the rows; after each constrained pass, the same rows unconstrained with each row's max_tokens set to the
length its constrained run produced (ignore_eos), so both do the same work and "vs none" is the constraint's
cost alone. Reported per pass: output tokens per second, steps, the host time the engine spent filling grammar
bitmasks (per step), and the share of rows finishing with "stop" whose text validates with `jsonschema` (it
must be 100 %). With random weights the shape runs need a real tokenizer (`--tokenizer`: a
directory with tokenizer.json / tokenizer_config.json, e.g. the default model's); the prompts are W1's random
token ids and the model, knowing nothing, writes whatever the grammar allows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import time
from pathlib import Path

import jsonschema
from shapes import SHAPES, make_shape_dir
from throughput import WORKLOADS, git_sha, hardware, make_prompts, save_record

from batchllm import LLM, SamplingParams, StructuredOutputsParams
from batchllm.engine.structured.manager import StructuredOutputManager

_STR, _INT = {"type": "string", "maxLength": 24}, {"type": "integer", "minimum": 0, "maximum": 1000}
SCHEMAS = [
    {"type": "object", "properties": {"name": _STR, "age": _INT}, "required": ["name", "age"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["sentiment", "confidence"]},
    {"type": "object", "properties": {"street": _STR, "city": _STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["city", "zip"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 4}},
     "required": ["tags"]},
    {"type": "object", "properties": {"title": _STR, "date": {"type": "string", "format": "date"}},
     "required": ["title", "date"]},
    {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]}}, "required": ["label"]},
    {"type": "object", "properties": {"order": {"type": "object", "properties": {
        "id": _INT, "items": {"type": "array", "items": {"type": "object", "properties": {"sku": _STR, "qty": _INT},
                                                          "required": ["sku", "qty"]}, "maxItems": 3}},
        "required": ["id", "items"]}}, "required": ["order"]},
    {"type": "object", "properties": {"value": {"anyOf": [_INT, _STR]}}, "required": ["value"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": _STR}, "required": ["ok"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": _INT, "y": _INT}, "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
     "required": ["a", "b"]},
]
CPU_QUESTIONS = ["Alice is 31 and lives in Paris.", "The food was cold and the waiter rude.",
                 "Meet me at 5 Main St, Springfield 12345 on 2024-05-01.", "Buy 2 apples and 3 pears, order 17."]


def timed_bitmasks() -> dict[str, float]:
    """Wraps the engine's bitmask fill to add up its host time."""
    totals = {"seconds": 0.0, "calls": 0}
    fill = StructuredOutputManager.bitmask

    def wrapped(self, request_ids, requests):
        start = time.perf_counter()
        try:
            return fill(self, request_ids, requests)
        finally:
            totals["seconds"] += time.perf_counter() - start
            totals["calls"] += 1

    StructuredOutputManager.bitmask = wrapped
    return totals


def run_pass(llm: LLM, prompts, params: list[SamplingParams], schemas: list[dict | None], bitmasks, chat: bool):
    bitmasks.update(seconds=0.0, calls=0)
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False) if chat else llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    completions = [o.outputs[0] for o in outs]
    stopped = valid = 0
    for completion, schema in zip(completions, schemas):
        if schema is None or completion.finish_reason != "stop":
            continue
        stopped += 1
        try:
            jsonschema.validate(json.loads(completion.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    tokens = sum(len(c.token_ids) for c in completions)
    steps = llm.stats.num_steps
    return {"lengths": [max(len(c.token_ids), 1) for c in completions], "seconds": seconds, "output_tokens": tokens,
            "output_tok_s": tokens / seconds, "rows_s": len(outs) / seconds,
            "steps": steps, "bitmask_ms_per_step": 1e3 * bitmasks["seconds"] / max(steps, 1),
            "bitmask_calls": bitmasks["calls"], "rows_stopped": stopped, "rows_valid": valid,
            "finish_reasons": {r: sum(c.finish_reason == r for c in completions) for r in ("stop", "length", "error")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights (default: real model)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory for --shape runs")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.shape:
        if args.tokenizer is None:
            parser.error("--shape needs --tokenizer DIR (random weights, but the grammar needs a real vocabulary)")
        directory = make_shape_dir(args.shape)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (args.tokenizer / name).exists():
                shutil.copy(args.tokenizer / name, directory / name)
        rows, max_tokens = args.rows or 200, args.max_tokens or 128
        llm = LLM(model=str(directory), load_format="dummy")
        prompts = make_prompts(WORKLOADS["W1"], rows, SHAPES[args.shape]["vocab_size"])
        chat = False
    else:
        rows, max_tokens = args.rows or 16, args.max_tokens or 64
        llm = LLM()
        prompts = [[{"role": "user", "content": f"Extract the facts as JSON: {CPU_QUESTIONS[i % 4]}"}]
                   for i in range(rows)]
        chat = True
    base = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=bool(args.shape))
    passes = {"unconstrained": [None] * rows, "one schema": [SCHEMAS[0]] * rows,
              "10 schemas": [SCHEMAS[i % len(SCHEMAS)] for i in range(rows)]}
    bitmasks = timed_bitmasks()
    generate = llm.chat if chat else llm.generate
    # Warm-up on every prompt (prefill shapes, graphs) and on every schema (compiled once, cached).
    generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    warm = [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=s)) for s in SCHEMAS]
    generate([prompts[i % rows] for i in range(len(warm))], warm, use_tqdm=False)
    results = {}
    for name, schemas in passes.items():
        params = [base if s is None else dataclasses.replace(base, structured_outputs=StructuredOutputsParams(json=s))
                  for s in schemas]
        results[name] = run_pass(llm, prompts, params, schemas, bitmasks, chat)
        if name != "unconstrained":
            # The same rows unconstrained, each made to write exactly as many tokens as its constrained run did:
            # equal work, so the time ratio is the constraint's cost alone.
            lengths = results[name].pop("lengths")
            matched = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
            results[name + " (none)"] = run_pass(llm, prompts, matched, [None] * rows, bitmasks, chat)
        results[name].pop("lengths", None)
    device_name, device_info = hardware("cuda" if args.shape else "cpu")
    print(f"structured outputs, {args.shape or 'default model (real)'}, {rows} rows x {max_tokens}, {device_name}")
    print(f"{'pass':<21} {'out tok/s':>10} {'vs none':>8} {'rows/s':>8} {'steps':>6} {'mask ms/step':>13} valid/stop")
    for name, r in results.items():
        matched = results.get(name + " (none)")
        ratio = f"{r['output_tok_s'] / matched['output_tok_s']:>8.2f}" if matched else f"{'':>8}"
        print(f"{name:<21} {r['output_tok_s']:>10.0f} {ratio} {r['rows_s']:>8.2f} "
              f"{r['steps']:>6} {r['bitmask_ms_per_step']:>13.3f} {r['rows_valid']}/{r['rows_stopped']}")
    record = {"benchmark": "structured", "date": datetime.date.today().isoformat(), "git": git_sha(),
              "hardware": device_name, "hardware_info": device_info, "shape": args.shape or "smollm2-135m (real)",
              "rows": rows, "max_tokens": max_tokens, "results": results}
    shape = args.shape or "smollm2-135m-real"
    name = f"{record['date']}-structured-W1-r{rows}-o{max_tokens}-{shape}-{device_name}.json"
    print(save_record(name, record, args.out))


if __name__ == "__main__":
    main()
