"""``guess_number``: a multi-turn tool-use task that rewards using the environment's feedback.

The environment picks a secret integer in [1, high]; the model calls the ``guess`` tool, the tool
answers "higher", "lower" or "correct", and the model guesses again:

    user: I picked a secret integer from 1 to 7. Find it with the guess tool; you have 3 guesses.
    assistant: <tool_call>{"name": "guess", "arguments": {"number": 4}}</tool_call>
    tool: higher
    assistant: <tool_call>{"name": "guess", "arguments": {"number": 6}}</tool_call>
    tool: lower
    assistant: <tool_call>{"name": "guess", "arguments": {"number": 5}}</tool_call>
    tool: correct

Reward 1.0 when a guess is correct within the budget, else 0.0. Guessing at random wins about a
third of the time with 7 numbers and 3 guesses; bisecting on the feedback always wins, so the
reward rises only if the policy learns to condition on what the environment told it. An assistant
message without a tool call ends the episode (reward 0); so does running out of guesses (the
budget, or ``max_turns`` model calls when fewer). A call to another tool, bad arguments, or
tool-call text the generator could not parse are answered with an error and spend the turn.
"""

from __future__ import annotations

import json
import random
from typing import Any

from services.gym_gateway.envs.base import ModelClient, Outcome, tool_call_error_observation
from shared.sections.gateway import EnvSection

GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the secret number; the answer is higher, lower or correct.",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
    },
}


def prompt(instance: dict[str, Any]) -> str:
    return (
        f"I picked a secret integer from 1 to {instance['high']}. Find it with the guess tool; "
        f"you have {instance['budget']} guesses."
    )


def feedback(secret: int, arguments: str | dict[str, Any]) -> str:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        n = int(args["number"])
    except (ValueError, KeyError, TypeError):
        return 'error: arguments must be {"number": <integer>}'
    return "correct" if n == secret else "higher" if secret > n else "lower"


class GuessNumberEnv:
    name = "guess_number"

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> GuessNumberEnv:
        return cls()  # nothing to configure

    def make_instances(self, n: int, seed: int, high: int = 7, budget: int = 3) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [{"secret": rng.randint(1, high), "high": high, "budget": budget} for _ in range(n)]

    async def aclose(self) -> None:
        """Nothing is kept between rollouts."""

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        secret, budget = int(instance["secret"]), int(instance["budget"])
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt(instance)}]
        guesses = invalid = 0
        for turn in range(min(max_turns, budget)):
            msg = (await llm.chat(messages, tools=[GUESS_TOOL])).choices[0].message
            calls = msg.tool_calls or []
            call = next((tc for tc in calls if tc.function.name == "guess"), calls[0] if calls else None)
            parse_error = tool_call_error_observation(msg)
            if call is None:
                if parse_error is None:
                    return Outcome(
                        reward=0.0, metrics={"turns": turn + 1, "guesses": guesses, "invalid": invalid, "gave_up": 1.0}
                    )
                invalid += 1  # tool-call text that did not parse: the model is told, and the turn is spent
                messages += [{"role": "assistant", "content": msg.content or ""}, parse_error]
                continue
            name = call.function.name
            messages.append(
                {
                    "role": "assistant",
                    "content": msg.content or "",
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": name, "arguments": call.function.arguments},
                        }
                    ],
                }
            )
            answer = feedback(secret, call.function.arguments) if name == "guess" else f"error: unknown tool {name!r}"
            guesses += name == "guess"
            invalid += answer.startswith("error")
            if answer == "correct":
                return Outcome(
                    reward=1.0, metrics={"turns": turn + 1, "guesses": guesses, "invalid": invalid, "gave_up": 0.0}
                )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        turns = min(max_turns, budget)
        return Outcome(reward=0.0, metrics={"turns": turns, "guesses": guesses, "invalid": invalid, "gave_up": 0.0})
