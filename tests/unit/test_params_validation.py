"""Every invalid field of SamplingParams, BeamSearchParams and PoolingParams raises ValueError naming the field,
wrong types included (never a TypeError from deep inside, nor a silent coercion such as True for 1)."""

from __future__ import annotations

import re

import pytest

from batchllm import BeamSearchParams, PoolingParams, SamplingParams


def _naming(owner: str, field: str, value: object) -> str:
    """The whole message: `Owner.field must be <what>, got <the value as given>`."""
    return rf"^{owner}\.{field} must be .+, got {re.escape(repr(value))}$"


_SAMPLING_BAD = {
    "n": [0, "2", 2.0, True, None],
    "temperature": [-0.1, "0.5", float("nan"), float("inf"), True, None],
    "top_p": [0, 1.5, "1", float("nan"), None],
    "top_k": [-2, 1.5, "5", -1.0, True],
    "min_p": [-0.1, 1.1, "0", None],
    "seed": ["x", 1.5, True, 2**64, -2**63 - 1],
    "max_tokens": [0, "16", 16.0, True],
    "min_tokens": [-1, "1", 1.0, None, False],
    "stop": [5, "", [""], ["a", 5], b"x", {"a": 1}, 1.5],
    "stop_token_ids": ["a", 5, [-1], ["1"], [1.0], [True], "12"],
    "ignore_eos": ["yes", 1, None],
    "presence_penalty": [2.5, "0", float("inf"), None],
    "frequency_penalty": [-3, "0", float("nan")],
    "repetition_penalty": [0, -1.0, "1", float("inf"), None],
    "logprobs": [1.5, -1, 21, "1", True],
    "skip_special_tokens": ["no", 0, None],
    "include_stop_str_in_output": [1, "True"],
    "structured_outputs": [{"json": {}}, "json"],
}


@pytest.mark.parametrize("field, value", [(f, v) for f, values in _SAMPLING_BAD.items() for v in values])
def test_a_bad_sampling_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=_naming("SamplingParams", field, value)):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("fields, expected", [
    ({"top_k": -1}, {"top_k": 0}),  # -1 is vLLM's "off", stored as 0
    ({"stop": "END"}, {"stop_strings": ("END",)}),
    ({"stop": ("a", "b")}, {"stop_strings": ("a", "b")}),
    ({"stop_token_ids": (7, 8)}, {"stop_token_ids": [7, 8]}),
    ({"seed": -1}, {"seed": -1}),
    ({"seed": 2**64 - 1}, {"seed": 2**64 - 1}),
    ({"temperature": 0, "presence_penalty": -2, "logprobs": 0}, {"temperature": 0, "presence_penalty": -2}),
    ({"max_tokens": None, "stop": None, "stop_token_ids": None}, {"stop_strings": (), "stop_token_ids": []}),
])
def test_the_edges_of_each_range_are_accepted(fields, expected):
    params = SamplingParams(**fields)
    assert {name: getattr(params, name) for name in expected} == expected


@pytest.mark.parametrize("fields, field", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 11, "max_tokens": 4}, "beam_width"),
    ({"beam_width": "2", "max_tokens": 4}, "beam_width"),
    ({"beam_width": True, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4.0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "ignore_eos": "no"}, "ignore_eos"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": "1"}, "length_penalty"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": None}, "length_penalty"),
])
def test_a_bad_beam_search_field_is_a_value_error_naming_it(fields, field):
    with pytest.raises(ValueError, match=_naming("BeamSearchParams", field, fields[field])):
        BeamSearchParams(**fields)


@pytest.mark.parametrize("fields, field", [
    ({"pooling": "max"}, "pooling"),
    ({"pooling": ["last"]}, "pooling"),
    ({"pooling": None}, "pooling"),
    ({"normalize": "yes"}, "normalize"),
    ({"normalize": 1}, "normalize"),
    ({"classify": None}, "classify"),
])
def test_a_bad_pooling_field_is_a_value_error_naming_it(fields, field):
    with pytest.raises(ValueError, match=_naming("PoolingParams", field, fields[field])):
        PoolingParams(**fields)
