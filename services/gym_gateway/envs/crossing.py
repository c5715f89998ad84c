"""``crossing``: a short multi-turn tool-use task a tiny model can learn by RL on a CPU.

A robot stands at a crossing. It should call the ``look`` tool to see the traffic light, then act
on what it saw:

    user: You are a robot at a crossing. Use the look tool to see the traffic light, then reply
          with one word: stop, wait or go.
    assistant: <tool_call>{"name": "look", "arguments": {}}</tool_call>
    tool: The light is red.
    assistant: stop

Reward 1.0 when the final reply's last action word is the right one for the light (red: stop,
yellow: wait, green: go), else 0.0. Replying without looking can only be right by chance (1/3),
so the reward rises only if the policy both uses the tool and learns to act on its observation.
The episode ends at the first reply without a tool call, or after ``max_turns`` model calls
(status ``truncated``). A call to another tool, or tool-call text the generator could not parse,
is answered with an error and the episode goes on. The demo trains on this task.
"""

from __future__ import annotations

import random
import re
from typing import Any

from services.gym_gateway.envs.base import ModelClient, Outcome, assistant_message, tool_call_error_observation
from services.gym_gateway.tool_call_errors import arguments_error
from shared.sections.gateway import EnvSection

LOOK_TOOL = {
    "type": "function",
    "function": {
        "name": "look",
        "description": "Look at the traffic light; returns its colour.",
        "parameters": {"type": "object", "properties": {}},
    },
}
LIGHTS = ("red", "yellow", "green")
ACTIONS = ("stop", "wait", "go")
RULE = dict(zip(LIGHTS, ACTIONS, strict=True))
PROMPT = (
    "You are a robot at a crossing. Use the look tool to see the traffic light, then reply with "
    "one word: stop, wait or go."
)
_ACTION = re.compile(r"\b(stop|wait|go)\b", re.IGNORECASE)


def final_action(text: str | None) -> str | None:
    found = _ACTION.findall(text or "")
    return found[-1].lower() if found else None


def observation(light: str) -> str:
    return f"The light is {light}."


def run_tool_call(light: str, name: str, arguments: str | dict[str, Any]) -> str:
    if name != "look":
        return f"error: unknown tool {name!r}"
    bad = arguments_error(name, arguments)
    return f"error: {bad.message}" if bad is not None else observation(light)


class CrossingEnv:
    name = "crossing"

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> CrossingEnv:
        return cls()  # nothing to configure

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [{"light": rng.choice(LIGHTS)} for _ in range(n)]

    async def aclose(self) -> None:
        """Nothing is kept between rollouts."""

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        light = instance["light"]
        if light not in RULE:
            raise ValueError(f"crossing instance has light {light!r}; expected one of {LIGHTS}")
        messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
        looks = 0
        for turn in range(max_turns):
            msg = (await llm.chat(messages, tools=[LOOK_TOOL])).choices[0].message
            parse_error = tool_call_error_observation(msg)
            if not msg.tool_calls and parse_error is None:
                action = final_action(msg.content)
                return Outcome(
                    reward=1.0 if action == RULE[light] else 0.0,
                    metrics={"turns": turn + 1, "looked": float(looks > 0), "answered": float(action is not None)},
                )
            messages.append(assistant_message(msg))
            for tc in msg.tool_calls or []:
                result = run_tool_call(light, tc.function.name, tc.function.arguments)
                looks += not result.startswith("error")
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
            if parse_error is not None:  # a tool call that did not parse: the model is told, and goes on
                messages.append(parse_error)
        return Outcome(
            reward=0.0, status="truncated", metrics={"turns": max_turns, "looked": float(looks > 0), "answered": 0.0}
        )
