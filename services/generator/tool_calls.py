"""Parsing a generated assistant turn (Qwen/Hermes style) into OpenAI message fields.

* A leading ``<think>...</think>`` block becomes ``reasoning_content`` (also when the template's
  generation prompt already opened ``<think>`` and only ``</think>`` was generated).
* Each ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block whose body is a
  JSON object with a string ``name`` becomes a tool call (id ``call_<hex>``, ``arguments`` as a
  JSON string). A block that cannot be one stays in the content, untouched, and is reported in
  ``errors`` with its reason: ``invalid_json`` (the body is not a JSON object), ``missing_name``,
  ``invalid_arguments`` (``arguments`` is a string that is not JSON), or ``unclosed_tag`` (a
  ``<tool_call>`` with no ``</tool_call>`` after it). Reporting never raises: a malformed call is
  the model's mistake, which the agent sees and the gateway counts.
* ``content`` is the remaining text, ``None`` when empty.

Only text changes here: the token ids the model produced are returned unchanged elsewhere, so
parsing can never alter what the trainer sees. Called by `services.generator.serving`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from shared.openai_api import FunctionCall, ToolCall, ToolCallError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SNIPPET_CHARS = 200  # of a malformed block, quoted in its error message


@dataclass
class ParsedTurn:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)  # blocks left in the content, and why


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest): the leading think block, if there is one."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        end = stripped.find(THINK_CLOSE)
        if end < 0:  # the turn ended inside its reasoning (e.g. max_tokens)
            return stripped[len(THINK_OPEN) :].strip() or None, ""
        return stripped[len(THINK_OPEN) : end].strip() or None, stripped[end + len(THINK_CLOSE) :]
    end = text.find(THINK_CLOSE)
    if end >= 0 and THINK_OPEN not in text[:end]:
        return text[:end].strip() or None, text[end + len(THINK_CLOSE) :]
    return None, text


def _error(reason: str, what: str, body: str) -> ToolCallError:
    snippet = body if len(body) <= _SNIPPET_CHARS else body[:_SNIPPET_CHARS] + "..."
    return ToolCallError(reason=reason, message=f"{what}: {snippet}")


def _tool_call(body: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return _error("invalid_json", f"tool call is not valid JSON ({exc.msg})", body)
    if not isinstance(obj, dict):
        return _error("invalid_json", "tool call is not a JSON object", body)
    if not isinstance(obj.get("name"), str):
        return _error("missing_name", 'tool call has no "name" string', body)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError as exc:
            return _error(
                "invalid_arguments", f'"arguments" of tool {obj["name"]!r} are not valid JSON ({exc.msg})', body
            )
        arguments = args
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        type="function",
        function=FunctionCall(name=obj["name"], arguments=arguments),
    )


def parse_turn(text: str, *, tool_calls: bool = True) -> ParsedTurn:
    """Reasoning, tool calls and remaining content of one generated turn. With
    ``tool_calls=False`` (the request offered no tools) tool-call blocks stay in the content."""
    reasoning, rest = split_reasoning(text)
    if not tool_calls:
        return ParsedTurn(content=rest.strip() or None, reasoning_content=reasoning)
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    kept: list[str] = []
    pos = end = 0
    for m in _TOOL_CALL.finditer(rest):
        end = m.end()
        call = _tool_call(m.group(1))
        if isinstance(call, ToolCallError):
            errors.append(call)  # the block stays in the content
            continue
        kept.append(rest[pos : m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(rest[pos:])
    unclosed = rest.find(TOOL_OPEN, end)
    if unclosed >= 0:  # e.g. the turn hit max_tokens inside its call, or the model never closed it
        body = rest[unclosed + len(TOOL_OPEN) :].strip()
        errors.append(_error("unclosed_tag", f"{TOOL_OPEN} has no closing {TOOL_CLOSE}", body))
    content = "".join(kept).strip()
    return ParsedTurn(content=content or None, reasoning_content=reasoning, tool_calls=calls, errors=errors)
