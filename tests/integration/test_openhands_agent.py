"""The OpenHands driver with a real OpenHands SDK agent (its own Python 3.12 virtualenv, from
scripts/setup_openhands.sh) against the real gateway session proxy and a real generator
(transformers engine) on the tiny model, over a real Valkey.

Covers: an episode from the tasks stream to a trajectory whose turns (token ids, logprobs) the
session recorded, with the reward computed from the workspace; the task's sampling parameters
reaching the generator (its sampling gate refuses a wrong temperature; max_tokens caps every call);
a broken harness failing as an infrastructure error; and, with a copy of the tiny model fine-tuned
to answer the agent's first prompt with a terminal command and ``finish``, a successful episode
(the agent runs the command in its workspace, finishes, and the check passes).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import aiohttp
import pytest

from services.gym_gateway.envs.base import ChatClient, ModelRequestError
from services.gym_gateway.envs.openhands import OpenHandsEnv
from shared.protocol import SamplingParams
from shared.sections.env_openhands import OpenHandsSection
from tests.support.gateway import collect
from tests.support.generator import one_torch_thread
from tests.support.openhands import OPENHANDS, TASK, env_section, openhands_task

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("openhands_venv")]

ROOT = Path(__file__).resolve().parents[2]
ANSWER = (
    '<tool_call>\n{"name": "terminal", "arguments": {"command": "echo 5 > answer.txt"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "finish", "arguments": {"message": "done"}}\n</tool_call>'
)


def _scratch_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("openhands-*")}


async def test_episode_from_task_to_trajectory_with_workspace_reward(gateway_stack):
    before = _scratch_dirs()
    async with gateway_stack(env=env_section()) as st:
        await st.streams.publish(st.streams.keys.tasks, openhands_task(1, sampling=SamplingParams(max_tokens=8)))
        [traj] = await collect(st.streams, 1, timeout_s=300)
    assert traj.status in ("ok", "truncated"), traj.fallback_reason
    # every agent call went through the session: recorded with the model's token ids and logprobs
    assert traj.turns and traj.metrics["model_calls"] == len(traj.turns) >= traj.metrics["iterations"] >= 1
    first = traj.turns[0]
    assert first.context_len == 0 and len(first.prompt()) > 1000  # OpenHands' system prompt and tools
    for turn in traj.turns:
        assert 0 < len(turn.generated()) <= 8 and len(turn.logprobs()) == len(turn.generated())
        assert turn.weight_version == 0
    # the untrained model writes no answer.txt: the check command fails in the workspace
    assert traj.reward == 0.0 and traj.metrics["check_exit"] == 1.0
    assert _scratch_dirs() == before  # workspace and job folder removed


async def test_sampling_parameters_reach_the_generator(gateway_stack):
    """The session's profile matches the generator's training parameters (temperature 1.0, top_p
    1.0, 24 tokens) and the proxy fills only what a request leaves out; the agent gets other values
    through its chat client, so only what the agent itself sends can explain the generator's
    refusals and the shorter generations."""
    env = OpenHandsEnv(OpenHandsSection(**OPENHANDS))
    async with gateway_stack(env=env_section()) as st, aiohttp.ClientSession() as http:
        proxy = st.gateway.state.proxy
        profile = SamplingParams(max_tokens=24)

        async def run(session_id: str, sampling: SamplingParams):
            session = await proxy.open(session_id, "train", profile)
            client = ChatClient(
                f"{st.url}/sessions/{session_id}/v1", http, timeout_s=300, sampling=sampling, session_id=session_id
            )
            return session, await env.rollout(TASK, client, max_turns=1)

        with pytest.raises(ModelRequestError, match="temperature"):
            await run("oh-cool", SamplingParams(temperature=0.5, max_tokens=24))
        with pytest.raises(ModelRequestError, match="top_p"):
            await run("oh-narrow", SamplingParams(top_p=0.5, max_tokens=24))
        session, outcome = await run("oh-short", SamplingParams(max_tokens=3))
    assert session.turns and all(len(t.generated()) <= 3 for t in session.turns)
    assert outcome.metrics["iterations"] == len(session.turns)


@pytest.mark.parametrize(
    ("openhands", "message"),
    [
        ({"python": "/nonexistent/venv/bin/python"}, "env.openhands.python"),  # no interpreter at all
        ({"python": str(ROOT / ".venv" / "bin" / "python")}, "openhands"),  # one without the SDK (3.11)
        ({"tools": ["terminal", "no_such_tool"]}, "unknown OpenHands tool 'no_such_tool'"),  # the SDK, misconfigured
    ],
)
async def test_a_broken_harness_is_an_infrastructure_failure(gateway_stack, openhands, message):
    async with gateway_stack(env=env_section(**openhands)) as st:
        await st.streams.publish(st.streams.keys.tasks, openhands_task(10, sampling=SamplingParams(max_tokens=8)))
        [traj] = await collect(st.streams, 1, timeout_s=120)
    assert traj.status == "failed" and traj.fallback_reason.startswith("sandbox:"), traj.fallback_reason
    assert message in traj.fallback_reason
    assert traj.turns == [] and traj.metrics["model_calls"] == 0


@pytest.fixture(scope="module")
def answer_ids(tiny_tokenizer) -> list[int]:
    ids = tiny_tokenizer.encode(ANSWER + "<|im_end|>", add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == ANSWER + "<|im_end|>"
    return ids


def fine_tune_head(
    src: Path, dst: Path, prompt_ids: list[int], answer_ids: list[int], *, max_steps: int = 2000
) -> Path:
    """A copy of ``src`` whose greedy answer to ``prompt_ids`` is ``answer_ids``.

    Only what acts on each position alone is trained: the last decoder layer's MLP and its norm,
    the final norm and the output head. Everything before them sees the same tokens at every step,
    so their output is computed once; a full fine-tune (the ``scripted_model`` fixture) would
    run a forward and backward pass over the agent's ~3k-token prompt per step, minutes on 2 cores.
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    last = model.model.layers[-1]
    captured: list[torch.Tensor] = []
    hook = last.post_attention_layernorm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    ids = torch.tensor([prompt_ids + answer_ids])
    start = len(prompt_ids)
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    feats = captured[0][0, start - 1 : -1]  # the residual stream entering the trained part
    targets = torch.tensor(answer_ids)
    head = [last.post_attention_layernorm, last.mlp, model.model.norm, model.lm_head]
    opt = torch.optim.AdamW([p for m in head for p in m.parameters()], lr=3e-3)

    def logits() -> torch.Tensor:
        h = feats + last.mlp(last.post_attention_layernorm(feats))
        return model.lm_head(model.model.norm(h))

    for _ in range(max_steps):
        out = logits()
        with torch.no_grad():
            top = torch.log_softmax(out, -1).max(-1)
            if bool((top.indices == targets).all()) and float(top.values.min()) > -0.01:
                break
        loss = torch.nn.functional.cross_entropy(out, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        raise AssertionError(f"the head did not learn the answer in {max_steps} steps")
    with torch.no_grad():  # the whole model, as the generator will run it
        full = model(input_ids=ids).logits[0, start - 1 : -1].argmax(-1)
    assert full.tolist() == answer_ids
    model.save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


async def test_scripted_model_runs_a_command_and_finishes(gateway_stack, answer_ids, tiny_model_dir, tmp_path):
    # 1. the agent's first prompt, as the generator tokenised it (the session records it)
    async with gateway_stack(env=env_section()) as st:
        await st.streams.publish(st.streams.keys.tasks, openhands_task(20, sampling=SamplingParams(max_tokens=4)))
        [probe] = await collect(st.streams, 1, timeout_s=300)
    prompt_ids = list(probe.turns[0].prompt())
    # 2. a model that answers it with a terminal command and finish (greedy: validation sampling)
    with one_torch_thread():
        model = fine_tune_head(tiny_model_dir, tmp_path / "scripted", prompt_ids, answer_ids)
    greedy = SamplingParams(temperature=0.0, max_tokens=len(answer_ids) + 8, kind="validation")
    policy = {
        "generation": {
            "backend": "transformers",
            "temperature": 1.0,
            "top_p": 1.0,
            "max_new_tokens": 128,
            "val_temperature": 0.0,
        }
    }
    async with gateway_stack(env=env_section(), model_dir=model, policy=policy) as st:
        await st.streams.publish(st.streams.keys.tasks, openhands_task(21, sampling=greedy))
        [traj] = await collect(st.streams, 1, timeout_s=300)
    assert traj.status == "ok", (traj.fallback_reason, traj.metrics)
    assert traj.metrics["agent_finished"] == 1.0 and traj.metrics["tool_calls"] == 2.0
    assert list(traj.turns[0].prompt()) == prompt_ids and list(traj.turns[0].generated()) == answer_ids
    assert traj.reward == 1.0 and traj.metrics["check_exit"] == 0.0
