"""Decode bursts (`num_decode_steps`) through every door: the real default model's greedy tokens equal HF
transformers' with bursts on, under preemption and the prefix cache, in both engine loops; the CLI flag on two
data-parallel replicas, an OpenAI batch file, a pandas frame and tensor parallelism get the engine's own output
without bursts (their point is the option reaching the engines, on the session's tiny random Llama); rows that
need the host between tokens (logprobs, seeds) keep single steps and their outputs; bad values and conflicting
options are refused."""

from __future__ import annotations

import pandas as pd
import pytest

import batchllm
from batchllm import LLM, SamplingParams
from batchllm.connectors import engine_cache
from batchllm.entrypoints.cli.main import main
from tests.distributed.test_tensor_parallel import SHAPES, engine, write_checkpoint
from tests.e2e.conftest import QUESTIONS
from tests.e2e.doors import batch_file_texts, parquet_job_texts
from tests.e2e.test_generate_vs_hf import MAX_NEW, _greedy_ids, _prompts

STEPS = 5  # a burst length that does not divide MAX_NEW, so the last bursts are cut short
TEXTS = [*QUESTIONS, "Once upon a time", "1, 2, 3, 4, 5,"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return _prompts(tokenizer)


@pytest.fixture(scope="module")
def hf_greedy(hf_default_greedy, prompts):
    return hf_default_greedy(prompts, MAX_NEW)  # e2e/conftest.py: shared with test_generate_vs_hf.py


def test_greedy_equals_hf(prompts, hf_greedy, async_scheduling):
    llm = LLM(num_decode_steps=STEPS, async_scheduling=async_scheduling)
    assert _greedy_ids(llm, prompts) == hf_greedy
    assert any(len(tokens) < MAX_NEW for tokens in hf_greedy), "no row stops early (inside a burst)"
    stats = llm.stats
    assert stats.num_decode_bursts > 0 and stats.num_steps < MAX_NEW, stats
    assert stats.num_generated_tokens == sum(map(len, hf_greedy))


def test_greedy_equals_hf_under_preemption_and_the_prefix_cache(prompts, hf_greedy):
    # The asynchronous loop only, where a burst's tokens are still pending when the next step preempts (both loops
    # meet preemption in tests/unit/test_decode_burst.py). The chat prompts share their system prompt's blocks.
    num_blocks = -(-(max(len(p) for p in prompts) + MAX_NEW) // 16) + 3
    llm = LLM(num_kv_blocks=num_blocks, max_num_batched_tokens=64, async_scheduling=True,
              admission_policy="optimistic", num_decode_steps=STEPS)
    assert _greedy_ids(llm, prompts) == hf_greedy
    stats = llm.stats
    assert stats.num_preemptions > 0 and stats.num_decode_bursts > 0 and stats.prefix_cache_hits > 0, stats


def test_rows_that_need_the_host_between_tokens_keep_single_steps():
    plain, bursts = LLM(), LLM(num_decode_steps=4)
    greedy = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    for params in (greedy, seeded):
        a, b = ([o.outputs[0] for o in llm.generate(TEXTS, params, use_tqdm=False)] for llm in (plain, bursts))
        assert [x.token_ids for x in a] == [y.token_ids for y in b]
        assert bursts.stats.num_decode_bursts == 0, bursts.stats
    mixed = [GREEDY] * (len(TEXTS) - 1) + [greedy]  # one row with logprobs holds the others to single steps
    a, b = ([o.outputs[0].token_ids for o in llm.generate(TEXTS, mixed, use_tqdm=False)] for llm in (plain, bursts))
    assert a == b


def test_the_server_streams_bursts_as_single_steps():
    """The OpenAI server on an engine with bursts: streamed and whole completions (stop strings too) equal the same
    engine's `generate` without bursts, token for token."""
    pytest.importorskip("fastapi")
    from batchllm.entrypoints.server.app import build_app
    from batchllm.entrypoints.server.engine_loop import EngineLoop
    from tests.server.conftest import openai_client, serving

    stop = SamplingParams(max_tokens=12, temperature=0, stop=[" the"])
    expected = {name: [o.outputs[0].text for o in LLM().generate(TEXTS, params, use_tqdm=False)]
                for name, params in (("greedy", GREEDY), ("stop", stop))}
    assert expected["stop"] != expected["greedy"], "no output hits the stop string"
    llm = LLM(num_decode_steps=4)
    loop = EngineLoop(llm)
    with serving(build_app(loop)) as base_url:
        client = openai_client(base_url)
        for name, extra in (("greedy", {}), ("stop", {"stop": [" the"]})):
            for stream in (False, True):
                texts = []
                for text in TEXTS:
                    response = client.completions.create(model=llm.model_path.name, prompt=text, max_tokens=12,
                                                         temperature=0, stream=stream, **extra)
                    texts.append(response.choices[0].text if not stream
                                 else "".join(chunk.choices[0].text for chunk in response if chunk.choices))
                assert texts == expected[name], (name, stream)
    loop.shutdown(5)
    assert llm.stats.num_decode_bursts > 0, llm.stats


@pytest.fixture(scope="module")
def plain_texts(tiny) -> list[str]:
    """The tiny model's greedy text without bursts: the doors' reference."""
    return [out.outputs[0].text for out in LLM(tiny).generate(TEXTS, GREEDY, use_tqdm=False)]


def test_the_cli_flag_on_two_replicas(tiny, plain_texts, tmp_path, capsys):
    assert parquet_job_texts(tmp_path, tiny, TEXTS, 12, ["--num-decode-steps", "4"]) == plain_texts
    bad = ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out2"), "--prompt-column", "q", "--model", tiny]
    assert main([*bad, "--num-decode-steps", "0"]) == 2
    assert "--num-decode-steps must be an int in [1, 64], got 0" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


def test_an_openai_batch_file_and_a_pandas_frame(tiny, plain_texts, tmp_path):
    frame = pd.DataFrame({"q": TEXTS})
    out = batchllm.generate(frame, prompt_column="q", model=tiny, engine_kwargs={"num_decode_steps": 4},
                            max_tokens=12, temperature=0, use_tqdm=False)
    assert out["generated_text"].tolist() == plain_texts
    assert engine_cache._cached[1].stats.num_decode_bursts > 0  # the option reached the door's engine
    assert batch_file_texts(tmp_path, tiny, TEXTS, {"num_decode_steps": 4}, max_tokens=12, temperature=0) \
        == plain_texts
    assert engine_cache._cached[1].stats.num_decode_bursts > 0


def test_tensor_parallel(tmp_path):
    model = write_checkpoint(tmp_path / "tp", **SHAPES["gqa-biases"])
    prompt_list = [list(range(5, 25)) * 3, [7, 8, 9] * 10, list(range(300, 340))]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in engine(model, 1).generate(prompt_list, params, use_tqdm=False)]
    llm = engine(model, 2, num_decode_steps=6)
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_list, params, use_tqdm=False)] == expected
    assert llm.stats.num_decode_bursts > 0, llm.stats


@pytest.mark.parametrize("options, message", [
    ({"num_decode_steps": 0}, "num_decode_steps must be an int in [1, 64], got 0"),
    ({"num_decode_steps": 2.5}, "num_decode_steps must be an int in [1, 64], got 2.5"),
    ({"num_decode_steps": 4, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "num_decode_steps=4 does not work with speculative_config yet"),
    ({"num_decode_steps": 4, "pipeline_parallel_size": 2},
     "num_decode_steps=4 does not work with pipeline_parallel_size"),
])
def test_bad_values_and_conflicts_are_refused(options, message):
    with pytest.raises(ValueError) as error:
        LLM(**options)
    assert message in str(error.value)
