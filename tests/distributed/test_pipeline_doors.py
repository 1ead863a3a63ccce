"""Pipeline parallelism through the other doors: `batchllm run --pipeline-parallel-size` on a Parquet table, an
OpenAI batch file and a pandas frame through `engine_kwargs`, `LLM.stream` (the loop the server and jobs step), and
the GPU placement of data-parallel replicas that each hold a pipeline.

The expected text is the single-process engine's (whose agreement with HF transformers is tests/e2e's subject).
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm import LLM, SamplingParams
from batchllm.connectors import engine_cache
from batchllm.connectors.replicas.devices import gpu_groups
from batchllm.entrypoints.cli.main import main
from tests.connectors.helpers import openai_batch_texts

MAX_NEW = 8  # enough steps for both stages to hold one in flight
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
TEXTS = [f"Describe, in one sentence, the {thing} of a small town." for thing in
         ("market", "school", "station", "harbour", "library")]
PP = {"pipeline_parallel_size": 2, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def plain_texts() -> list[str]:
    return [out.outputs[0].text for out in LLM(device="cpu").generate(TEXTS, GREEDY, use_tqdm=False)]


def _cached_engine_is_pipelined() -> bool:
    llm = engine_cache._cached[1]
    return llm.engine.pipelined and len(llm.runner.worker_pids) == 2


def test_the_cli_flag(plain_texts, tmp_path, capsys):
    pq.write_table(pa.table({"q": TEXTS}), tmp_path / "in.parquet")
    flags = ["--prompt-column", "q", "--max-tokens", str(MAX_NEW), "--ignore-eos", "--no-progress", "--device", "cpu"]
    source = str(tmp_path / "in.parquet")
    assert main(["run", source, str(tmp_path / "out"), *flags, "--pipeline-parallel-size", "2",
                 "--max-num-seqs", "4"]) == 0, capsys.readouterr().err
    assert pq.read_table(tmp_path / "out").to_pydict()["generated_text"] == plain_texts
    assert _cached_engine_is_pipelined()
    assert main(["run", source, str(tmp_path / "bad"), *flags, "--pipeline-parallel-size", "0"]) == 2
    assert "--pipeline-parallel-size must be an int >= 1, got 0" in capsys.readouterr().err


def test_an_openai_batch_file_a_pandas_frame_and_the_streaming_loop(plain_texts, tmp_path):
    """One pipelined engine (the engine cache's) serves the three doors; the streaming loop admits rows while the
    pipeline runs."""
    out = batchllm.generate(pd.DataFrame({"q": TEXTS}), prompt_column="q", engine_kwargs=dict(PP, device="cpu"),
                            max_tokens=MAX_NEW, temperature=0, ignore_eos=True, use_tqdm=False)
    assert out["generated_text"].tolist() == plain_texts
    assert _cached_engine_is_pipelined()
    assert openai_batch_texts(tmp_path, TEXTS, MAX_NEW, dict(PP, device="cpu")) == plain_texts
    llm = engine_cache._cached[1]
    try:
        results = dict(llm.stream(((i, text, GREEDY) for i, text in enumerate(TEXTS)), max_in_flight=3))
        assert [results[i].outputs[0].text for i in range(len(TEXTS))] == plain_texts
    finally:
        engine_cache.clear_engine_cache()
        llm.shutdown()


def test_data_parallel_replicas_each_take_a_pipeline_of_gpus():
    assert gpu_groups(2, 1, 4, None, pipeline_parallel_size=2) == ["0,1", "2,3"]
    assert gpu_groups(2, 2, 8, None, pipeline_parallel_size=2) == ["0,1,2,3", "4,5,6,7"]
    with pytest.raises(ValueError, match="data_parallel_size=2 x tensor_parallel_size=1 x pipeline_parallel_size=2 "
                                         "needs 4 GPUs, but 3 are visible"):
        gpu_groups(2, 1, 3, None, pipeline_parallel_size=2)
    assert gpu_groups(2, 1, 4, None, engines=2) == ["0,1", "2,3"]  # disaggregated: a prefill and a decode GPU each
