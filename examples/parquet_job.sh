#!/usr/bin/env bash
# A resumable Parquet job from the command line.
#
#   bash examples/parquet_job.sh [WORKDIR]        # MAX_TOKENS=16 ROWS=6 bash examples/parquet_job.sh /tmp/x
#
# Kill the `batchllm run` below at any moment (Ctrl-C, or even kill -9) and run the same command again:
# finished shards are kept, the rest is generated, and every input row ends up exactly once in the output.
set -euo pipefail

WORKDIR=${1:-$(mktemp -d)}
MAX_TOKENS=${MAX_TOKENS:-48}
ROWS=${ROWS:-12}
PYTHON=${PYTHON:-python}

# Input: a Parquet file of questions (use your own file, directory or glob instead).
"$PYTHON" - "$WORKDIR/questions.parquet" "$ROWS" <<'PY'
import sys
import pyarrow as pa, pyarrow.parquet as pq
path, rows = sys.argv[1], int(sys.argv[2])
questions = [f"What is {i} + {i + 2}? Answer with a number." for i in range(rows)]
pq.write_table(pa.table({"id": list(range(rows)), "question": questions}), path)
PY

run() {
  batchllm run "$WORKDIR/questions.parquet" "$WORKDIR/answers" \
    --prompt-column question --chat --max-tokens "$MAX_TOKENS" --temperature 0 --rows-per-shard 4
}
run
run   # the same command again: everything is already done, nothing is generated

"$PYTHON" - "$WORKDIR/answers" <<'PY'
import sys
import pyarrow.dataset as ds
table = ds.dataset(sys.argv[1], format="parquet").to_table().sort_by("id")
for row in table.select(["id", "question", "generated_text"]).to_pylist():
    print(row["id"], row["question"], "->", row["generated_text"].strip())
PY
