"""The NeMo-Gym driver's pure parts: the /run body it posts for a row, how a verify response becomes
an Outcome (or an infrastructure failure), agent lookup by name, and config entries."""

from __future__ import annotations

import msgspec
import pytest

from services.gym_gateway.envs import get_env
from services.gym_gateway.envs.base import ChatClient, InfraError
from services.gym_gateway.envs.nemo_gym import NemoGymEnv, NemoGymFailure, VerifyResult, server_entry
from shared.protocol import SamplingParams
from shared.sections.env_nemo_gym import NemoGymSection
from shared.sections.gateway import EnvSection

pytestmark = pytest.mark.unit

ROW = {
    "responses_create_params": {"input": "hi", "temperature": 0.2, "max_output_tokens": 4096},
    "agent_ref": {"type": "responses_api_agents", "name": "crossing_agent"},
    "light": "red",
    "env": "nemo_gym",
}


def _llm(session_id: str = "g1.0.ab12cd34", **sampling) -> ChatClient:
    return ChatClient(
        f"http://gw/sessions/{session_id}/v1",
        None,
        timeout_s=5.0,
        session_id=session_id,
        sampling=SamplingParams(temperature=0.9, top_p=0.95, max_tokens=256, **sampling),
    )


def test_the_run_body_is_the_row_with_rollout_ids_and_the_tasks_sampling():
    env = NemoGymEnv(NemoGymSection())
    body = env.run_body(ROW, _llm())
    assert body["_ng_rollout_id"] == "g1.0.ab12cd34" and "env" not in body
    assert body["light"] == "red" and body["agent_ref"] == ROW["agent_ref"]
    assert body["responses_create_params"] == {
        "input": "hi",
        "temperature": 0.9,
        "top_p": 0.95,
        "max_output_tokens": 256,
    }
    assert ROW["responses_create_params"]["temperature"] == 0.2  # the shared row is not touched
    uncapped = env.run_body({**ROW, "responses_create_params": {"input": "hi", "max_output_tokens": 64}}, _llm())
    assert uncapped["responses_create_params"]["max_output_tokens"] == 64


def test_identical_rows_share_a_task_index_and_count_their_rollouts():
    env = NemoGymEnv(NemoGymSection())
    a, b = env.run_body(ROW, _llm()), env.run_body(dict(ROW), _llm("g1.1.ab12cd34"))
    other = env.run_body({**ROW, "light": "green"}, _llm())
    assert a["_ng_task_index"] == b["_ng_task_index"] != other["_ng_task_index"]
    assert (a["_ng_rollout_index"], b["_ng_rollout_index"], other["_ng_rollout_index"]) == (0, 1, 0)
    own = env.run_body({**ROW, "_ng_task_index": 7, "_ng_rollout_index": 3}, _llm())
    assert (own["_ng_task_index"], own["_ng_rollout_index"]) == (7, 3)


@pytest.mark.parametrize(
    "row, session_id, words",
    [
        ({"agent_ref": {"name": "a"}}, "g1.0.x", "responses_create_params"),
        (ROW, "g1/0", "rollout id"),
    ],
)
def test_bad_rows_and_ids_are_errors_that_say_what(row, session_id, words):
    with pytest.raises(ValueError, match=words):
        NemoGymEnv(NemoGymSection()).run_body(row, _llm(session_id))


def _verify(**fields) -> VerifyResult:
    return msgspec.convert({"reward": 0.75, **fields}, VerifyResult)


def test_a_verified_rollout_keeps_its_reward_and_reward_components():
    out = NemoGymEnv(NemoGymSection()).outcome(_verify(mask_sample=False, reward_components={"format": 1.0}))
    assert (out.reward, out.status, out.mask_sample) == (0.75, "ok", False)
    assert out.metrics == {"reward.format": 1.0}


@pytest.mark.parametrize(
    "fields, metric",
    [
        ({"mask_sample": True}, None),
        ({"failure_kind": "agent_timeout", "failure_reason": "took too long"}, "nemo_gym_failure.agent_timeout"),
        ({"_ng_failure_class": "judge_failed"}, "nemo_gym_failure.judge_failed"),
    ],
)
def test_flagged_and_failed_rollouts_are_trained_masked(fields, metric):
    out = NemoGymEnv(NemoGymSection()).outcome(_verify(**fields))
    assert (out.status, out.mask_sample, out.reward) == ("env_flagged", True, 0.75)
    assert list(out.metrics) == ([metric] if metric else [])


def test_failure_kinds_listed_as_infrastructure_fail_the_rollout():
    env = NemoGymEnv(NemoGymSection(infra_failure_kinds=["sandbox_error"]))
    with pytest.raises(NemoGymFailure, match="sandbox_error: container died") as err:
        env.outcome(_verify(failure_kind="sandbox_error", failure_reason="container died", mask_sample=True))
    assert isinstance(err.value, InfraError) and err.value.reason == "nemo_gym_failure"
    assert env.outcome(_verify(failure_kind="agent_timeout")).status == "env_flagged"


async def test_agents_are_found_by_agent_ref_or_the_default_agent():
    cfg = NemoGymSection(agent_servers={"crossing_agent": "http://127.0.0.1:9/"}, default_agent="crossing_agent")
    env = NemoGymEnv(cfg)
    assert (await env.agent(ROW, None)).url == "http://127.0.0.1:9"
    assert (await env.agent({"responses_create_params": {}}, None)).name == "crossing_agent"
    with pytest.raises(ValueError, match="env.nemo_gym.agent_servers"):
        await env.agent({**ROW, "agent_ref": {"name": "other"}}, None)


def test_the_registry_builds_the_driver_from_the_env_section():
    env = get_env("nemo_gym", EnvSection(nemo_gym=NemoGymSection(agent_servers={"a": "http://x"})))
    assert isinstance(env, NemoGymEnv) and env.cfg.agent_servers == {"a": "http://x"}


def test_server_entries_are_found_under_their_server_type_and_implementation():
    config = {
        "agent": {"responses_api_agents": {"simple_agent": {"host": "127.0.0.1", "port": 5, "max_steps": 3}}},
        "policy_model_name": "m",
    }
    assert server_entry(config, "agent")["port"] == 5
    assert server_entry(config, "policy_model_name") is None and server_entry(config, "missing") is None
