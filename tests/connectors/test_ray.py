"""`batchllm.ray` on a local 2-CPU Ray cluster with the real default model: Ray Data's map_batches with
`LLMPredictor` gives, row for row, what `batchllm.generate` gives in this process (the independent reference),
bad rows included, for pyarrow, pandas and numpy batches; `batchllm.ray.generate` wires replicas, GPUs and
batch sizes and refuses bad arguments before any actor starts."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

import batchllm
import batchllm.ray
from batchllm.ray import LLMPredictor
from tests.connectors.helpers import GREEDY

GOOD = ["The capital of France is", "Two plus two equals", "The color of the sky is", "Once upon a time"]
BATCH_SIZE = 5  # several batches per replica, the last one short


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    sigterm = signal.getsignal(signal.SIGTERM)
    # Ray puts the driver's working directory on its workers' sys.path: from the repo root, its kernels/ folder
    # would shadow HF's `kernels` package, which transformers imports.
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray-driver"))
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False,
             object_store_memory=256 * 1024**2)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()
    os.chdir(cwd)
    signal.signal(signal.SIGTERM, sigterm)  # ray.init installs its own and leaves it behind


@pytest.fixture(scope="module")
def table(llm):
    # Needs `llm`: the default model is converted in this process before any actor loads it.
    over_long = "word " * (llm.max_model_len + 10)
    prompts = [GOOD[0], None, GOOD[1], "", GOOD[2], over_long, GOOD[3], None] * 2
    return pa.table({"id": list(range(len(prompts))), "q": prompts})


@pytest.fixture(scope="module")
def expected(llm, table):
    return batchllm.generate(table, prompt_column="q", use_tqdm=False, **GREEDY)


@pytest.fixture(scope="module")
def ray_output(cluster, table):
    ds = batchllm.ray.generate(ray.data.from_arrow(table), prompt_column="q", batch_size=BATCH_SIZE, **GREEDY)
    assert isinstance(ds, ray.data.Dataset)
    return ds.materialize()  # run once; the tests below read the same result


def by_id(table: pa.Table) -> pa.Table:
    return table.sort_by("id")  # Ray Data does not promise the input's order


def test_generate_returns_a_dataset_equal_to_the_map_operator(ray_output, expected):
    out = by_id(pa.concat_tables(ray.get(ray_output.to_arrow_refs())))
    assert out.equals(expected)  # same columns, types, texts, token counts and per-row errors
    errors = out.column("error").to_pylist()
    assert sum(error is not None for error in errors) == 8 and out.column("generated_text").null_count == 8


def test_write_parquet_round_trips(ray_output, expected, tmp_path):
    ray_output.write_parquet(str(tmp_path / "out"))
    assert by_id(pq.read_table(tmp_path / "out")).equals(expected)


def test_pandas_batches_on_two_replicas_with_mixed_types(cluster, llm, table):
    frame = table.to_pandas()
    frame["q"] = frame["q"].astype(object)
    frame.loc[3, "q"] = 42  # a non-string prompt: only an object column can hold it
    reference = batchllm.generate(frame, prompt_column="q", output_column="answer", use_tqdm=False, **GREEDY)

    blocks = [frame.iloc[start:start + 4] for start in range(0, len(frame), 4)]  # work for both replicas
    ds = ray.data.from_pandas(blocks).map_batches(
        LLMPredictor, fn_constructor_kwargs={"prompt_column": "q", "output_column": "answer", **GREEDY},
        compute=ray.data.ActorPoolStrategy(size=2), batch_size=BATCH_SIZE, batch_format="pandas")
    out = ds.to_pandas().sort_values("id").reset_index(drop=True)

    columns = ["answer", "answer_finish_reason", "answer_prompt_tokens", "answer_completion_tokens", "answer_error"]
    assert list(out.columns) == ["id", "q", *columns]
    for column in columns:
        assert plain(out[column]) == plain(reference[column]), column
    assert out.answer_error[3] == "prompt column 'q' must be a string, got int"


def test_numpy_batches_come_back_as_numpy(llm, table, expected):
    predictor = LLMPredictor(prompt_column="q", **GREEDY)  # in this process: reuses the cached engine
    batch = {"id": table.column("id").to_numpy(), "q": np.array(table.column("q").to_pylist(), dtype=object)}
    out = predictor(batch)
    assert out["id"] is batch["id"] and out["q"] is batch["q"]
    assert out["generated_text"].tolist() == expected.column("generated_text").to_pylist()
    assert out["error"].tolist() == expected.column("error").to_pylist()
    # A null count comes back as NaN in a float array: how Ray itself hands nullable ints to numpy batches.
    assert plain(out["completion_tokens"]) == expected.column("completion_tokens").to_pylist()


def plain(column) -> list:
    return [None if pd.isna(value) else value for value in column]  # NA, NaN and None all mean missing


class RecordingDataset:
    """Stands in for a Ray Dataset to see what `batchllm.ray.generate` asks of map_batches."""

    def map_batches(self, fn, **kwargs):
        return fn, kwargs


def test_generate_wires_replicas_batch_size_and_gpus(cluster, monkeypatch):
    fn, kwargs = batchllm.ray.generate(RecordingDataset(), prompt_column="q", concurrency=3, max_tokens=8)
    assert fn is LLMPredictor and kwargs["batch_format"] == "pyarrow"
    assert kwargs["fn_constructor_kwargs"] == {"prompt_column": "q", "max_tokens": 8}
    assert kwargs["compute"].min_size == kwargs["compute"].max_size == 3
    assert kwargs["batch_size"] == 4 * 256 and kwargs["num_gpus"] == 0  # this cluster has no GPUs

    tensor_parallel = {"tensor_parallel_size": 2, "max_num_seqs": 64}
    monkeypatch.setattr(batchllm.ray, "_cluster_gpus", lambda: 8)
    _, kwargs = batchllm.ray.generate(RecordingDataset(), prompt_column="q", engine_kwargs=tensor_parallel)
    assert kwargs["num_gpus"] == 2 and kwargs["batch_size"] == 4 * 64
    _, kwargs = batchllm.ray.generate(RecordingDataset(), prompt_column="q", num_gpus_per_replica=1, batch_size=7)
    assert kwargs["num_gpus"] == 1 and kwargs["batch_size"] == 7


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"concurrency": 0}, ValueError, "concurrency must be an int >= 1"),
    ({"batch_size": "64"}, ValueError, "batch_size must be an int >= 1"),
    ({"num_gpus_per_replica": -1}, ValueError, "num_gpus_per_replica must be a number >= 0"),
    ({"num_gpus_per_replica": 1, "engine_kwargs": {"tensor_parallel_size": 2}}, ValueError, "needs 2 GPUs"),
    ({"engine_kwargs": {"tensor_parallel_size": 0}}, ValueError, "tensor_parallel_size must be an int >= 1"),
    ({"data_parallel_size": 2}, ValueError, "concurrency=N"),
    ({"llm": object()}, ValueError, "one engine per Ray actor"),
    ({"max_tokenz": 4}, TypeError, "unknown option 'max_tokenz'"),
    ({"temperature": -1}, ValueError, "temperature"),
    ({"messages_column": "m"}, ValueError, "exactly one of"),
])
def test_generate_refuses_bad_arguments_before_running(cluster, arguments, error, message):
    arguments = {"prompt_column": "q", **arguments}
    with pytest.raises(error, match=message):
        batchllm.ray.generate(RecordingDataset(), **arguments)


def test_predictor_fails_at_construction_and_accepts_data_parallel_one(llm):
    with pytest.raises(ValueError, match="temperature"):
        LLMPredictor(prompt_column="q", temperature=-1)
    with pytest.raises(ValueError, match="concurrency=N"):
        LLMPredictor(prompt_column="q", engine_kwargs={"data_parallel_size": 4})
    predictor = LLMPredictor(prompt_column="q", data_parallel_size=1, **GREEDY)
    assert predictor.llm is llm  # the process's cached engine: built once per actor


def test_import_batchllm_does_not_need_ray(monkeypatch):
    code = "import sys, batchllm; assert 'ray' not in sys.modules and 'batchllm.ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    monkeypatch.delitem(sys.modules, "batchllm.ray")
    with pytest.raises(ImportError, match=r"pip install 'batchllm\[ray\]'"):
        importlib.import_module("batchllm.ray")
