"""Speculative decoding through every door: the CLI with its flag on a Parquet table with two data-parallel
replicas, an OpenAI batch file, a pandas frame, tensor parallelism; sampling with seeds, penalties, logprobs and
n > 1; and the refusals, made before anything loads.

References: HF transformers (greedy with a repetition penalty), and where the point is that speculation
changes nothing, the same engine without it. The CLI, batch-file and pandas doors run the session's tiny random
Llama (tests/conftest.py): their point is the option reaching the engines. The sampling tests keep the default
model, which copies the repeated prompts, so its drafts are accepted (the tiny model's are not)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import batchllm
from batchllm import LLM, SamplingParams
from batchllm.entrypoints.cli.main import main
from tests.distributed.test_tensor_parallel import SHAPES, engine, write_checkpoint
from tests.e2e.conftest import QUESTIONS
from tests.e2e.doors import batch_file_texts, parquet_job_texts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)
TEXTS = [*QUESTIONS, "Copy this list: apple, banana, cherry, apple, banana, cherry, apple,",
         "Repeat after me: one two three four, one two three four, one two"]


@pytest.fixture(scope="module")
def plain():
    return LLM()


@pytest.fixture(scope="module")
def spec():
    return LLM(speculative_config=NGRAM)


@pytest.fixture(scope="module")
def plain_texts(tiny) -> list[str]:
    """The tiny model's greedy text without speculation: the doors' reference."""
    return [out.outputs[0].text for out in LLM(tiny).generate(TEXTS, GREEDY, use_tqdm=False)]


def test_the_cli_flag_on_two_replicas(tiny, plain_texts, tmp_path, capsys):
    assert parquet_job_texts(tmp_path, tiny, TEXTS, MAX_NEW, ["--speculative-config", json.dumps(NGRAM)]) \
        == plain_texts
    bad = ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out2"), "--prompt-column", "q"]
    with pytest.raises(SystemExit) as exit_info:
        main([*bad, "--speculative-config", '{"method": "lookahead", "num_speculative_tokens": 2}'])
    assert exit_info.value.code == 2
    assert "--speculative-config: method must be one of" in capsys.readouterr().err


def test_an_openai_batch_file_and_a_pandas_frame(tiny, plain_texts, tmp_path):
    frame = pd.DataFrame({"q": TEXTS})
    out = batchllm.generate(frame, prompt_column="q", model=tiny, engine_kwargs={"speculative_config": NGRAM},
                            max_tokens=MAX_NEW, temperature=0, use_tqdm=False)
    assert out["generated_text"].tolist() == plain_texts
    assert batch_file_texts(tmp_path, tiny, TEXTS, {"speculative_config": NGRAM}, max_tokens=MAX_NEW,
                            temperature=0) == plain_texts


def test_seeded_sampling_ignores_the_batch_and_the_drafts(plain, spec):
    """A seeded row's tokens depend only on its seed and positions: alone, in a batch, with and without drafts."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    prompt = TEXTS[-1]
    alone = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=4 + i) for i in range(6)]
    batch = spec.generate(TEXTS[:3] + [prompt] + TEXTS[:3], others[:3] + [params] + others[3:], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    assert spec.stats.num_draft_tokens > 0, spec.stats
    assert spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_repetition_penalty_equals_hf(model_path, tokenizer, spec):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompt_ids = [tokenizer(text)["input_ids"] for text in TEXTS[-2:]]
    expected = []
    with torch.inference_mode():
        for ids in prompt_ids:
            ids = torch.tensor([ids])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 repetition_penalty=1.05)
            expected.append(out[0, ids.shape[1]:].tolist())
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=1.05)
    got = [out.outputs[0].token_ids for out in spec.generate(prompt_ids, params, use_tqdm=False)]
    assert got == expected
    assert spec.stats.num_draft_tokens > 0, spec.stats


def test_logprobs_and_n_samples(plain, spec):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=2)
    a, b = (llm.generate(TEXTS[-1:], greedy, use_tqdm=False)[0].outputs[0] for llm in (plain, spec))
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank for t in x)
    assert spec.stats.num_accepted_tokens > 0, spec.stats
    seeded = SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=12, ignore_eos=True)
    got, expected = ([c.token_ids for c in llm.generate(TEXTS[-2:], seeded, use_tqdm=False)[1].outputs]
                     for llm in (spec, plain))
    assert got == expected and len(set(map(tuple, got))) == 3


def test_tensor_parallel(tmp_path):
    model = write_checkpoint(tmp_path / "tp", **SHAPES["gqa-biases"])
    prompt_list = [list(range(5, 25)) * 3, [7, 8, 9] * 10, list(range(300, 340))]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in engine(model, 1).generate(prompt_list, params, use_tqdm=False)]
    llm = engine(model, 2, speculative_config=NGRAM)
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_list, params, use_tqdm=False)] == expected
    assert llm.stats.num_draft_tokens > 0, llm.stats


@pytest.mark.parametrize("config, message", [
    ({"method": "lookahead", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "1 <= min <= max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "unknown keys ['speculative_model']"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "eagle", "model": "/nowhere", "num_speculative_tokens": 2}, "'/nowhere' is not a directory"),
    ("{not json", "not valid JSON"),
])
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValueError) as error:
        LLM(speculative_config=config)
    assert message in str(error.value)


def test_mismatched_proposers_are_refused_before_loading(tmp_path, model_path):
    other_vocab = write_checkpoint(tmp_path / "other", **SHAPES["gqa-biases"])
    with pytest.raises(ValueError, match="the draft model has vocab_size=1001, the target model vocab_size=49152"):
        LLM(speculative_config={"method": "draft_model", "model": str(other_vocab), "num_speculative_tokens": 2})
    config = json.loads((model_path / "config.json").read_text())
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "hidden_size": 64,
                                                   "vocab_size": config["vocab_size"]}))
    (heads / "medusa_lm_head.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="the Medusa heads have hidden_size=64"):
        LLM(speculative_config={"method": "medusa", "model": str(heads), "num_speculative_tokens": 2})
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    (eagle / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pickled pytorch_model.bin heads are not loaded"):
        LLM(speculative_config={"method": "eagle", "model": str(eagle), "num_speculative_tokens": 2})
    (eagle / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="has no draft_vocab_size: not an EAGLE-3 head"):
        LLM(speculative_config={"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 2})
    (eagle / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "hidden_size": 256}))
    with pytest.raises(ValueError, match="the eagle head has hidden_size=256, the target model hidden_size=576"):
        LLM(speculative_config={"method": "eagle", "model": str(eagle), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="does not run under tensor parallelism yet"):
        LLM(model_path, tensor_parallel_size=2, speculative_config={"method": "draft_model", "model": str(model_path),
                                                                   "num_speculative_tokens": 2})
