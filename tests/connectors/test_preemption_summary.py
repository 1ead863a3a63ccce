"""Preemptions and the prompt tokens they made the engine recompute, on the progress bar and in a job's result."""

from __future__ import annotations

import batchllm
from batchllm.connectors import progress
from tests.connectors.jobs import write_parquet_input


def _final_line(capsys) -> str:
    return capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]


def test_the_bar_shows_preemptions_once_there_are_any(capsys):
    figures = [(0, 0)]
    bar = progress.RowProgress(total=2, enabled=True, preemptions=lambda: figures[0])
    bar.update(1, output_tokens=3)
    bar.close()
    assert "preempted" not in _final_line(capsys)
    bar = progress.RowProgress(total=2, enabled=True, preemptions=lambda: figures[0])
    figures[0] = (3, 40)
    bar.update(2, output_tokens=3)
    bar.close()
    assert "3 preempted (40 prompt tok recomputed)" in _final_line(capsys)


def test_a_job_reports_its_preemptions(tmp_path, tiny_llama_dir):
    """4 rows of ~12 prompt tokens with 20 forced output tokens, in 4 blocks of 16: admitted optimistically they
    outgrow the pool and are preempted; admitted KV-aware (2 blocks each to the end) they are not. The session's tiny
Llama (the default model's tokenizer: the same prompt tokens) does the steps: the point is the admission's count."""
    write_parquet_input(tmp_path / "in", [4])
    results = {}
    for policy in ("optimistic", "kv_aware"):
        # Its own engines (llm=), not the process-wide cache: the package's `llm` fixture holds the cached one.
        llm = batchllm.LLM(tiny_llama_dir, device="cpu", num_kv_blocks=4, enable_prefix_caching=False,
                           admission_policy=policy)
        results[policy] = batchllm.run_job(tmp_path / "in", tmp_path / policy, prompt_column="q", use_tqdm=False,
                                           max_tokens=20, temperature=0, ignore_eos=True, llm=llm)
    optimistic, kv_aware = results["optimistic"], results["kv_aware"]
    assert optimistic.written_rows == kv_aware.written_rows == 4
    assert optimistic.preemptions > 0 and optimistic.recomputed_tokens > 0, optimistic
    assert (kv_aware.preemptions, kv_aware.recomputed_tokens) == (0, 0), kv_aware
