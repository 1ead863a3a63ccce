"""The reasoning parsers (batchllm/reasoning/) on outputs written in each model family's format: Qwen3 / DeepSeek-R1
think tags and gpt-oss's harmony channels (token strings as OpenAI's harmony format defines them). Expected splits
are written out by hand. Each output is also streamed, char by char and as a real tokenizer's decoded pieces, and
the streamed deltas must add up to the same split with no marker leaking into either part."""

from __future__ import annotations

import pytest
from tokenizers.decoders import DecodeStream

from batchllm.reasoning import REASONING_PARSERS, reasoning_parser

HARMONY = ("<|channel|>analysis<|message|>User asks 2+2. Simple: 4.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
# (parser, prompt tail, output text, expected reasoning, expected answer)
CASES = [
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me add: 4.\n</think>\n\nIt is 4.",
     "\nLet me add: 4.\n", "\n\nIt is 4."),
    # Qwen3's template with thinking on may put the opening tag in the prompt; the output then starts inside it.
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Adding: 4.\n</think>\n\nIt is 4.", "Adding: 4.\n", "\n\nIt is 4."),
    # enable_thinking=False: the prompt closes an empty section, the output is all answer.
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "It is 4.", None, "It is 4."),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Two and two.\n</think>\n\nThe answer is 4.",
     "Two and two.\n", "\n\nThe answer is 4."),
    ("openai_gptoss", "<|start|>assistant", HARMONY, "User asks 2+2. Simple: 4.", "2 + 2 = 4."),
    # A preamble on the commentary channel is not the answer either.
    ("openai_gptoss", "<|start|>assistant",
     "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking."
     "<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>", "Think.Checking.", "Done."),
]
# Cut off by max_tokens inside the reasoning: all of it is reasoning, the answer is empty.
CUT_OFF = [
    ("qwen3", "", "<think>\nLet me add: first", "\nLet me add: first", ""),
    ("qwen3", "assistant\n<think>\n", "Let me add: first", "Let me add: first", ""),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Two and two make", "Two and two make", ""),
    ("openai_gptoss", "<|start|>assistant", "<|channel|>analysis<|message|>User asks 2+2. Sim",
     "User asks 2+2. Sim", ""),
]
NO_MARKERS = [("qwen3", "user: hi\nassistant: ", "Hello there."), ("deepseek_r1", "", "Hello <thinking> there."),
              ("openai_gptoss", "", "Hello there.")]


def _stream(parser, prefix: str, pieces: list[str]) -> tuple[str, str]:
    stream = parser.stream(prefix)
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for reasoning, answer in deltas:
        for marker in parser.markers:
            assert marker not in reasoning and marker not in answer, (marker, deltas)
    return "".join(r for r, _ in deltas), "".join(a for _, a in deltas)


@pytest.mark.parametrize("name, tail, text, reasoning, answer", CASES + CUT_OFF)
def test_split_finished_and_streamed_char_by_char(name, tail, text, reasoning, answer):
    parser = reasoning_parser(name)
    assert parser.split_output(tail, text) == (reasoning, answer)
    assert _stream(parser, parser.prompt_prefix(tail), list(text)) == (reasoning or "", answer)


def test_closing_tag_without_opening_one():
    """A prompt not seen (its tail lacks the tag the template put there): what precedes `</think>` is reasoning.
    Streamed, that text already went out as answer before the tag came (the documented exception)."""
    for name in ("qwen3", "deepseek_r1"):
        assert reasoning_parser(name).split_output("", "Two and two.</think>Four.") == ("Two and two.", "Four.")


@pytest.mark.parametrize("name, tail, text", NO_MARKERS)
def test_text_without_markers_is_all_answer(name, tail, text):
    parser = reasoning_parser(name)
    assert parser.split_output(tail, text) == (None, text)
    assert _stream(parser, parser.prompt_prefix(tail), list(text)) == ("", text)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from batchllm.model.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    # gpt-oss's markers are special tokens of its vocabulary: added as such, they decode as they do there.
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                                                "<|return|>", "<|call|>", "<|constrain|>"]})
    return tokenizer


@pytest.mark.parametrize("name, tail, text, reasoning, answer", CASES + CUT_OFF)
def test_streamed_as_decoded_token_pieces(tokenizer, name, tail, text, reasoning, answer):
    parser = reasoning_parser(name)
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(token_ids) > 3
    decoder = DecodeStream(skip_special_tokens=not parser.keeps_special_tokens)
    pieces = [decoder.step(tokenizer.backend_tokenizer, token_id) or "" for token_id in token_ids]
    assert "".join(pieces) == text
    assert _stream(parser, parser.prompt_prefix(tail), pieces) == (reasoning or "", answer)


def test_harmony_markers_are_special_tokens(tokenizer):
    """Why the harmony parser asks for special tokens: decoded without them, the channels are gone."""
    token_ids = tokenizer(HARMONY, add_special_tokens=False)["input_ids"]
    stripped = "analysisUser asks 2+2. Simple: 4.assistantfinal2 + 2 = 4."
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == stripped
    assert reasoning_parser("openai_gptoss").keeps_special_tokens


def test_registry_and_engine_config():
    from batchllm.engine_config import EngineConfig

    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "openai_gptoss", "qwen3"]
    assert EngineConfig.from_kwargs(reasoning_parser="qwen3", device="cpu").reasoning_parser == "qwen3"
    assert EngineConfig.from_kwargs(device="cpu").reasoning_parser is None
    with pytest.raises(ValueError, match="reasoning_parser must be one of 'qwen3', 'deepseek_r1', 'openai_gptoss'"):
        EngineConfig.from_kwargs(reasoning_parser="qwen", device="cpu")


def test_cli_flag(capsys):
    from batchllm.entrypoints.cli.engine_flags import OneLineErrors, add_engine_flags, engine_options

    parser = OneLineErrors(prog="batchllm")
    add_engine_flags(parser)
    assert engine_options(parser.parse_args(["--reasoning-parser", "openai_gptoss"])) == {
        "reasoning_parser": "openai_gptoss"}
    assert "reasoning_parser" not in engine_options(parser.parse_args([]))
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--reasoning-parser", "r1"])
    assert exit_info.value.code == 2
    assert "--reasoning-parser" in capsys.readouterr().err


@pytest.mark.parametrize("name, tail, text, reasoning, answer", CASES)
def test_answer_offset_is_where_the_answer_starts(name, tail, text, reasoning, answer):
    """Structured outputs start their grammar there (engine/structured/reasoning_gate.py)."""
    parser = reasoning_parser(name)
    full = parser.prompt_prefix(tail) + text
    offset = parser.answer_offset(full)
    if reasoning is None:  # the prompt closed the section: a grammar applies from the output's first token
        assert offset is None and parser.prompt_skips_reasoning(tail)
        return
    assert not parser.prompt_skips_reasoning(tail)
    assert full[offset:].startswith(answer.removesuffix("<|return|>")[:3])
    assert parser.answer_offset(full[:offset - 1]) is None  # not before the marker is whole
