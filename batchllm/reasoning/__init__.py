"""Reasoning parsers by vLLM's names: `LLM(reasoning_parser=...)`, `--reasoning-parser`. Torch-free."""

from __future__ import annotations

from typing import Any

from batchllm.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    HarmonyReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningStream,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, HarmonyReasoningParser)}
# Prompt tokens read to find the markers a prompt leaves open (a template's opening tag is at its very end).
PROMPT_TAIL_TOKENS = 16

__all__ = ["REASONING_PARSERS", "PROMPT_TAIL_TOKENS", "ReasoningParser", "ReasoningStream", "check_reasoning_parser",
           "reasoning_parser"]


def check_reasoning_parser(name: Any, argument: str = "LLM argument reasoning_parser") -> str | None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, REASONING_PARSERS))} or None, got {name!r}")
    return name


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    return None if check_reasoning_parser(name) is None else REASONING_PARSERS[name]()
