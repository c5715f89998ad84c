"""A run that trains on what an external agent produced through the session API, end to end in
one process: the trainer's control plane running its real loop (torch learner on the tiny model),
a generator (transformers engine) and a gym gateway served on loopback ports, a real Valkey, and
the API token set.

The run's prompts are rows of environment ``external``. The agent is docs/sessions.md's loop in a
thread: plain ``httpx`` to claim a task (POST /sessions) and complete it with its reward, the
official ``openai`` client for two chat turns through the session's URL, the model's first answer
replayed as text. What a user relies on: every step trains a full batch of the agent's rollouts,
each published once and trained once, and each trajectory holds the exact tokens and logprobs
the agent was answered with, the second turn continuing the first without a prefix break.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from typing import Any

import httpx
import openai
import pytest

from services.generator.app import build_app as build_generator
from services.gym_gateway.app import build_app as build_gateway
from shared import keys as K
from shared.protocol import Trajectory, decode
from shared.records import TrainerState, read_records, step_records
from shared.streams import connect
from streamrl.redis_server import free_port
from tests.support.trainer import control_plane, run_to_end, trainer_config

pytestmark = pytest.mark.integration

TOKEN = "ext-train-5e0c7a1b92d4"
STEPS, PROMPTS, GENERATIONS = 2, 2, 2


class Agent(threading.Thread):
    """The agent loop of docs/sessions.md: claim, chat twice, complete with reward 1 for odd rows of
    a group. ``done`` maps each completed task id to (grant, the two answers, the complete's answer)."""

    def __init__(self, gateway_url: str) -> None:
        super().__init__(name="external-agent", daemon=True)
        self.gateway_url = gateway_url
        self.stop = threading.Event()
        self.done: dict[str, tuple[dict[str, Any], list[Any], dict[str, Any]]] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        try:
            with httpx.Client(base_url=self.gateway_url, headers=auth, timeout=60) as http:
                while not self.stop.is_set():
                    claimed = http.post("/sessions")
                    if claimed.status_code == 204:
                        time.sleep(0.05)
                        continue
                    claimed.raise_for_status()
                    grant = claimed.json()
                    answers = self.play(grant)
                    reward = float(grant["index_in_group"] % 2)
                    done = http.post(grant["complete_url"], json={"reward": reward, "metrics": {"agent_turns": 2}})
                    done.raise_for_status()
                    self.done[grant["task_id"]] = (grant, answers, done.json())
        except BaseException as exc:  # reported by the test
            self.error = exc

    @staticmethod
    def play(grant: dict[str, Any]) -> list[Any]:
        llm = openai.OpenAI(base_url=grant["base_url"], api_key=TOKEN, max_retries=0)
        messages = [{"role": "user", "content": grant["instance"]["question"]}]
        first = llm.chat.completions.create(model="policy", messages=messages)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "Say it again."},
        ]
        second = llm.chat.completions.create(model="policy", messages=messages)
        return [first, second]


def _config(tmp_path, redis_url, tiny_model_dir):
    data = tmp_path / "external.jsonl"
    rows = [{"env": "external", "instance": {"question": f"What is {i} plus {i}?"}} for i in range(PROMPTS)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return trainer_config(
        tmp_path,
        redis_url,
        tiny_model_dir,
        "ext-train",
        data={"train_path": str(data), "val_path": str(data)},
        policy={"generation": {"backend": "transformers", "max_new_tokens": 8}},
        grpo={
            "max_num_steps": STEPS,
            "num_prompts_per_step": PROMPTS,
            "num_generations_per_prompt": GENERATIONS,
            "async_grpo": {"max_trajectory_age_steps": 1},
        },
        gym_gateway={"max_concurrent_rollouts": 8, "rollout_timeout_s": 60},
        trainer={"data_timeout_s": 120.0, "refit_timeout_s": 60.0, "startup_timeout_s": 60.0},
        logger={"plot": False, "tensorboard": False},
    )


def _assert_token_exact(traj: Trajectory, answers: list[Any]) -> None:
    first, second = answers
    t1, t2 = traj.turns
    p1, m1 = first.model_extra["prompt_token_ids"], first.choices[0].message.model_extra
    assert list(t1.prompt()) == p1 and t1.context_len == 0
    assert list(t1.generated()) == m1["generation_token_ids"]
    assert list(t1.logprobs()) == pytest.approx(m1["generation_log_probs"], abs=1e-6)
    p2, m2 = second.model_extra["prompt_token_ids"], second.choices[0].message.model_extra
    context = p1 + m1["generation_token_ids"]
    assert t2.context_len == len(context) and p2[: len(context)] == context  # the model's own tokens, spliced
    assert list(t2.prompt()) == p2[len(context) :] and list(t2.generated()) == m2["generation_token_ids"]
    assert list(t2.logprobs()) == pytest.approx(m2["generation_log_probs"], abs=1e-6)


async def test_a_run_trains_on_the_rollouts_an_external_agent_completed(
    tiny_model_dir, redis_url, tmp_path, serve_app, monkeypatch
):
    monkeypatch.setenv("STREAMRL_API_TOKEN", TOKEN)
    cfg = _config(tmp_path, redis_url, tiny_model_dir)
    control = control_plane(cfg)
    gen_port, gw_port = free_port(), free_port()
    async with (
        serve_app(build_generator(cfg, worker_id="gen-0", port=gen_port), gen_port),
        serve_app(build_gateway(cfg, worker_id="gw-0", port=gw_port), gw_port) as gw_url,
    ):
        agent = Agent(gw_url)
        agent.start()
        await control.open()
        try:
            await run_to_end(asyncio.create_task(control.run()), 300)
        finally:
            agent.stop.set()
            await asyncio.to_thread(agent.join, 60)
            await control.aclose()
    assert agent.error is None, repr(agent.error)
    assert control.state == TrainerState.FINISHED and control.step == STEPS

    records = step_records(read_records(control.log_dir / "metrics.jsonl"))
    assert [r.step for r in records] == list(range(STEPS))
    consumed = [tid for r in records for tid in r.consumed_ids]
    assert all(len(r.consumed_ids) == PROMPTS * GENERATIONS for r in records)
    assert len(consumed) == len(set(consumed)) and set(consumed) <= set(agent.done)  # trained once, all the agent's
    for r in records:
        assert r.batch.num_placeholders == 0 and r.batch.num_prefix_breaks == 0 and r.batch.num_masked_samples == 0
        assert r.batch.reward_mean == 0.5 and r.batch.env["agent_turns"] == 2.0 and r.learner.num_updates >= 1

    redis = connect(redis_url)
    try:
        entries = await redis.xrange(control.keys.trajectories)
        pending = await redis.xpending(control.keys.tasks, K.GATEWAYS_GROUP)
    finally:
        await redis.aclose()
    published = [decode(fields[K.ENTRY_FIELD], Trajectory) for _, fields in entries]
    assert Counter(t.task_id for t in published) == Counter(set(agent.done))  # each completed rollout, once
    assert pending["pending"] == 0
    for traj in published:
        grant, answers, completed = agent.done[traj.task_id]
        assert traj.status == "ok" and traj.env == "external" and traj.reward == grant["index_in_group"] % 2
        assert completed == {
            "session_id": grant["session_id"],
            "task_id": traj.task_id,
            "model_calls": 2,
            "prefix_breaks": 0,
        }
        _assert_token_exact(traj, answers)
