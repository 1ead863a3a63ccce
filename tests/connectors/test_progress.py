"""The progress bar's tokens/s: the figure left on screen covers the whole run, not its last refresh."""

from __future__ import annotations

from types import SimpleNamespace

from batchllm.connectors import progress


def test_the_final_rate_counts_every_token_of_the_run(monkeypatch, capsys):
    now = [0.0]
    monkeypatch.setattr(progress, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    bar = progress.RowProgress(total=2, enabled=True)
    now[0] = 1.0
    bar.update(1, output_tokens=1)  # refreshed: 1 token in 1 s
    now[0] = 1.2
    bar.update(1, output_tokens=26)  # within the refresh interval: not shown yet
    now[0] = 10.0
    bar.close()
    final_line = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "2/2" in final_line and "2.7 tok/s" in final_line  # 27 tokens in 10 s
