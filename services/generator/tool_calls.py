"""Parsing a generated assistant turn (Qwen/Hermes style) into OpenAI message fields.

* A leading ``<think>...</think>`` block becomes ``reasoning_content`` (also when the template's
  generation prompt already opened ``<think>`` and only ``</think>`` was generated).
* Each ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block whose body is a
  JSON object with a string ``name`` becomes a tool call (id ``call_<hex>``, ``arguments`` as a
  JSON string); a block that is not valid JSON stays in the content, untouched.
* ``content`` is the remaining text, ``None`` when empty.

Only text changes here: the token ids the model produced are returned unchanged elsewhere, so
parsing can never alter what the trainer sees. Called by `services.generator.serving`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from shared.openai_api import FunctionCall, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ParsedTurn:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


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


def _tool_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
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
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL.finditer(rest):
        call = _tool_call(m.group(1))
        if call is None:
            continue  # invalid JSON: the block stays in the content
        kept.append(rest[pos : m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(rest[pos:])
    content = "".join(kept).strip()
    return ParsedTurn(content=content or None, reasoning_content=reasoning, tool_calls=calls)
