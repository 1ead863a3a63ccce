"""The host KV tier (`swap_space`, `preemption_mode="swap"`) through every door: the CLI flags on a Parquet table
with two data-parallel replicas and in-process, an OpenAI batch file and a pandas frame through `engine_kwargs`, the
asynchronous loop, and tensor parallelism (each rank swaps its share of the KV heads).

Swapping changes no output: the expected text is the same engine's without a host tier (whose agreement with HF
transformers is tests/e2e/test_kv_tiers.py's subject), and each door checks from the engine's stats that it swapped.
The doors' point is the options reaching the engines, not the weights: they run the session's tiny random Llama
(tests/conftest.py), whose tokenizer is the default model's, so the rows preempt as they would on it.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm import LLM, SamplingParams
from batchllm.connectors import engine_cache
from batchllm.entrypoints.cli.main import main
from tests.distributed.test_tensor_parallel import SHAPES, engine, prompts, write_checkpoint
from tests.e2e.doors import batch_file_texts

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
TEXTS = [f"Tell me, in a few sentences, why the {thing} matters to the people who live near it." for thing in
         ("river", "forest", "mountain", "harbour", "railway", "market")]
# Six rows of ~45 tokens in 8 blocks of 16: the newest rows are preempted as the oldest grow, and swapped.
SWAP = {"num_kv_blocks": 8, "swap_space": 0.05, "preemption_mode": "swap", "admission_policy": "optimistic"}
SWAP_FLAGS = ["--num-kv-blocks", "8", "--swap-space", "0.05", "--preemption-mode", "swap", "--admission-policy",
              "optimistic"]


@pytest.fixture(scope="module")
def plain_texts(tiny) -> list[str]:
    return [out.outputs[0].text for out in LLM(tiny).generate(TEXTS, GREEDY, use_tqdm=False)]


def cached_engine_swapped() -> bool:
    llm = engine_cache._cached[1]
    return llm.engine.scheduler.config.preemption_mode == "swap" and llm.stats.swap_preemptions > 0


def test_the_cli_flags_in_process_and_on_two_replicas(tiny, plain_texts, tmp_path, capsys):
    pq.write_table(pa.table({"q": TEXTS}), tmp_path / "in.parquet")
    run = ["run", str(tmp_path / "in.parquet"), "--prompt-column", "q", "--model", tiny, "--max-tokens", str(MAX_NEW),
           "--ignore-eos", "--no-progress", *SWAP_FLAGS]
    assert main([run[0], run[1], str(tmp_path / "one"), *run[2:]]) == 0, capsys.readouterr().err
    assert pq.read_table(tmp_path / "one").to_pydict()["generated_text"] == plain_texts
    assert cached_engine_swapped()
    assert main([run[0], run[1], str(tmp_path / "two"), *run[2:], "--rows-per-shard", "3",
                 "--data-parallel", "2"]) == 0, capsys.readouterr().err
    assert pq.read_table(tmp_path / "two").to_pydict()["generated_text"] == plain_texts
    with pytest.raises(SystemExit) as exit_info:
        main([run[0], run[1], str(tmp_path / "bad"), "--prompt-column", "q", "--preemption-mode", "disk"])
    assert exit_info.value.code == 2 and "--preemption-mode: invalid choice: 'disk'" in capsys.readouterr().err
    assert main([run[0], run[1], str(tmp_path / "bad"), "--prompt-column", "q", "--preemption-mode", "swap"]) == 2
    assert "--preemption-mode 'swap' needs --swap-space > 0" in capsys.readouterr().err


def test_an_openai_batch_file_and_a_pandas_frame(tiny, plain_texts, tmp_path):
    out = batchllm.generate(pd.DataFrame({"q": TEXTS}), prompt_column="q", model=tiny, engine_kwargs=SWAP,
                            max_tokens=MAX_NEW, temperature=0, ignore_eos=True, use_tqdm=False)
    assert out["generated_text"].tolist() == plain_texts
    assert cached_engine_swapped()
    assert batch_file_texts(tmp_path, tiny, TEXTS, SWAP, max_tokens=MAX_NEW, temperature=0, ignore_eos=True) \
        == plain_texts
    assert cached_engine_swapped()


def test_the_asynchronous_loop_swaps_a_request_whose_token_is_in_flight(tiny, plain_texts):
    """With a step always in flight, a victim's last K/V is still being written when it is swapped out: the copy
    waits for that step (on the CPU: runs after it), and the token it sampled arrives after the swap."""
    llm = LLM(tiny, async_scheduling=True, **SWAP)
    assert [out.outputs[0].text for out in llm.generate(TEXTS, GREEDY, use_tqdm=False)] == plain_texts
    assert llm.stats.swap_preemptions > 0 and llm.stats.swapped_in_blocks > 0, llm.stats


def test_tensor_parallel_ranks_swap_their_shares(tmp_path):
    model = write_checkpoint(tmp_path / "tp", **SHAPES["gqa-biases"])
    prompt_list = [p * 2 for p in prompts(1001) if len(p) > 1] * 2
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in engine(model, 1).generate(prompt_list, params, use_tqdm=False)]
    llm = LLM(model, device="cpu", tensor_parallel_size=2, skip_tokenizer_init=True, seed=0, **SWAP)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompt_list, params, use_tqdm=False)] == expected
        stats = llm.stats
        assert stats.swap_preemptions > 0 and stats.swapped_in_blocks > 0 and stats.kv_transfer_bytes > 0, stats
    finally:
        llm.shutdown()
