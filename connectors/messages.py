"""A chat conversation from a table cell or a request body, checked as the chat template wants it; a bad message
fails its row (a `RowError` naming the message), never the job."""

from __future__ import annotations

import json
from typing import Any

from batchllm.connectors.cells import RowError, is_missing, to_plain

# Roles a chat template is written for. Others (OpenAI's "developer" and "function", typos) are refused per
# row: templates render any role string verbatim, so an unknown one would go through as garbage.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(value: Any, *, template_renders_tools: bool = False) -> list[dict[str, Any]]:
    """A conversation as the chat template wants it: a non-empty list of {role, content} with text content.

    Arrow, pandas and numpy hand list cells over as lists or numpy arrays (nested ones too), and struct
    cells carry null keys the message does not use; all are accepted. OpenAI-style content given as a list
    of text parts is joined with no separator; any other part (image_url, audio, ...) fails the row. An
    assistant message may carry `tool_calls` (then its content may be null) and a `tool` message answers
    one; both reach the template as HF templates expect them (arguments as objects, `tool_call_id` kept)
    when `template_renders_tools`, and fail the row otherwise. No message is ever dropped.
    """
    value = to_plain(value)
    if is_missing(value):
        raise RowError("messages are null")
    if not isinstance(value, list):
        raise RowError(f"messages must be a list of {{role, content}} objects, got {type(value).__name__}")
    if not value:
        raise RowError("messages are empty")
    return [_check_message(message, position, template_renders_tools) for position, message in enumerate(value)]


def _check_message(message: Any, position: int, template_renders_tools: bool) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RowError(f"message {position} must be an object with role and content, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise RowError(f"message {position} has no role")
    if role not in CHAT_ROLES:
        raise RowError(f"message {position} has role {role!r}; the roles are {', '.join(CHAT_ROLES)}")
    tool_calls = message.get("tool_calls") or None  # struct cells give every message the key, as null
    if (tool_calls is not None or role == "tool") and not template_renders_tools:
        what = "tool_calls" if tool_calls is not None else "the role 'tool'"
        raise RowError(f"message {position} has {what}, which this model's chat template does not render")
    if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)):
        raise RowError(f"message {position}: tool_calls must be a list, on an assistant message")
    content = message.get("content")
    checked: dict[str, Any] = {"role": role}
    if tool_calls is not None:
        checked["content"] = None if is_missing(content) else _content_text(content, position)
        checked["tool_calls"] = [_check_tool_call(call, position) for call in tool_calls]
    else:
        checked["content"] = _content_text(content, position)
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            checked[key] = message[key]
    return checked


def _check_tool_call(call: Any, position: int) -> dict[str, Any]:
    """An OpenAI tool call with its JSON-string arguments parsed: HF chat templates take them as an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RowError(f"message {position}: a tool call must be {{type, function: {{name, arguments}}}}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise RowError(f"message {position}: tool call {function['name']!r} has arguments that are not "
                           f"valid JSON: {exc}") from exc
    call = {key: item for key, item in call.items() if item is not None}
    return {**call, "function": {**function, "arguments": arguments}}


def _content_text(content: Any, position: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RowError(f"message {position}: a content part of type {part.get('type')!r}; only text "
                               f"content parts are supported")
        return "".join(part["text"] for part in content)
    if is_missing(content):
        raise RowError(f"message {position} has no content")
    raise RowError(f"message {position}: content must be a string or a list of text parts, "
                   f"got {type(content).__name__}")


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads `tool_calls`: tool-aware HF templates (Llama 3.1, Qwen 2.5,
    Mistral, ...) all do, and one that does not would render such a turn wrong or not at all."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        template = " ".join(template.values())
    return isinstance(template, str) and "tool_calls" in template
