"""N-gram speculative decoding against none, on the CPU with the real default model, a copy-heavy workload.

    python benchmarks/speculative.py --rows 1 8 32 --max-tokens 128

Workload: "Correct the spelling of: <paragraph>" and "Extract every sentence that mentions X from: <text>",
chat-templated, greedy, each row writing up to `--max-tokens` tokens. Per row count, both engines run the same
prompts one after another in one process (warm-up first, best of two runs each); reported: output tok/s of each, the
ratio, the
acceptance rate and the outputs' equality. Results go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from batchllm import LLM, SamplingParams

PARAGRAPH = ("The quick brown fox jumpd over the lazy dog. It was a sunny day and the birds were singng in the "
             "trees. The farmer walked to the feild to check on his crops, which were growing very well this yeer. "
             "His wife was baking bread in the kitchen, and the smel of it filled the hole house. After lunch they "
             "went to the market in the vilage to sell eggs, milk and vegetables to their neighbours.")
TEXT = ("The river flows through the old town. Many tourists visit the river every summer. The bakery opens at "
        "six. Fishermen sell their catch by the river in the morning. The museum is closed on Mondays.")


def prompts(llm: LLM, rows: int) -> list[str]:
    tasks = [f"Correct the spelling of: {PARAGRAPH}", f"Extract every sentence that mentions the river from: {TEXT}"]
    chats = [[{"role": "user", "content": tasks[i % 2]}] for i in range(rows)]
    return [llm.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]


def timed(llm: LLM, texts: list[str], params: SamplingParams, repeats: int = 2) -> tuple[float, list[list[int]]]:
    """Output tok/s, the best of `repeats` runs (a shared CPU's noise only ever slows a run down)."""
    llm.generate(texts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    seconds = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(texts, params, use_tqdm=False)
        seconds = min(seconds, time.perf_counter() - start)
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    off, on = LLM(), LLM(speculative_config=spec)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    records = []
    for rows in args.rows:
        texts = prompts(off, rows)
        off_tps, off_tokens = timed(off, texts, params)
        on_tps, on_tokens = timed(on, texts, params)
        stats = on.stats  # of the last call: the timed one
        record = dict(rows=rows, off_tok_s=round(off_tps, 1), ngram_tok_s=round(on_tps, 1),
                      speedup=round(on_tps / off_tps, 2), acceptance=round(stats.draft_acceptance_rate, 3),
                      drafted=stats.num_draft_tokens, per_position=[round(a, 3) for a in
                                                                    stats.draft_acceptance_per_position],
                      same_outputs=on_tokens == off_tokens)
        records.append(record)
        print(json.dumps(record), flush=True)
    out = Path(__file__).parent / "results" / f"{datetime.date.today()}-spec-ngram-smollm2-135m-cpu.json"
    out.write_text(json.dumps(dict(workload="copy-heavy (spelling, extraction), greedy", k=args.k,
                                   max_tokens=args.max_tokens, hardware="2-core CPU", records=records), indent=1))
    print("| rows | off tok/s | ngram tok/s | speedup | acceptance |")
    for r in records:
        print(f"| {r['rows']} | {r['off_tok_s']} | {r['ngram_tok_s']} | {r['speedup']}x | {r['acceptance']} |")


if __name__ == "__main__":
    main()
