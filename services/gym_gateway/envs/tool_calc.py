"""``tool_calc``: a multi-turn tool-use task a tiny model can learn on a CPU (the default ``env.name``).

The user asks for ``a op b`` and is told to use the calculator. A good episode takes two model
turns with environment feedback between them:

    user: What is 23 + 48? Use the calculator.
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "23 + 48"}}</tool_call>
    tool: 71
    assistant: The answer is 71.

Reward 1.0 when the final answer's last integer equals the true result, else 0.0. The episode ends
at the first assistant message without a tool call, or after ``max_turns`` model calls
(status ``truncated``). A bad call (unknown tool, bad arguments), or tool-call text the generator
could not parse, is answered with an error and the episode goes on. The calculator evaluates
integer + - * only (parsed, never ``eval``).
"""

from __future__ import annotations

import ast
import json
import random
import re
from typing import Any

from services.gym_gateway.envs.base import ModelClient, Outcome, assistant_message, tool_call_error_observation
from shared.sections.gateway import EnvSection

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer arithmetic expression with + - *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
_INT = re.compile(r"-?\d+")


def question(instance: dict[str, Any]) -> str:
    return f"What is {instance['a']} {instance['op']} {instance['b']}? Use the calculator."


def truth(instance: dict[str, Any]) -> int:
    return evaluate(f"{instance['a']} {instance['op']} {instance['b']}")


def evaluate(expression: str) -> int:
    """Integer + - * arithmetic; ValueError on anything else."""
    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        node = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}") from exc
    return _eval(node)


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Mult) and abs(left * right) > 10**12:
            raise ValueError("result too large")
        return (
            left + right
            if isinstance(node.op, ast.Add)
            else left - right
            if isinstance(node.op, ast.Sub)
            else left * right
        )
    raise ValueError("only integers and + - * are allowed")


def final_answer(text: str | None) -> int | None:
    found = _INT.findall(text or "")
    return int(found[-1]) if found else None


def run_tool_call(name: str, arguments: str | dict[str, Any]) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = arguments if isinstance(arguments, dict) else json.loads(arguments) if arguments else {}
        return str(evaluate(str(args["expression"])))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


class ToolCalcEnv:
    name = "tool_calc"

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> ToolCalcEnv:
        return cls()  # nothing to configure

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            # Two-digit operands keep the prompt layout fixed, so copying them is learnable by a
            # tiny model in a short warm start; the task is the same for any operand width.
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            op = rng.choice("+-")
            if op == "-" and b > a:
                a, b = b, a
            out.append({"a": a, "b": b, "op": op})
        return out

    async def aclose(self) -> None:
        """Nothing is kept between rollouts."""

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        messages: list[dict[str, Any]] = [{"role": "user", "content": question(instance)}]
        tool_calls = tool_errors = 0
        for turn in range(max_turns):
            resp = await llm.chat(messages, tools=[CALCULATOR_TOOL])
            msg = resp.choices[0].message
            messages.append(assistant_message(msg))
            parse_error = tool_call_error_observation(msg)
            if not msg.tool_calls and parse_error is None:
                answer = final_answer(msg.content)
                correct = answer is not None and answer == truth(instance)
                return Outcome(
                    reward=1.0 if correct else 0.0,
                    metrics={"turns": turn + 1, "tool_calls": tool_calls, "tool_errors": tool_errors, "answered": 1.0},
                )
            for tc in msg.tool_calls or []:
                result = run_tool_call(tc.function.name, tc.function.arguments)
                tool_calls += 1
                tool_errors += result.startswith("error")
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
            if parse_error is not None:  # a tool call that did not parse: the model is told, and goes on
                tool_errors += 1
                messages.append(parse_error)
        return Outcome(
            reward=0.0,
            status="truncated",
            metrics={"turns": max_turns, "tool_calls": tool_calls, "tool_errors": tool_errors, "answered": 0.0},
        )
