"""Edge cases of `batchllm.generate` and the job output: error rows with n > 1, inputs it cannot take, and
the system prompt. Outputs are read back with pandas / pyarrow; prompt sizes come from the tokenizer."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm

TINY = {"max_tokens": 1, "temperature": 0}
SAMPLED = {"n": 2, "max_tokens": 2, "seed": 0}  # one good row and one null prompt, two samples each


def _assert_error_row_has_one_reason_per_sample(finish_reasons: list) -> None:
    good, failed = finish_reasons
    assert len(good) == 2 and set(good) <= {"stop", "length"}
    assert failed == ["error", "error"]  # not the characters of "error"


def test_n_samples_error_row_in_pandas(llm):
    out = batchllm.generate(pd.DataFrame({"q": ["Hi", None]}), prompt_column="q", llm=llm, use_tqdm=False, **SAMPLED)
    _assert_error_row_has_one_reason_per_sample([list(reasons) for reasons in out["finish_reason"]])
    assert out["error"].iloc[1] == "prompt column 'q' is null"
    assert out["generated_text"].iloc[1] is None and out["completion_tokens"].iloc[1] is None


def test_n_samples_error_row_in_arrow(llm):
    out = batchllm.generate(pa.table({"q": ["Hi", None]}), prompt_column="q", llm=llm, use_tqdm=False, **SAMPLED)
    assert out.schema.field("finish_reason").type == pa.list_(pa.string())
    _assert_error_row_has_one_reason_per_sample(out.column("finish_reason").to_pylist())


def test_n_samples_error_row_in_a_parquet_shard(llm, tmp_path):
    pq.write_table(pa.table({"q": ["Hi", None]}), tmp_path / "in.parquet")
    batchllm.run_job(tmp_path / "in.parquet", tmp_path / "out", prompt_column="q", llm=llm, use_tqdm=False,
                     **SAMPLED)
    shard = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    _assert_error_row_has_one_reason_per_sample(shard.column("finish_reason").to_pylist())


def test_duplicate_column_names_are_refused_by_name(llm):
    frame = pd.DataFrame([["a", "b", "c"]], columns=["q", "q", "other"])
    with pytest.raises(ValueError, match=r"duplicate column names \['q'\]"):
        batchllm.generate(frame, prompt_column="other", llm=llm, use_tqdm=False, **TINY)
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["q", "q"])
    with pytest.raises(ValueError, match=r"duplicate column names \['q'\]"):
        batchllm.generate(table, prompt_template="{q}", llm=llm, use_tqdm=False, **TINY)


def test_a_series_is_refused_with_the_way_to_pass_it(llm):
    with pytest.raises(TypeError, match=r"Series.*series\.to_frame\('prompt'\) with prompt_column='prompt'"):
        batchllm.generate(pd.Series(["Hi"]), llm=llm, use_tqdm=False, **TINY)


def _chat_prompt_tokens(llm, conversation: list[dict]) -> int:
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return len(llm.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_system_prompt_goes_first_in_chat_prompts(llm):
    system = {"role": "system", "content": "Answer in French, in one word."}
    own_system = {"role": "system", "content": "Answer in German."}
    user = {"role": "user", "content": "Name a color."}
    rows = pa.table({"q": [user["content"]], "messages": [[own_system, user]]})
    assert _chat_prompt_tokens(llm, [system, user]) != _chat_prompt_tokens(llm, [user])  # the test can tell

    chat = batchllm.generate(rows, prompt_column="q", chat=True, system_prompt=system["content"], llm=llm,
                             use_tqdm=False, **TINY)
    # (test_cli's system-prompt job also checks the text against LLM.chat.)
    assert chat.column("prompt_tokens").to_pylist() == [_chat_prompt_tokens(llm, [system, user])]

    own = batchllm.generate(rows, messages_column="messages", system_prompt=system["content"], llm=llm,
                            use_tqdm=False, **TINY)
    assert own.column("prompt_tokens").to_pylist() == [_chat_prompt_tokens(llm, [own_system, user])]


def test_system_prompt_needs_a_chat_prompt(llm):
    with pytest.raises(ValueError, match="system_prompt= applies to chat prompts"):
        batchllm.generate(["Hi"], system_prompt="Be brief.", llm=llm, use_tqdm=False, **TINY)
