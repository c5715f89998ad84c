"""The OpenHands driver's tests (tests/integration/test_openhands_agent.py, test_openhands_warm.py):
a short agent setup that keeps the tiny model's prompt near 3k tokens, the task it is given, and
the environment section and tasks that run it. The SDK's virtualenv is checked by the
``openhands_venv`` fixture (tests/integration/conftest.py)."""

from __future__ import annotations

from shared.protocol import SamplingParams, Task
from tests.support.messages import make_task

# A short system prompt and two tools keep the agent's prompt near 3k tokens of the tiny model.
OPENHANDS = {
    "tools": ["terminal"],
    "default_tools": ["FinishTool"],
    "system_prompt": "You are a coding agent. Work in the current folder with the terminal tool, then call finish.",
}
TASK = {
    "prompt": "Create a file answer.txt holding the number 5.",
    "check": 'test "$(cat answer.txt)" = 5',
    "files": {"README.md": "Put the answer in answer.txt.\n"},
}


def openhands_task(
    i: int, *, sampling: SamplingParams, instance: dict | None = None, deadline_s: float = 300.0
) -> Task:
    """Rollout ``oh{i}/0`` of the ``openhands`` environment (`TASK` unless ``instance``)."""
    kw = {"instance": instance or TASK, "prompt_index": i, "kind": sampling.kind, "sampling": sampling}
    return make_task(f"oh{i}", env="openhands", deadline_s=deadline_s, **kw)


def env_section(**openhands) -> dict:
    """The run config's ``env`` section: OpenHands, 3 turns, `OPENHANDS` updated by ``openhands``."""
    return {"name": "openhands", "max_turns": 3, "openhands": {**OPENHANDS, **openhands}}
