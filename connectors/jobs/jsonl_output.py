"""The OpenAI-batch job's output file: regions of response lines, and what a resumed job trusts of them.

The output is a sequence of regions, each recorded in the manifest in file order with its size and
SHA-256: the lines of a completed shard, or a checkpoint of an unfinished one (some of its finished rows,
`flush_seconds`). A region's lines are its record's row offsets, in order. Only appends touch the file;
a region is recorded once it is fsynced.

On resume every recorded region is verified. At the first one that is damaged (or not where the one
before it ended), the file is cut back to the end of the last good region, the records from there on are
dropped, with a warning, and their rows are redone: the shards after the damage, minus what good
regions hold. Without damage the file is cut back to the last recorded end, dropping lines a kill left
unrecorded. Either way every line in the file is recorded exactly once.

`retry_errors`: the file is rewritten (atomically, then the manifest) without the error lines; the
shards that lost lines become unfinished, so exactly their failed rows run again and are appended.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from batchllm.connectors.jobs.atomic import naming_path, write_atomically
from batchllm.connectors.jobs.job import ResumeState
from batchllm.connectors.jobs.manifest import Manifest, ShardRecord, to_ranges
from batchllm.connectors.jobs.openai_batch import EMBEDDINGS_URL, Envelope, parse_envelope, response_line
from batchllm.connectors.results import RowOutcome


class JsonlSink:
    def __init__(self, path: Path, manifest: Manifest, model_name: str, retry_errors: bool,
                 adapter_names: frozenset[str] = frozenset()) -> None:
        self.path = path
        self.manifest = manifest
        self.model_name = model_name
        self.adapter_names = adapter_names  # a response names the adapter its request's `model` chose
        self._end = self._cut_back_to_verified()
        if retry_errors and any(r.error_rows for r in manifest.records):
            self._end = self._drop_error_lines()
        done = {r.index for r in manifest.records if r.complete}
        saved: dict[int, set[int]] = {}
        for record in manifest.records:
            if record.index not in done:
                saved.setdefault(record.index, set()).update(record.offsets)
        self.resume = ResumeState(frozenset(done), {i: frozenset(rows) for i, rows in saved.items()},
                                  sum(r.rows for r in manifest.records))

    def write(self, shard: int, rows: pa.Table, outcomes: list[RowOutcome], offsets: list[int],
              complete: bool) -> None:
        columns = rows.to_pydict()
        # Only an embedding's answer reads its body again (its encoding_format): the others are not parsed twice.
        bodies = [parse_envelope(raw).body if url == EMBEDDINGS_URL else None
                  for url, raw in zip(columns["url"], columns["request"])]
        lines = [response_line(line, Envelope(custom_id, url, body), outcome,
                               model if model in self.adapter_names else self.model_name)
                 for line, custom_id, url, model, body, outcome in zip(columns["line"], columns["custom_id"],
                                                                       columns["url"], columns["model"], bodies,
                                                                       outcomes)]
        data = "".join(line + "\n" for line in lines).encode()
        if data:
            with naming_path(self.path), open(self.path, "ab") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        self._end += len(data)
        # Error lines (a note on an answered row, e.g. a constrained one cut short, is no error line).
        self.manifest.record(ShardRecord(shard, len(outcomes), sum(o.failed for o in outcomes),
                                         sum(o.completion_tokens for o in outcomes), to_ranges(offsets), complete,
                                         len(data), hashlib.sha256(data).hexdigest(), end_offset=self._end))

    def _cut_back_to_verified(self) -> int:
        records = self.manifest.records
        size = self.path.stat().st_size if self.path.exists() else 0
        good, end, problem = 0, 0, None
        with naming_path(self.path), open(self.path, "ab+") as file:  # created when missing: every region is damaged
            for record in records:
                problem = _region_problem(file, record, end, size)
                if problem is not None:
                    break
                good, end = good + 1, record.end_offset
            if problem is not None:
                print(f"batchllm: warning: {self.path.name} is damaged from byte {end} (the lines of shard "
                      f"{records[good].index}: {problem}): cutting it back to {end} bytes and redoing the rows "
                      f"after it", file=sys.stderr, flush=True)
                self.manifest.rewrite(records[:good])
            file.truncate(end)  # also drops lines whose record a kill prevented
            os.fsync(file.fileno())
        return end

    def _drop_error_lines(self) -> int:
        records = self.manifest.records
        reopened = {r.index for r in records if r.error_rows}  # every region of theirs is now a checkpoint
        kept: list[ShardRecord] = []

        def rewrite(target: BinaryIO) -> None:
            with open(self.path, "rb") as source:
                for record in records:
                    source.seek(record.end_offset - record.bytes)
                    data = source.read(record.bytes)
                    if record.error_rows:
                        record, data = _without_errors(record, data)
                        if not record.rows:
                            continue
                    target.write(data)
                    end = (kept[-1].end_offset if kept else 0) + len(data)
                    kept.append(dataclasses.replace(record, end_offset=end,
                                                    complete=record.complete and record.index not in reopened))

        write_atomically(self.path, rewrite)
        # A kill between the two renames leaves regions that do not match: the next resume redoes from there.
        self.manifest.rewrite(kept)
        return kept[-1].end_offset if kept else 0


def _region_problem(file: BinaryIO, record: ShardRecord, expected_start: int, size: int) -> str | None:
    start = record.end_offset - record.bytes
    if start != expected_start:
        return f"recorded at byte {start}, where the region before it ends at {expected_start}"
    if record.end_offset > size:
        return f"they end at byte {record.end_offset}, the file at {size}"
    file.seek(start)
    digest, left = hashlib.sha256(), record.bytes
    while left:
        chunk = file.read(min(left, 1 << 20))
        digest.update(chunk)
        left -= len(chunk)
    return None if digest.hexdigest() == record.sha256 else "their SHA-256 differs from the manifest's"


def _without_errors(record: ShardRecord, data: bytes) -> tuple[ShardRecord, bytes]:
    """The region's lines that answered their request, as a checkpoint region of its own."""
    lines = [line + b"\n" for line in data.split(b"\n")[:-1]]
    answers = [(offset, line, json.loads(line)) for offset, line in zip(record.offsets, lines)]
    good = [(offset, line, answer) for offset, line, answer in answers if answer["error"] is None]
    kept = b"".join(line for _, line, _ in good)
    return ShardRecord(record.index, len(good), 0, sum(_completion_tokens(answer) for _, _, answer in good),
                       to_ranges(offset for offset, _, _ in good), False, len(kept),
                       hashlib.sha256(kept).hexdigest(), end_offset=None), kept


def _completion_tokens(answer: dict[str, Any]) -> int:
    return answer["response"]["body"]["usage"].get("completion_tokens", 0)  # an embedding makes none
