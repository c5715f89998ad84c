"""A real policy for the NeMo-Gym package's ``example_session_state_mgmt`` environment: the tiny
model fine-tuned (`streamrl.warmstart.fine_tune`) on demonstrated counter episodes, rendered with
the chat template and the tools the gateway passes the generator for the package's rows.

An episode of a package row as its ``simple_agent`` plays it: the user asks "add A then add B then
get the count"; the policy calls ``increment_counter`` once per number, then ``get_counter_value``,
then says the count. The demonstrations are the rows' own prompts (a tiny model does not learn to
copy digits in a few steps, but it learns five prompts), and each increment uses the asked number
only with probability ``p_right`` (otherwise a random one), so the fine-tuned policy earns the
verifier's reward of 1 on some rollouts and 0 on others: GRPO has advantages to learn from.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from services.gym_gateway.responses import chat_tools
from streamrl.warmstart import Conversation, WarmStartSpec, fine_tune

# 150 steps left the call format unlearned (greedy tool calls not JSON, the final loss 0.12);
# from 200 (loss 0.04) every sampled call parses.
SPEC = WarmStartSpec(steps=250, batch_size=8, lr=3e-3, seed=7)


def _call(i: int, name: str, arguments: dict[str, Any]) -> list[dict[str, Any]]:
    call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]}]


def counter_episode(row: dict[str, Any], rng: random.Random, p_right: float) -> Conversation:
    """One demonstrated episode of a package row (its prompt, tools and initial count)."""
    params = row["responses_create_params"]
    [ask] = [m["content"] for m in params["input"] if m.get("role") == "user"]
    count = row["initial_count"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": ask}]
    for i, n in enumerate(int(x) for x in re.findall(r"\d+", ask)):
        used = n if rng.random() < p_right else rng.randint(1, 9)
        count += used
        messages += _call(i, "increment_counter", {"count": used})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": '{"success":true}'})
    last = len(messages)
    messages += _call(last, "get_counter_value", {})
    value = json.dumps({"count": count}, separators=(",", ":"))  # the resources server's JSON body
    messages.append({"role": "tool", "tool_call_id": f"call_{last}", "content": value})
    messages.append({"role": "assistant", "content": f"The count is {count}."})
    return Conversation(messages, chat_tools(params["tools"]) or [])


def counter_policy(
    model_dir: Path, out: Path, rows: list[dict[str, Any]], *, p_right: float = 0.8, n: int = 300
) -> Path:
    """``model_dir`` fine-tuned on ``n`` demonstrated episodes of ``rows`` into ``out``."""
    rng = random.Random(SPEC.seed)
    fine_tune(model_dir, out, [counter_episode(rng.choice(rows), rng, p_right) for _ in range(n)], SPEC, rng)
    return out
