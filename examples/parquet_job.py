"""A resumable Parquet job from Python: a directory of Parquet files in, Parquet shards out.

    python examples/parquet_job.py /tmp/batchllm-demo          # writes input and output under that folder
    python examples/parquet_job.py /tmp/batchllm-demo --rows 6 --max-tokens 8

Interrupt it (Ctrl-C) and run it again: finished shards are kept and the job resumes.
"""

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

import batchllm

TOPICS = ["volcanoes", "honey bees", "the moon", "tea", "bicycles", "glaciers", "owls", "chess", "rainbows", "bread"]


def write_input(directory: Path, rows: int) -> None:
    """Two Parquet files of one-line topics: a stand-in for your own data."""
    directory.mkdir(parents=True, exist_ok=True)
    topics = [TOPICS[i % len(TOPICS)] for i in range(rows)]
    half = (rows + 1) // 2
    for part, chunk in enumerate((range(half), range(half, rows))):
        table = pa.table({"id": list(chunk), "topic": [topics[i] for i in chunk]})
        pq.write_table(table, directory / f"part-{part}.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--rows", type=int, default=len(TOPICS))
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    inputs, outputs = args.workdir / "topics", args.workdir / "facts"
    if not inputs.exists():
        write_input(inputs, args.rows)
    result = batchllm.run_job(inputs, outputs, prompt_template="Tell me one surprising fact about {topic}.",
                              chat=True, max_tokens=args.max_tokens, temperature=0, rows_per_shard=4)
    print(f"{result.written_rows} rows written now, {result.resumed_rows} were already done, "
          f"{result.output_tokens} tokens in {result.seconds:.1f} s")

    table = ds.dataset(outputs, format="parquet").to_table().sort_by("id")  # the manifest (_manifest.jsonl) is skipped
    for row in table.select(["id", "topic", "generated_text", "error"]).to_pylist():
        print(f"{row['id']:>3} {row['topic']:<12} {row['error'] or row['generated_text'].strip()!r}")


if __name__ == "__main__":
    main()
