"""Responses API <-> chat completions for the gateway's per-rollout Responses endpoint.

A NeMo-Gym agent sends the whole episode so far as Responses input items; the session proxy speaks
chat. ``chat_request`` turns the items into chat messages the way NeMo-Gym's own converter does:

    message(user|system|developer)        -> that message (content parts kept)
    reasoning, function_call, message(assistant), consecutive
                                          -> one assistant message (reasoning summary as
                                             reasoning_content, function calls as tool_calls)
    function_call_output                  -> tool message
    instructions                          -> one leading system message (folding leading
                                             system/developer messages into it)

Token fields on replayed model items go onto their assistant message, so the generator splices
the model's exact tokens (the proxy also attaches the session's own history). ``build_response``
turns the generator's answer into output items (reasoning, message, function_call, in that order)
whose last item carries the turn's ``prompt_token_ids``, ``generation_token_ids`` and
``generation_log_probs``. Called by `services.gym_gateway.session_routes`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypedDict

import msgspec

from shared.http import bad_request
from shared.openai_api import ChatCompletionRequest, ChatCompletionResponse, ChatMessage, FunctionCall, ToolCall
from shared.responses_api import (
    INPUT_ITEM_TYPES,
    TOKEN_FIELDS,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputItem,
    InputMessage,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    SummaryText,
)

_TEXT_PARTS = ("output_text", "input_text", "text", "refusal")


class _TokenFields(TypedDict, total=False):
    """The token fields (``TOKEN_FIELDS``) a replayed model item hands its assistant message: all
    three, or none (empty)."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]


@dataclass
class _Assistant:
    """The model items of one turn, merged into one assistant message when the turn ends."""

    open: bool = False
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tokens: _TokenFields | None = None

    def flush(self, messages: list[ChatMessage]) -> None:
        if self.open or self.text or self.tool_calls:
            messages.append(
                ChatMessage(
                    role="assistant",
                    content="".join(self.text) or None,
                    reasoning_content="\n".join(self.reasoning) or None,
                    tool_calls=self.tool_calls or None,
                    **(self.tokens or _TokenFields()),
                )
            )
        self.open, self.text, self.reasoning, self.tool_calls, self.tokens = False, [], [], [], None


def decode_item(raw: dict[str, Any], i: int) -> InputItem:
    """One input item as its Struct; a 400 naming ``input[i]`` and the field."""
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in INPUT_ITEM_TYPES:
        raise bad_request(
            f"input[{i}].type {kind!r} has no chat equivalent; supported: {', '.join(INPUT_ITEM_TYPES)}",
            param=f"input[{i}].type",
        )
    try:
        item: InputItem = msgspec.convert({**raw, "type": kind}, InputItem)  # a union: typed Any by msgspec
        return item
    except msgspec.ValidationError as exc:
        msg = str(exc)
        where = msg.rsplit("`$", 1)[-1].rstrip("`") if "`$" in msg else ""
        raise bad_request(f"input[{i}]: {msg}", param=f"input[{i}]{where}") from None


def _tokens(item: InputMessage | ReasoningItem | FunctionCallItem, i: int) -> _TokenFields | None:
    """The item's token fields, all three or none (a 400 naming the missing one)."""
    present = [f for f in TOKEN_FIELDS if getattr(item, f, None) not in (None, msgspec.UNSET)]
    if not present:
        return None
    missing = [f for f in TOKEN_FIELDS if f not in present]
    if missing:
        raise bad_request(
            f"input[{i}] carries {', '.join(present)} without {', '.join(missing)}; the token fields travel together",
            param=f"input[{i}].{missing[0]}",
        )
    prompt, generated, logprobs = item.prompt_token_ids, item.generation_token_ids, item.generation_log_probs
    assert isinstance(prompt, list) and isinstance(generated, list) and isinstance(logprobs, list)  # all present
    if len(generated) != len(logprobs):
        raise bad_request(
            f"input[{i}] has {len(generated)} generation_token_ids and {len(logprobs)} generation_log_probs",
            param=f"input[{i}].generation_log_probs",
        )
    return _TokenFields(
        prompt_token_ids=list(prompt), generation_token_ids=list(generated), generation_log_probs=list(logprobs)
    )


def _text(content: Any) -> str:
    """Text of a message's content (a string, or text/output_text/input_text/refusal parts)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = content if isinstance(content, list) else [content]
    return "".join(
        p.get("text") or p.get("refusal") or "" for p in parts if isinstance(p, dict) and p.get("type") in _TEXT_PARTS
    )


def _tool_output(output: str | list[dict[str, Any]]) -> Any:
    if isinstance(output, str):
        return output
    return [{"type": "text", "text": p.get("text", "")} for p in output]


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """Responses input items as chat messages (see the module docstring)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    turn = _Assistant()
    for i, raw in enumerate(items):
        item = decode_item(raw, i)
        if isinstance(item, InputMessage) and item.role != "assistant":
            turn.flush(messages)
            messages.append(ChatMessage(role=item.role, content=item.content))
            continue
        if isinstance(item, FunctionCallOutputItem):
            turn.flush(messages)
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_tool_output(item.output)))
            continue
        turn.open = True
        if isinstance(item, InputMessage):
            turn.text.append(_text(item.content))
        elif isinstance(item, ReasoningItem):
            turn.reasoning.extend(s.text for s in item.summary if s.text)
        else:
            call = FunctionCall(name=item.name, arguments=item.arguments)
            turn.tool_calls.append(ToolCall(id=item.call_id, function=call))
        tokens = _tokens(item, i)
        if tokens is not None:
            turn.tokens = tokens
    turn.flush(messages)
    return messages


def _fold_instructions(instructions: str | None, messages: list[ChatMessage]) -> list[ChatMessage]:
    """``instructions`` as the single leading system message (chat templates take one, first)."""
    if not instructions:
        return messages
    parts = [instructions]
    rest = list(messages)
    while rest and rest[0].role in ("system", "developer"):
        parts.append(_text(rest.pop(0).content))
    return [ChatMessage(role="system", content="\n\n".join(parts)), *rest]


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools (``strict`` dropped, as NeMo-Gym does)."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise bad_request(
                f"tools[{i}].type {tool.get('type')!r} is not supported; only function tools are",
                param=f"tools[{i}].type",
            )
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}].name is required", param=f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _template_kwargs(metadata: dict[str, str] | None) -> dict[str, Any] | None:
    """NeMo-Gym's per-row template switches: ``metadata.chat_template_kwargs`` as a JSON string."""
    raw = (metadata or {}).get("chat_template_kwargs")
    if raw is None:
        return None
    try:
        kwargs = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"metadata.chat_template_kwargs is not JSON: {exc}", param="metadata.chat_template_kwargs"
        ) from None
    if not isinstance(kwargs, dict):
        raise bad_request("metadata.chat_template_kwargs must be a JSON object", param="metadata.chat_template_kwargs")
    return kwargs


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request of one Responses call; a 400 naming the field for what chat cannot carry.
    ``stream`` is carried over: the session proxy refuses streaming for every path alike."""
    if req.background:
        raise bad_request("background responses are not supported", param="background")
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: responses are not stored; replay the items in input",
            param="previous_response_id",
        )
    tools = chat_tools(req.tools)
    return ChatCompletionRequest(
        messages=_fold_instructions(req.instructions, input_messages(req.input)),
        model=req.model,
        tools=tools,
        tool_choice=_chat_tool_choice(req.tool_choice) if tools else None,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_output_tokens,
        chat_template_kwargs=_template_kwargs(req.metadata),
        stream=bool(req.stream),
    )


def output_items(out: ChatCompletionResponse) -> list[OutputItem]:
    """The turn's output items; the last one carries the turn's token ids and logprobs."""
    m = out.choices[0].message
    items: list[OutputItem] = []
    if m.reasoning_content:
        items.append(ReasoningItem(id=f"rs_{uuid.uuid4().hex}", summary=[SummaryText(text=m.reasoning_content)]))
    if m.content or not (items or m.tool_calls):
        items.append(OutputMessage(id=f"msg_{uuid.uuid4().hex}", content=[OutputText(text=m.content or "")]))
    for tc in m.tool_calls or []:
        args = tc.function.arguments
        items.append(
            FunctionCallItem(
                call_id=tc.id,
                name=tc.function.name,
                id=tc.id,
                status="completed",
                arguments=args if isinstance(args, str) else json.dumps(args),
            )
        )
    items[-1] = msgspec.structs.replace(
        items[-1],
        prompt_token_ids=m.prompt_token_ids,
        generation_token_ids=m.generation_token_ids,
        generation_log_probs=m.generation_log_probs,
    )
    return items


def build_response(req: ResponsesRequest, out: ChatCompletionResponse) -> ResponsesResponse:
    """The Responses answer to ``req`` from the generator's chat answer ``out``."""
    choice = out.choices[0]
    incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(choice.finish_reason)
    return ResponsesResponse(
        id=f"resp_{uuid.uuid4().hex}",
        created_at=float(out.created or time.time()),
        model=req.model or out.model,
        output=output_items(out),
        parallel_tool_calls=req.parallel_tool_calls,
        tool_choice=req.tool_choice,
        tools=req.tools,
        status="incomplete" if incomplete else "completed",
        incomplete_details=IncompleteDetails(reason=incomplete) if incomplete else None,
        instructions=req.instructions,
        metadata=req.metadata,
        temperature=req.temperature,
        top_p=req.top_p,
        max_output_tokens=req.max_output_tokens,
        max_tool_calls=req.max_tool_calls,
        reasoning=req.reasoning,
        text=req.text,
        top_logprobs=req.top_logprobs,
        truncation=req.truncation,
        user=req.user,
        usage=ResponseUsage(
            input_tokens=out.usage.prompt_tokens,
            output_tokens=out.usage.completion_tokens,
            total_tokens=out.usage.total_tokens,
        ),
        weight_version=out.weight_version,
        weight_version_end=out.weight_version_end,
    )
