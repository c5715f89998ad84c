"""The OpenHands driver's section (``env.openhands``), read by
`services.gym_gateway.envs.openhands` and its warm runner pool.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shared.sections.base import D, Section


class OpenHandsSection(Section):
    """Driver for OpenHands SDK agents run in their own Python environment (``env: openhands`` rows)."""

    python: Annotated[
        str,
        D(
            "Python of the OpenHands SDK's virtualenv (scripts/setup_openhands.sh); "
            "relative to the streamrl source root"
        ),
    ] = ".venv-openhands/bin/python"
    model_name: Annotated[
        str, D("model name the agent sends (as LiteLLM's openai/<name>); the session proxy serves any")
    ] = "policy"
    max_iterations: Annotated[int | None, D("cap on agent steps (one model call each); null: env.max_turns")] = None
    tools: Annotated[
        list[str], D("OpenHands tools by name (terminal, file_editor, task_tracker, glob, grep, apply_patch)")
    ] = msgspec.field(default_factory=lambda: ["terminal", "file_editor"])
    default_tools: Annotated[
        list[str],
        D(
            "OpenHands built-in tools kept (FinishTool, ThinkTool); an episode ends at finish or at a reply "
            "without tool calls"
        ),
    ] = msgspec.field(default_factory=lambda: ["FinishTool", "ThinkTool"])
    terminal_type: Annotated[
        Literal["tmux", "subprocess"] | None, D("backend of the terminal tool; null: tmux when installed")
    ] = None
    native_tool_calling: Annotated[
        bool, D("tools as the API's tools field (else described in the prompt and parsed from text)")
    ] = True
    system_prompt: Annotated[
        str | None, D("system prompt replacing OpenHands' own (tool guidance is still added); null: OpenHands'")
    ] = None
    timeout_s: Annotated[
        float | None,
        D(
            "agent time limit; the agent is then stopped and its workspace scored (truncated); "
            "null: only the rollout deadline"
        ),
    ] = None
    llm_timeout_s: Annotated[float, D("limit of one model call made by the agent")] = 300.0
    num_retries: Annotated[int, D("retries of a failed model call inside the agent (1-4 s apart)")] = 1
    check_timeout_s: Annotated[float, D("limit of a task's check command; past it the reward is 0")] = 60.0
    workspace_root: Annotated[
        str | None, D("parent folder of per-rollout workspaces; null: the system temp folder")
    ] = None
    mask_truncated: Annotated[
        bool, D("flag rollouts that end without the agent finishing (masked out of the loss)")
    ] = False
    warm_runners: Annotated[
        int, D("runners that import the SDK once and fork each episode; 0: a fresh process per rollout"), Meta(ge=0)
    ] = 0
