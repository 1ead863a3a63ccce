"""Reasoning parsers: a finished completion's text → (reasoning, answer), and the same split made as text streams.

Two formats, under vLLM's parser names:

- think tags (`qwen3`, `deepseek_r1`): `<think>` reasoning `</think>` answer. Their chat templates often put the
  opening tag in the prompt, so whether the output starts inside the reasoning is read from the prompt's end
  (`prompt_prefix`); an output with the closing tag but no opening one is reasoning up to it all the same.
- harmony (`openai_gptoss`): messages `<|channel|>analysis<|message|>...<|end|>` then
  `<|start|>assistant<|channel|>final<|message|>...<|return|>`; the final channel is the answer, every other
  channel (analysis, commentary) reasoning. Its markers are special tokens, so the text must be decoded with them
  (`keeps_special_tokens`).

Rules shared by both: text without any marker is all answer (reasoning None); a reasoning section that never
closed (cut off by max_tokens) is all reasoning, and the answer is "". Markers never appear in either part.

Streaming (`ReasoningStream`) re-splits the text seen so far, minus any tail that could still grow into a marker,
and sends what each part gained: the deltas add up to the finished split whenever the split of a prefix is a
prefix of the split of the whole, which holds for every well-formed output (the one exception: a closing think
tag without an opening one and without a prompt that opened it, whose earlier text already went out as answer).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod


class ReasoningParser(ABC):
    name: str = ""
    markers: tuple[str, ...] = ()  # strings that are never part of the reasoning or the answer
    keeps_special_tokens = False  # the markers are special tokens: decode with skip_special_tokens=False

    @abstractmethod
    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, answer) of a completion's text, preceded by its `prompt_prefix`."""

    @abstractmethod
    def answer_offset(self, text: str) -> int | None:
        """Where the answer starts in `text` (preceded by its `prompt_prefix`) once the reasoning has ended; None
        before. Structured outputs constrain the tokens from there on (`engine/structured/reasoning_gate.py`)."""

    def prompt_prefix(self, prompt_tail: str) -> str:
        """The markers the prompt left open, to put before the output's text (the end of the prompt suffices)."""
        return ""

    def prompt_skips_reasoning(self, prompt_tail: str) -> bool:
        """The prompt ends with a reasoning section already closed (Qwen3's enable_thinking=False): the output is
        all answer, and a grammar constrains it from its first token."""
        return False

    def stream(self, prefix: str = "") -> ReasoningStream:
        return ReasoningStream(self, prefix)

    def split_output(self, prompt_tail: str, text: str) -> tuple[str | None, str]:
        """(reasoning, answer) of an output whose prompt ends with `prompt_tail`."""
        return self.split(self.prompt_prefix(prompt_tail) + text)


class ThinkTagParser(ReasoningParser):
    start, end = "<think>", "</think>"
    markers = (start, end)

    def split(self, text: str) -> tuple[str | None, str]:
        start = text.find(self.start)
        end = text.find(self.end)
        if start >= 0 and (end < 0 or start < end):
            body_start = start + len(self.start)
            end = text.find(self.end, body_start)
            if end < 0:  # never closed: cut off while thinking
                return text[body_start:], text[:start]
            return text[body_start:end], text[:start] + text[end + len(self.end):]
        if end >= 0:  # the prompt held the opening tag
            return text[:end], text[end + len(self.end):]
        return None, text

    def answer_offset(self, text: str) -> int | None:
        end = text.find(self.end)
        return None if end < 0 else end + len(self.end)

    def prompt_prefix(self, prompt_tail: str) -> str:
        return self.start if prompt_tail.rfind(self.start) > prompt_tail.rfind(self.end) else ""

    def prompt_skips_reasoning(self, prompt_tail: str) -> bool:
        end = prompt_tail.rfind(self.end)
        return end > prompt_tail.rfind(self.start) and not prompt_tail[end + len(self.end):].strip()


class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"


_HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_HARMONY_MESSAGE_END = re.compile(r"<\|end\|>|<\|return\|>|<\|call\|>")


class HarmonyReasoningParser(ReasoningParser):
    """OpenAI's harmony format (gpt-oss). A message is `<|start|>{role}<|channel|>{channel}[ to=...]
    [<|constrain|>...]<|message|>{content}` ended by `<|end|>`, `<|return|>` or `<|call|>`; the prompt ends with
    `<|start|>assistant`, so the output's first message starts at its header's `<|channel|>`."""

    name = "openai_gptoss"
    markers = _HARMONY_TOKENS
    keeps_special_tokens = True

    def split(self, text: str) -> tuple[str | None, str]:
        if not any(token in text for token in _HARMONY_TOKENS):
            return None, text
        reasoning: list[str] = []
        answer: list[str] = []
        for channel, start, end in _messages(text):
            (answer if channel == "final" else reasoning).append(text[start:end])
        return "".join(reasoning), "".join(answer)

    def answer_offset(self, text: str) -> int | None:
        return next((start for channel, start, _ in _messages(text) if channel == "final"), None)


def _messages(text: str):
    """(channel, content start, content end) of each message begun in harmony `text` (the last may be unfinished)."""
    position = 0
    while True:
        header_end = text.find("<|message|>", position)
        if header_end < 0:  # no message started (or only its header so far)
            return
        header = text[position:header_end]
        channel = header.split("<|channel|>", 1)[1] if "<|channel|>" in header else ""
        content_start = header_end + len("<|message|>")
        ended = _HARMONY_MESSAGE_END.search(text, content_start)
        yield re.split(r"[\s<]", channel, maxsplit=1)[0], content_start, ended.start() if ended else len(text)
        if ended is None:
            return
        position = ended.end()


class ReasoningStream:
    """Splits a streamed output as it arrives: `feed(delta)` → (reasoning delta, answer delta); `finish(delta)`
    sends the rest, the tail held back as a possible marker included."""

    def __init__(self, parser: ReasoningParser, prefix: str = "") -> None:
        self._parser = parser
        self._text = prefix
        self._sent_reasoning = ""
        self._sent_answer = ""
        self._longest_marker = max(len(marker) for marker in parser.markers)

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        return self._send(self._text[:len(self._text) - self._held_back()])

    def finish(self, delta: str = "") -> tuple[str, str]:
        self._text += delta
        return self._send(self._text)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that a marker starts with (it may still become that marker)."""
        text = self._text
        for length in range(min(self._longest_marker - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(marker.startswith(tail) for marker in self._parser.markers):
                return length
        return 0

    def _send(self, text: str) -> tuple[str, str]:
        reasoning, answer = self._parser.split(text)
        reasoning = reasoning or ""
        reasoning_delta = reasoning[len(self._sent_reasoning):] if reasoning.startswith(self._sent_reasoning) else ""
        answer_delta = answer[len(self._sent_answer):] if answer.startswith(self._sent_answer) else ""
        self._sent_reasoning += reasoning_delta
        self._sent_answer += answer_delta
        return reasoning_delta, answer_delta
