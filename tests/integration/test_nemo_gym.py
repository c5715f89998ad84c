"""The NeMo-Gym driver's failure paths and protocol corners, against servers written to NeMo-Gym's
protocol (tests/support/fakes/nemo_gym.py) that can be broken on purpose: a head server, a resources
server and a simple agent, served on loopback ports, drive rollouts through a real gateway (worker,
session proxy, NeMo-Gym routes) and a real generator (transformers engine). The real nemo-gym
package's servers, unbroken, are tested in test_nemo_gym_package.py.

The policy is the tiny model fine-tuned to call the ``look`` tool for the row's prompt, and the
tasks are validation tasks (greedy), so every episode is: model call 1 -> function_call ``look`` ->
resources server -> model call 2 -> verify. Checked: the reward is the one /verify returned; the
trajectory's turns hold exactly the token ids and logprobs the gateway returned to the agent; the
second call continued the first turn's tokens (no prefix break); a dead resources server, an
unreachable agent and an agent whose model server is not the gateway fail as infrastructure with
their reasons. NeMo-Gym's vllm_model requests (chat with token ids, /tokenize) work on the rollout
paths too, and a call that reaches another gateway worker is forwarded to the session's owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import pytest

from services.generator.chat import normalize_messages
from services.gym_gateway.responses import chat_request
from shared.protocol import Task
from shared.responses_api import ResponsesRequest
from streamrl.redis_server import free_port
from tests.support.fakes.nemo_gym import (
    canned_model_app,
    crossing_resources_app,
    head_server_app,
    simple_agent_app,
)
from tests.support.gateway import collect, single_task
from tests.support.ports import HeldPorts, refused_port

pytestmark = pytest.mark.integration

LOOK = {
    "type": "function",
    "name": "look",
    "description": "See the traffic light.",
    "strict": True,
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}
PARAMS = {
    "input": [
        {"role": "developer", "content": "You are a robot at a crossing."},
        {"role": "user", "content": "Use the look tool, then reply with one word: stop, wait or go."},
    ],
    "tools": [LOOK],
}
LOOK_CALL = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'


def _row(agent: str, **fields) -> dict:
    return {
        "responses_create_params": PARAMS,
        "agent_ref": {"type": "responses_api_agents", "name": agent},
        "light": "red",
        **fields,
    }


@pytest.fixture(scope="module")
def look_model(tiny_model_dir, tiny_tokenizer, scripted_model, tmp_path_factory):
    """The tiny model fine-tuned to answer the row's prompt, as the gateway renders it, with LOOK_CALL."""
    chat = chat_request(ResponsesRequest(input=PARAMS["input"], tools=PARAMS["tools"]))
    prompt = tiny_tokenizer.apply_chat_template(
        normalize_messages(chat.messages), tools=chat.tools, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tiny_tokenizer.encode(LOOK_CALL + "<|im_end|>", add_special_tokens=False)
    return scripted_model(tiny_model_dir, tmp_path_factory.mktemp("look-model"), prompt_ids, answer_ids)


def _server(kind: str, impl: str, port: int, **extra) -> dict:
    return {kind: {impl: {"host": "127.0.0.1", "port": port, **extra}}}


def _agent(port: int, resources: str, model: str = "policy_model") -> dict:
    return _server(
        "responses_api_agents",
        "simple_agent",
        port,
        max_steps=3,
        resources_server={"type": "resources_servers", "name": resources},
        model_server={"type": "responses_api_models", "name": model},
    )


@contextlib.asynccontextmanager
async def nemo_gym(serve_app, gateway_stack, model_dir):
    """The gateway stack plus a NeMo-Gym deployment whose policy model server is the gateway:
    agents ``crossing_agent`` (live resources server), ``broken_agent`` (resources server down) and
    ``rogue_agent`` (its model server is not the gateway)."""
    async with contextlib.AsyncExitStack() as stack:
        held = HeldPorts(("head", "resources", "crossing", "broken", "rogue", "canned"))
        stack.callback(held.close)
        ports = {**held.ports, "dead": stack.enter_context(refused_port())}
        config = {
            "observability_enabled": True,
            "head_server": {"host": "127.0.0.1", "port": ports["head"]},
            "crossing_resources": _server("resources_servers", "crossing", ports["resources"]),
            "dead_resources": _server("resources_servers", "crossing", ports["dead"]),
            "other_model": _server("responses_api_models", "openai_model", ports["canned"]),
            "crossing_agent": _agent(ports["crossing"], "crossing_resources"),
            "broken_agent": _agent(ports["broken"], "dead_resources"),
            "rogue_agent": _agent(ports["rogue"], "crossing_resources", model="other_model"),
        }
        head_url = f"http://127.0.0.1:{ports['head']}"
        generation = {
            "backend": "transformers",
            "temperature": 1.0,
            "top_p": 1.0,
            "max_new_tokens": 32,
            "val_temperature": 0.0,
        }
        gw = await stack.enter_async_context(
            gateway_stack(
                model_dir=model_dir,
                policy={"generation": generation},
                env={"nemo_gym": {"head_server_url": head_url, "connect_timeout_s": 2.0}},
            )
        )
        config["policy_model"] = _server("responses_api_models", "streamrl", int(gw.url.rsplit(":", 1)[1]))
        apps = {"head": head_server_app(config), "resources": crossing_resources_app(), "canned": canned_model_app()}
        apps.update({k: simple_agent_app(f"{k}_agent", config) for k in ("crossing", "broken", "rogue")})
        for key, app in apps.items():
            await stack.enter_async_context(serve_app(app, held.release(key)))
        yield gw, apps


def _task(gw, row: dict, i: int = 0) -> Task:
    sampling = gw.cfg.policy.generation.sampling("validation")
    gid = f"ng{i}-{uuid.uuid4().hex[:6]}"
    return single_task(gid, "nemo_gym", row, prompt_index=i, kind="validation", sampling=sampling, deadline_s=120.0)


async def test_a_nemo_gym_agent_rollout_is_recorded_token_exact(serve_app, gateway_stack, look_model):
    """The real engine's tokens, compared with each model response as the agent got it (the
    package's agent returns only the episode's output items: test_nemo_gym_package.py compares
    those, on a scripted policy)."""
    async with nemo_gym(serve_app, gateway_stack, look_model) as (gw, apps):
        await gw.streams.publish(gw.streams.keys.tasks, _task(gw, _row("crossing_agent")))
        [traj] = await collect(gw.streams, 1, timeout_s=120)
    assert traj.status == "ok", traj.fallback_reason
    [verified] = apps["resources"].state.verified
    assert traj.reward == verified["reward"] >= 0.5  # the model looked: at least half the reward
    seen = apps["crossing"].state.model_responses
    assert [o["type"] for o in seen[0]["output"]] == ["function_call"]
    assert len(traj.turns) == len(seen) == 2
    for turn, response in zip(traj.turns, seen, strict=False):
        last = response["output"][-1]  # the turn's token fields ride on its last item
        assert list(turn.generated()) == last["generation_token_ids"]
        assert list(turn.logprobs()) == pytest.approx(last["generation_log_probs"], abs=1e-6)
        assert last["prompt_token_ids"][turn.context_len :] == list(turn.prompt())
        assert response["weight_version"] == turn.weight_version == 0
    first = seen[0]["output"][-1]
    history = first["prompt_token_ids"] + first["generation_token_ids"]
    assert seen[1]["output"][-1]["prompt_token_ids"][: len(history)] == history  # spliced, not re-rendered
    assert traj.turns[1].context_len == len(history) and traj.metrics["prefix_breaks"] == 0.0


async def test_infrastructure_failures_are_named(serve_app, gateway_stack, look_model):
    async with nemo_gym(serve_app, gateway_stack, look_model) as (gw, apps):
        rows = [_row("broken_agent"), _row("rogue_agent"), _row("crossing_agent", force_failure_kind="agent_timeout")]
        await gw.streams.publish_many(gw.streams.keys.tasks, [_task(gw, r, i) for i, r in enumerate(rows)])
        trajs = {t.prompt_index: t for t in await collect(gw.streams, 3, timeout_s=120)}
    broken, rogue, flagged = trajs[0], trajs[1], trajs[2]
    assert broken.status == "failed" and broken.fallback_reason.startswith("nemo_gym_resources")
    assert "dead_resources" in broken.fallback_reason and not broken.turns
    assert rogue.status == "failed" and rogue.fallback_reason.startswith("nemo_gym_routing")
    assert flagged.status == "env_flagged" and flagged.mask_sample is True
    assert flagged.metrics["nemo_gym_failure.agent_timeout"] == 1.0 and len(flagged.turns) == 2


async def test_an_unreachable_agent_is_an_infrastructure_failure(gateway_stack):
    with refused_port() as port:
        dead = f"http://127.0.0.1:{port}"
        async with gateway_stack(env={"nemo_gym": {"agent_servers": {"crossing_agent": dead}}}) as gw:
            await gw.streams.publish(gw.streams.keys.tasks, _task(gw, _row("crossing_agent")))
            [traj] = await collect(gw.streams, 1)
    assert traj.status == "failed" and traj.fallback_reason.startswith("nemo_gym_agent")
    assert dead in traj.fallback_reason


async def test_vllm_model_requests_work_on_the_rollout_paths(gateway_stack):
    """NeMo-Gym's vllm_model with return_token_id_information: chat with logprobs as token ids,
    the turn replayed with its token fields, /tokenize with the same template switches; then
    completions continuing the session's tokens and the model list, on the same paths."""
    async with gateway_stack() as gw:
        session = await gw.gateway.state.proxy.open("vm.1", "train", gw.cfg.policy.generation.sampling("train"))
        base = f"{gw.url}/ng-rollout/vm.1/training-token-capture"
        kwargs = {"enable_thinking": False}
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
        capture = {
            "logprobs": True,
            "top_logprobs": 0,
            "return_tokens_as_token_ids": True,
            "chat_template_kwargs": kwargs,
            "model": "policy",
        }
        async with httpx.AsyncClient(timeout=60) as http:
            first = (await http.post(f"{base}/v1/chat/completions", json={"messages": messages, **capture})).json()
            tokenized = (
                await http.post(
                    f"{base}/tokenize", json={"messages": messages, "model": "policy", "chat_template_kwargs": kwargs}
                )
            ).json()
            plain = (await http.post(f"{base}/tokenize", json={"messages": messages})).json()
            choice = first["choices"][0]
            m = choice["message"]
            replay = {
                "role": "assistant",
                "content": m["content"] or "",
                "reasoning_content": None,
                **{k: m[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")},
            }
            second = (
                await http.post(
                    f"{base}/v1/chat/completions",
                    json={"messages": [*messages, replay, {"role": "user", "content": "Again."}], **capture},
                )
            ).json()
            m2 = second["choices"][0]["message"]
            so_far = m2["prompt_token_ids"] + m2["generation_token_ids"]
            third = (
                await http.post(
                    f"{base}/v1/completions",
                    json={"prompt": so_far + m["prompt_token_ids"][:3], "max_tokens": 4, "logprobs": 0},
                )
            ).json()
            listed = (await http.get(f"{base}/v1/models")).json()
            missing = await http.post(f"{gw.url}/v1/responses", json={"input": "x"})
    assert choice["token_ids"] == m["generation_token_ids"]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in m["generation_token_ids"]]
    assert tokenized["tokens"] == first["prompt_token_ids"] != plain["tokens"]
    history = m["prompt_token_ids"] + m["generation_token_ids"]
    assert second["prompt_token_ids"][: len(history)] == history
    assert session.prefix_breaks == 0 and session.turns[1].context_len == len(history)
    assert (
        session.turns[2].context_len == len(so_far)
        and list(session.turns[2].generated()) == third["choices"][0]["generation_token_ids"]
    )
    assert listed["data"][0]["weight_version"] == 0
    assert missing.status_code == 404 and "observability_enabled" in missing.json()["error"]["message"]


async def test_calls_reaching_another_gateway_worker_are_forwarded_to_the_sessions_owner(gateway_stack, serve_app):
    """NeMo-Gym's config names one model server; sessions live on the worker running the rollout."""
    from services.gym_gateway.app import build_app as build_gateway
    from shared.registry import live_workers

    async with gateway_stack() as gw:
        port = free_port()
        other = build_gateway(gw.cfg, worker_id="gw-1", port=port)
        async with serve_app(other, port) as other_url:
            for _ in range(100):
                if len(await live_workers(gw.streams.redis, gw.streams.keys, "gym_gateway")) == 2:
                    break
                await asyncio.sleep(0.05)
            session = await gw.gateway.state.proxy.open("fw.1", "train", gw.cfg.policy.generation.sampling("train"))
            async with httpx.AsyncClient(timeout=60) as http:
                first = await http.post(f"{other_url}/ng-rollout/fw.1/v1/responses", json={"input": "Say hi."})
                replay = {
                    "input": [
                        {"role": "user", "content": "Say hi."},
                        *first.json()["output"],
                        {"role": "user", "content": "Again."},
                    ]
                }
                second = await http.post(f"{other_url}/ng-rollout/fw.1/v1/responses", json=replay)
                stats = await http.get(f"{other_url}/sessions/fw.1/stats")
                gone = await http.post(f"{other_url}/ng-rollout/nope.1/v1/responses", json={"input": "x"})
    assert first.status_code == second.status_code == 200
    assert first.json()["output"][-1]["generation_token_ids"] == list(session.turns[0].generated())
    assert session.calls == 2 and session.prefix_breaks == 0 and stats.json()["calls"] == 2
    assert dict(other.state.forwarder.owners) == {"fw.1": gw.url}
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "session_id"
