"""Text prompts tokenized while the engine runs (`entrypoints/tokenize_ahead.py`), through every door: `LLM.generate`,
`LLM.chat`, the table doors and the Parquet job. Chunks are made tiny (2, then 3 rows) so that small inputs cross
odd chunk boundaries. References: the same prompts as token ids, each text tokenized alone by the HF tokenizer."""

from __future__ import annotations

import threading

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm import SamplingParams
from batchllm.entrypoints import tokenize_ahead
from tests.connectors.helpers import GREEDY
from tests.connectors.jobs import read_shards

TEXTS = [f"Row {i}: {'a longer sentence about the sea, ' * (i % 4)}the answer is" for i in range(11)]
PARAMS = SamplingParams(**GREEDY)


@pytest.fixture
def tiny_chunks(monkeypatch):
    monkeypatch.setattr(tokenize_ahead, "FIRST_CHUNK_ROWS", 2)
    monkeypatch.setattr(tokenize_ahead, "MAX_CHUNK_ROWS", 3)


@pytest.fixture(scope="module")
def id_outputs(llm):
    """The token-id path on each text's own tokenization: the reference for every text door."""
    ids = [llm.tokenizer(text)["input_ids"] for text in TEXTS]
    outs = llm.generate(ids, PARAMS, use_tqdm=False)
    return ids, _tokens(outs), [o.outputs[0].text for o in outs]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_text_prompts_equal_their_token_ids_across_chunk_boundaries(llm, id_outputs, tiny_chunks):
    ids, expected, _ = id_outputs
    outs = llm.generate(TEXTS, PARAMS, use_tqdm=False)
    assert [o.prompt for o in outs] == TEXTS and [o.prompt_token_ids for o in outs] == ids
    assert _tokens(outs) == expected

    conversations = [[{"role": "user", "content": text}] for text in TEXTS]
    rendered = [llm.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                for c in conversations]
    chat_ids = [llm.tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    chats = llm.chat(conversations, PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids for o in chats] == chat_ids
    assert _tokens(chats) == _tokens(llm.generate(chat_ids, PARAMS, use_tqdm=False))

    mixed = [ids[i] if i % 3 == 0 else text for i, text in enumerate(TEXTS)]  # ids and texts in one call
    assert _tokens(llm.generate(mixed, PARAMS, use_tqdm=False)) == expected


def test_a_bad_row_mid_stream_fails_alone_and_is_named(llm, id_outputs, tiny_chunks, tmp_path):
    _, expected, reference = id_outputs
    over_long = "word " * (llm.max_model_len + 10)
    texts = TEXTS[:6] + [over_long] + TEXTS[6:]  # in text order it lands in a later chunk, not the first
    outs = llm.generate(texts, PARAMS, use_tqdm=False)
    assert outs[6].error.startswith(f"the prompt has {len(llm.tokenizer(over_long)['input_ids'])} tokens")
    assert _tokens(outs[:6] + outs[7:]) == expected and all(o.error is None for o in outs[:6] + outs[7:])
    with pytest.raises(TypeError, match="prompt 6 must be a str or a list of token ids"):
        llm.generate(TEXTS[:6] + [None] + TEXTS[6:], PARAMS, use_tqdm=False)

    frame = batchllm.generate(pd.DataFrame({"q": texts}), prompt_column="q", use_tqdm=False, **GREEDY)
    assert "over the budget" in frame.error[6] and frame.error.drop(index=6).isna().all()
    assert frame.generated_text.drop(index=6).tolist() == reference

    pq.write_table(pa.table({"q": texts}), tmp_path / "in.parquet")
    batchllm.run_job(tmp_path / "in.parquet", tmp_path / "out", prompt_column="q", use_tqdm=False, **GREEDY)
    rows = read_shards(tmp_path / "out").to_pydict()
    assert "over the budget" in rows["error"][6]
    assert rows["generated_text"][:6] + rows["generated_text"][7:] == reference


@pytest.mark.parametrize("door", ["generate", "chat", "pandas", "parquet job"])
def test_the_first_step_runs_before_the_last_rows_are_tokenized(llm, tiny_chunks, monkeypatch, tmp_path, door):
    """Every tokenizer call after the first waits until the engine has stepped: a door that tokenized all its
    rows before the first step would never get there (and would make one call, not several)."""
    events, stepped = [], threading.Event()
    step, call = llm.engine.step, type(llm.tokenizer).__call__

    def recorded_step():
        events.append("step")
        stepped.set()
        return step()

    def gated_call(self, text, *args, **kwargs):
        if isinstance(text, list):  # a batch of prompts
            if "tokenize" in events:
                assert stepped.wait(timeout=60), "the engine never stepped while rows were left to tokenize"
            events.append("tokenize")
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(llm.engine, "step", recorded_step)
    monkeypatch.setattr(type(llm.tokenizer), "__call__", gated_call)
    if door == "generate":
        llm.generate(TEXTS, PARAMS, use_tqdm=False)
    elif door == "chat":
        llm.chat([[{"role": "user", "content": text}] for text in TEXTS], PARAMS, use_tqdm=False)
    elif door == "pandas":
        batchllm.generate(pd.DataFrame({"q": TEXTS}), prompt_column="q", llm=llm, use_tqdm=False, **GREEDY)
    else:
        pq.write_table(pa.table({"q": TEXTS}), tmp_path / "in.parquet")
        batchllm.run_job(tmp_path / "in.parquet", tmp_path / "out", prompt_column="q", llm=llm, use_tqdm=False,
                         **GREEDY)
    assert events.count("tokenize") == 4  # 11 rows: 2 + 3 + 3 + 3
    assert events.index("step") < len(events) - 1 - events[::-1].index("tokenize")


def test_rows_sharing_a_prefix_are_admitted_together_across_chunks(llm, tiny_chunks, monkeypatch):
    """Two system prompts interleaved in the input: in text order each one's rows reach the engine back to back,
    chunk after chunk, and every row after a group's first hits the group's cached blocks."""
    systems = ["You answer questions about rivers of the world, briefly and exactly, in one sentence. " * 3,
               "You answer questions about mountains of the world, briefly and exactly, in one sentence. " * 3]
    texts = [f"{systems[i % 2]}Question {i}: name one." for i in range(10)]
    admitted = []
    add_request = llm.engine.add_request

    def recorded(request_id, token_ids, *args, **kwargs):
        admitted.append(token_ids)
        return add_request(request_id, token_ids, *args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", recorded)
    llm.generate(texts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    prefixes = [llm.tokenizer(system)["input_ids"] for system in systems]
    groups = [next(g for g, prefix in enumerate(prefixes) if ids[:len(prefix) - 1] == prefix[:-1])
              for ids in admitted]
    assert groups in ([0] * 5 + [1] * 5, [1] * 5 + [0] * 5)  # each group's rows back to back, in any order
    shared_blocks = [(len(prefix) - 1) // 16 for prefix in prefixes]
    assert llm.stats.prefix_cache_hits >= 4 * 16 * sum(shared_blocks)
