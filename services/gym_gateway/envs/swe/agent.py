"""``swe``: the built-in SWE environment. A tool-calling agent fixes an issue in a repository and
the hidden tests decide the reward.

    task row -> Instance -> runtime.workspace (fresh copy, no history, no hidden tests)
      -> model turn -> tool calls (execute_bash / str_replace_editor) -> tool outputs -> ...
         until finish, a reply without tool calls, max_turns, or a full context
      -> evaluate(instance, ws) in a fresh copy -> Outcome(reward, metrics)

A task row names a shipped or configured instance (``{"instance_id": "..."}``, looked up in
``env.swe.instances_path``) or carries a whole row in any format ``instance_from_row`` reads
(relative paths resolved against the working folder). The model's tool calls come parsed by the
generator (Qwen-style ``<tool_call>``) as OpenAI ``tool_calls``; tool-call text it could not parse
is answered with an error message and the agent goes on. The tests run whether or not the
agent called ``finish``: its files are its answer; the status is ``truncated`` when it was cut
off (max_turns or a full context). Runtime failures raise `SandboxError` (an infrastructure
failure for the worker); the agent's bad commands are only tool output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.gym_gateway.envs.base import (
    ModelClient,
    ModelRequestError,
    Outcome,
    assistant_message,
    tool_call_error_observation,
)
from services.gym_gateway.envs.swe.evaluate import evaluate
from services.gym_gateway.envs.swe.instance import Instance, InstanceError, instance_from_row, load_instances
from services.gym_gateway.envs.swe.runtime import Workspace, make_runtime
from services.gym_gateway.envs.swe.tools import TOOLS, run_tool
from shared.sections.env_swe import SweSection
from shared.sections.gateway import EnvSection

SHIPPED_INSTANCES = Path(__file__).resolve().parents[4] / "data" / "swe_instances"
# No workspace path in the prompt: it differs per rollout, and the same instance should give the
# same prompt (commands run in the repository; relative paths resolve against it).
SYSTEM_PROMPT = (
    "You are a software engineer. Fix the issue the user describes by editing the repository, which "
    "is your working folder (paths are relative to it). Hidden tests will check the fix. Call finish "
    "when you are done."
)


@dataclass
class Episode:
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finished: bool = False  # the agent called finish or replied without a tool call
    context_full: bool = False  # the model refused a request (the conversation outgrew its context)


async def run_agent(instance: Instance, ws: Workspace, llm: ModelClient, *, max_turns: int) -> Episode:
    """The tool-calling loop: at most ``max_turns`` model calls."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": instance.problem_statement},
    ]
    ep = Episode()
    while ep.turns < max_turns and not ep.finished:
        try:
            resp = await llm.chat(messages, tools=TOOLS)
        except ModelRequestError:
            ep.context_full = True
            break
        ep.turns += 1
        msg = resp.choices[0].message
        messages.append(assistant_message(msg))
        parse_error = tool_call_error_observation(msg)
        if not msg.tool_calls and parse_error is None:
            ep.finished = True
            break
        for tc in msg.tool_calls or []:
            output, done = await run_tool(ws, tc.function.name, tc.function.arguments)
            ep.tool_calls += 1
            ep.tool_errors += output.startswith("error:")
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": output})
            if done:
                ep.finished = True
                break
        if parse_error is not None and not ep.finished:  # tool-call text that did not parse: told, goes on
            ep.tool_errors += 1
            messages.append(parse_error)
    return ep


class SweEnv:
    name = "swe"

    def __init__(self, cfg: SweSection | None = None) -> None:
        self.cfg = cfg or SweSection()
        self.runtime = make_runtime(self.cfg)
        self._instances: dict[str, Instance] | None = None

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> SweEnv:
        return cls(env_cfg.swe)

    def instances(self) -> dict[str, Instance]:
        """The instances of ``env.swe.instances_path`` (the shipped set when empty), read once."""
        if self._instances is None:
            path = self.cfg.instances_path or SHIPPED_INSTANCES
            self._instances = {i.instance_id: i for i in load_instances(path)}
        return self._instances

    def resolve(self, row: dict[str, Any]) -> Instance:
        if set(row) == {"instance_id"}:
            try:
                return self.instances()[row["instance_id"]]
            except KeyError:
                where = self.cfg.instances_path or "the shipped set"
                raise InstanceError(
                    f"instance_id {row['instance_id']!r} is not in env.swe.instances_path ({where})"
                ) from None
        return instance_from_row(row, Path.cwd(), where="task instance")

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        ids = sorted(self.instances())
        rng = random.Random(seed)
        out: list[dict[str, Any]] = []
        while len(out) < n:  # every instance once per pass, in a seeded order
            rng.shuffle(ids)
            out += [{"instance_id": i} for i in ids]
        return out[:n]

    async def aclose(self) -> None:
        """Nothing is kept between rollouts: each one's workspace goes when its episode ends."""

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        inst = self.resolve(instance)
        async with self.runtime.workspace(inst) as ws:
            ep = await run_agent(inst, ws, llm, max_turns=max_turns)
            result = await evaluate(inst, ws)
        metrics = {
            "turns": float(ep.turns),
            "tool_calls": float(ep.tool_calls),
            "tool_errors": float(ep.tool_errors),
            "finished": float(ep.finished),
            "context_full": float(ep.context_full),
            **result.metrics,
        }
        return Outcome(reward=result.reward, status="ok" if ep.finished else "truncated", metrics=metrics)
