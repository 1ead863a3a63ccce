"""Options wrong for the whole call fail fast: before the engine is even built, naming the problem."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest

import batchllm
from batchllm import SamplingParams


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the engine was requested although the call is invalid")

    monkeypatch.setattr("batchllm.connectors.replicas.data_parallel.get_llm", fail)


FRAME = pd.DataFrame({"q": ["a", "b"], "generated_text": ["x", "y"], "finish": [1, 2]})


@pytest.mark.parametrize("options, error, message", [
    ({}, ValueError, "exactly one of prompt_column=, messages_column= or prompt_template="),
    ({"prompt_column": "q", "prompt_template": "{q}"}, ValueError, "got prompt_column, prompt_template"),
    ({"prompt_column": "nope"}, ValueError, "unknown column 'nope'"),
    ({"messages_column": "nope"}, ValueError, "unknown column 'nope'"),
    ({"prompt_template": "{q} {missing}"}, ValueError, "unknown column 'missing'"),
    ({"prompt_template": "{} and {0}"}, ValueError, "positional field"),
    ({"prompt_template": "{q"}, ValueError, "expected '}'"),
    ({"prompt_column": "q", "temperature": -1}, ValueError, "SamplingParams.temperature must be >= 0"),
    ({"prompt_column": "q", "max_token": 5}, TypeError, "unknown option 'max_token'"),
    ({"prompt_column": "q", "sampling_params": SamplingParams(), "top_p": 0.5}, ValueError, "not both"),
    ({"prompt_column": "q", "truncate": "middle"}, ValueError, "truncate must be one of"),
    ({"prompt_column": "q", "output_column": "finish"}, ValueError, "already has column 'finish'"),
    ({"prompt_column": "q", "output_column": ""}, ValueError, "output_column must be a non-empty string"),
    ({"messages_column": "q", "chat": True}, ValueError, "chat=True applies to"),
])
def test_call_errors(options, error, message):
    with pytest.raises(error, match=message):
        batchllm.generate(FRAME[["q", "finish"]], **options)


def test_default_output_column_may_not_overwrite_an_input_column():
    with pytest.raises(ValueError, match="already has column 'generated_text'"):
        batchllm.generate(FRAME, prompt_column="q")


def test_unsupported_input_type():
    with pytest.raises(TypeError, match="takes a pandas DataFrame"):
        batchllm.generate({"q": ["a"]}, prompt_column="q")


def test_arrow_and_lists_fail_fast_too():
    with pytest.raises(ValueError, match="unknown column 'x'"):
        batchllm.generate(pa.table({"q": ["a"]}), prompt_column="x")
    with pytest.raises(ValueError, match="unknown column 'x'"):
        batchllm.generate([{"q": "a"}], prompt_column="x")
    with pytest.raises(ValueError, match="SamplingParams.n must be"):
        batchllm.generate(["a"], n=0)
