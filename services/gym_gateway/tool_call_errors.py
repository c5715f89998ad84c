"""Tool calls a model wrote that cannot be used: found in every chat answer a session records.

    generator: <tool_call> blocks it could not parse  -> message.tool_call_errors
               (invalid_json, missing_name, invalid_arguments, unclosed_tag; the text stays in content)
    gateway (`find_tool_call_errors`): every parsed call against the tools the request offered
               -> unknown_tool, invalid_arguments (not a JSON object)

The session proxy counts them per reason for every session, whoever runs the agent (the
trajectory's metrics ``tool_call_errors.<reason>``, the gateway's
``streamrl_gateway_tool_call_errors_total{reason}``). What the rollout does next is
``env.on_tool_call_error``:

    observe (default)  the agent sees an error observation and goes on: the built-in environments
                       answer a bad call with an error (a user message for text that did not
                       parse, a tool message for a bad call); external agents answer as they do
    end                the rollout ends as the policy failure ``tool_call_<reason>``: truncated,
                       reward 0, turns kept. Built-in environments stop at the bad answer (their
                       model client raises `ToolCallFailed` once the call is recorded); an
                       external agent's rollout is judged when it returns

Either way a malformed call is the model's mistake, never an environment error: nothing here
raises on what a model wrote. Used by the proxy, the session client and the worker.
"""

from __future__ import annotations

import json
from typing import Any

from services.gym_gateway.token_history import RecordedMessage
from shared.openai_api import ResponseMessage, ToolCallError


def offered_tool_names(tools: list[dict[str, Any]] | None) -> set[str] | None:
    """Names of the function tools a request offered; None when it offered none (then any name
    passes: the agent did not say what it has)."""
    if not tools:
        return None
    names: set[str] = set()
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else tool.get("name") if isinstance(tool, dict) else None
        if isinstance(name, str):
            names.add(name)
    return names


def arguments_error(name: str, arguments: str | dict[str, Any]) -> ToolCallError | None:
    """``invalid_arguments`` when a call's arguments are not a JSON object (an empty string is none)."""
    if isinstance(arguments, dict) or not arguments.strip():
        return None
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return ToolCallError(
            reason="invalid_arguments", message=f"arguments of tool {name!r} are not valid JSON ({exc.msg})"
        )
    if not isinstance(value, dict):
        return ToolCallError(reason="invalid_arguments", message=f"arguments of tool {name!r} are not a JSON object")
    return None


def find_tool_call_errors(
    message: ResponseMessage | RecordedMessage, tools: list[dict[str, Any]] | None
) -> list[ToolCallError]:
    """What the generator could not parse, then every parsed call that names a tool the request
    did not offer or whose arguments are not a JSON object."""
    errors = list(message.tool_call_errors or [])
    names = offered_tool_names(tools)
    for tc in message.tool_calls or []:
        name = tc.function.name
        if names is not None and name not in names:
            offered = ", ".join(sorted(names))
            errors.append(ToolCallError(reason="unknown_tool", message=f"unknown tool {name!r}; tools: {offered}"))
            continue
        bad_arguments = arguments_error(name, tc.function.arguments)
        if bad_arguments is not None:
            errors.append(bad_arguments)
    return errors


def failure_reason(reason: str) -> str:
    """The failure label of a rollout ended by a tool-call error of ``reason``
    (``env.on_tool_call_error: end``): metrics key and head of its ``fallback_reason``."""
    return f"tool_call_{reason}"


def describe(errors: list[ToolCallError]) -> str:
    """The errors' messages, for a failure's ``fallback_reason`` (after its label)."""
    return "; ".join(e.message for e in errors)
