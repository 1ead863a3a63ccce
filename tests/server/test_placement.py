"""Where `batchllm serve` puts each model's engine process: its own GPUs when enough are visible, else a share of
their memory, or of the CPU's threads (values worked out by hand); two models under one name are refused."""

from __future__ import annotations

import pytest

from batchllm.entrypoints.server import placement
from batchllm.entrypoints.server.placement import plan_engines


@pytest.fixture
def gpus(monkeypatch):
    def visible(count: int, listed: str | None = None) -> None:
        monkeypatch.setattr(placement, "_cuda_device_count", lambda: count)
        if listed is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    return visible


def test_enough_gpus_give_each_model_its_own(gpus):
    gpus(4, "4,5,6,7")
    plans = plan_engines(2, {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8})
    assert [p.env for p in plans] == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert [p.engine_kwargs["gpu_memory_utilization"] for p in plans] == [0.8, 0.8]


def test_too_few_gpus_share_their_memory(gpus):
    gpus(1)
    plans = plan_engines(3, {})
    assert [p.env for p in plans] == [{}, {}, {}]
    assert [p.engine_kwargs["gpu_memory_utilization"] for p in plans] == [pytest.approx(0.3)] * 3


def test_one_model_keeps_its_flags_and_the_cpu_is_split(gpus, monkeypatch):
    gpus(0)
    assert plan_engines(1, {"gpu_memory_utilization": 0.5})[0].engine_kwargs == {"gpu_memory_utilization": 0.5}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert [p.num_threads for p in plan_engines(2, {"device": "cpu"})] == [2, 2]


def test_two_models_under_one_name_exit_2_before_any_engine_starts(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "batchllm", "serve", "--model", "a=/models/x", "--model",
                             "a=/models/y"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "--model names two models alike" in result.stderr, result.stderr


@pytest.mark.parametrize("text,parsed", [("chat=/models/llama", ("chat", "/models/llama")),
                                         ("/models/llama", (None, "/models/llama")),
                                         ("/data/a=b/model", (None, "/data/a=b/model")),
                                         ("=/models/x", (None, "=/models/x"))])
def test_a_model_flag_reads_as_a_name_and_a_path(text, parsed):
    from batchllm.entrypoints.cli.types import served_model

    assert served_model(text) == parsed
