"""The SWE agent's tools, R2E-Gym style: ``execute_bash``, ``str_replace_editor`` and ``finish``.

* ``execute_bash(command)``: runs in the workspace through the runtime; the output (cut to
  ``env.swe.max_output_chars``) and the exit code go back to the model.
* ``str_replace_editor(command, path, ...)``: ``view`` (a file with line numbers, or a folder two
  levels deep), ``create`` (a new file) and ``str_replace`` (one unique occurrence). Paths are
  absolute under the workspace as commands see it, or relative to it; nothing outside it.
  ``file_editor`` is accepted as another name for it.
* ``finish()``: the agent is done.

A bad call (unknown tool, bad arguments, no match) is tool output for the model, never an error
of the rollout; only a failing runtime raises (`SandboxError`). Called by the SWE agent loop.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from services.gym_gateway.envs.swe.runtime import Workspace

_VIEW_MAX_CHARS = 12000
_SKIP_LISTING = {".git", "__pycache__", ".pytest_cache"}


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


TOOLS = [
    _fn("execute_bash", "Run a bash command in the repository.", {"command": {"type": "string"}}, ["command"]),
    _fn(
        "str_replace_editor",
        "View, create or edit a file (old_str must be unique).",
        {
            "command": {"type": "string", "enum": ["view", "create", "str_replace"]},
            "path": {"type": "string"},
            "file_text": {"type": "string"},
            "old_str": {"type": "string"},
            "new_str": {"type": "string"},
            "view_range": {"type": "array", "items": {"type": "integer"}},
        },
        ["command", "path"],
    ),
    _fn("finish", "Submit the repository as it is now.", {}, []),
]


class ToolError(Exception):
    """A bad tool call: its message goes back to the model."""


async def run_tool(ws: Workspace, name: str, arguments: str | dict[str, Any] | None) -> tuple[str, bool]:
    """(output for the model, whether the agent finished)."""
    try:
        args = _args(arguments)
        if name == "finish":
            return "Submitted.", True
        if name == "execute_bash":
            return await _bash(ws, args), False
        if name in ("str_replace_editor", "file_editor"):
            return edit(ws, args), False
        raise ToolError(f"unknown tool {name!r}; the tools are execute_bash, str_replace_editor, finish")
    except ToolError as exc:
        return f"error: {exc}", False


def _args(arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as exc:
        raise ToolError(f"arguments are not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    return args


async def _bash(ws: Workspace, args: dict[str, Any]) -> str:
    cmd = args.get("command")
    if not isinstance(cmd, str) or not cmd.strip():
        raise ToolError("execute_bash needs a non-empty 'command' string")
    res = await ws.run(cmd)
    status = "timed out" if res.timed_out else f"exit code {res.exit_code}"
    return f"{res.output.rstrip()}\n[{status}]".lstrip()


def edit(ws: Workspace, args: dict[str, Any]) -> str:
    command = args.get("command")
    target = resolve(ws, args.get("path"))
    if command == "view":
        return _view(ws, target, args.get("view_range"))
    if command == "create":
        text = args.get("file_text")
        if not isinstance(text, str):
            raise ToolError("create needs a 'file_text' string")
        if target.exists():
            raise ToolError(f"{args['path']} exists; use str_replace to change it")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        return f"Created {args['path']} ({len(text.splitlines())} lines)."
    if command == "str_replace":
        return _replace(target, args)
    raise ToolError(f"unknown command {command!r}; use view, create or str_replace")


def resolve(ws: Workspace, path: Any) -> Path:
    if not isinstance(path, str) or not path:
        raise ToolError("a 'path' string is needed")
    p = PurePosixPath(path)
    if p.is_absolute():
        try:
            p = p.relative_to(ws.workdir)
        except ValueError:
            raise ToolError(f"{path} is outside the repository ({ws.workdir})") from None
    root = ws.path.resolve()
    full = (root / p).resolve()
    if full != root and root not in full.parents:
        raise ToolError(f"{path} is outside the repository ({ws.workdir})")
    return full


def _view(ws: Workspace, target: Path, view_range: Any) -> str:
    if target.is_dir():
        root = ws.path.resolve()
        lines = []
        for p in sorted(target.rglob("*")):
            rel = p.relative_to(target)
            if len(rel.parts) <= 2 and not _SKIP_LISTING & set(rel.parts):
                lines.append(str(PurePosixPath(ws.workdir) / p.relative_to(root)) + ("/" if p.is_dir() else ""))
        return _cap("\n".join(lines) or "(empty folder)")
    if not target.is_file():
        raise ToolError(f"{target.name} does not exist")
    text = target.read_text(errors="replace").splitlines()
    first, last = 1, len(text)
    if view_range is not None:
        if not (isinstance(view_range, list) and len(view_range) == 2 and all(isinstance(i, int) for i in view_range)):
            raise ToolError("view_range must be [first, last] line numbers")
        first, last = max(1, view_range[0]), (len(text) if view_range[1] == -1 else min(len(text), view_range[1]))
    return _cap("\n".join(f"{i:6d}\t{text[i - 1]}" for i in range(first, last + 1)) or "(empty file)")


def _replace(target: Path, args: dict[str, Any]) -> str:
    old, new = args.get("old_str"), args.get("new_str", "")
    if not isinstance(old, str) or not old:
        raise ToolError("str_replace needs a non-empty 'old_str' string")
    if not isinstance(new, str):
        raise ToolError("'new_str' must be a string")
    if not target.is_file():
        raise ToolError(f"{target.name} does not exist")
    text = target.read_text()
    count = text.count(old)
    if count != 1:
        raise ToolError(f"old_str occurs {count} times in {target.name}; it must occur exactly once")
    start = text[: text.index(old)].count("\n")
    text = text.replace(old, new)
    target.write_text(text)
    lines = text.splitlines()
    snippet = "\n".join(
        f"{i + 1:6d}\t{lines[i]}" for i in range(max(0, start - 3), min(len(lines), start + new.count("\n") + 4))
    )
    return f"Edited {target.name}:\n{snippet}"


def _cap(text: str) -> str:
    if len(text) <= _VIEW_MAX_CHARS:
        return text
    return text[:_VIEW_MAX_CHARS] + f"\n[... {len(text) - _VIEW_MAX_CHARS} characters cut; view a line range ...]"
