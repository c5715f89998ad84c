"""The SWE agent loop end to end through real parts: a task on the stream, a gateway worker, the
per-rollout session proxy, a generator (transformers engine) serving a tiny model fine-tuned to
answer the instance's first prompt with a ``str_replace_editor`` call that fixes the bug, the
local runtime and the hidden tests. Proves the plumbing: the generator parses the model's
``<tool_call>`` into ``tool_calls``, the tool edits the workspace, its output is fed back as the
next turn's prompt, every model call is recorded, and the reward comes from the hidden tests."""

import asyncio
import json
import uuid

import pytest

from services.gym_gateway.envs.swe import load_instances
from services.gym_gateway.envs.swe.agent import SHIPPED_INSTANCES, SYSTEM_PROMPT
from services.gym_gateway.envs.swe.tools import TOOLS
from shared import keys as K
from shared.protocol import Trajectory
from shared.streams import StreamClient
from streamrl.redis_server import free_port
from tests.support.gateway import load_tree, publish_v0, serve, trainer_side
from tests.support.generator import one_torch_thread
from tests.support.messages import make_task

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CALC = {i.instance_id: i for i in load_instances(SHIPPED_INSTANCES)}["calc-divide-by-zero"]
FIX = {
    "command": "str_replace",
    "path": "calc/ops.py",
    "old_str": "    return a / b",
    "new_str": '    if b == 0:\n        raise ValueError("cannot divide by zero")\n    return a / b',
}
ANSWER = "<tool_call>\n" + json.dumps({"name": "str_replace_editor", "arguments": FIX}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def fixing_model(tiny_model_dir, tiny_tokenizer, scripted_model, tmp_path_factory):
    """The tiny model fine-tuned to answer the calc instance's first prompt with ANSWER."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": CALC.problem_statement}]
    prompt = tiny_tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    prompt_ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tiny_tokenizer.encode(ANSWER + "<|im_end|>", add_special_tokens=False)
    with one_torch_thread():
        return scripted_model(tiny_model_dir, tmp_path_factory.mktemp("swe-model"), prompt_ids, answer_ids)


@pytest.fixture
async def swe_stack(fixing_model, redis_url, tmp_path):
    """Valkey + generator (the fixing model, weights v0 confirmed) + gateway running ``swe``."""
    from services.generator.app import build_app as build_generator
    from services.gym_gateway.app import build_app as build_gateway

    run_id = f"swe-{uuid.uuid4().hex[:8]}"
    tree = {
        "run": {"run_id": run_id, "output_dir": str(tmp_path)},
        "redis": {"url": redis_url},
        "data": {"train_path": "unused.jsonl"},
        "policy": {
            "model_name": str(fixing_model),
            "generation": {
                "backend": "transformers",
                "temperature": 1.0,
                "val_temperature": 0.0,
                "max_new_tokens": 160,
                "vllm_cfg": {"max_model_len": 4096},
            },
        },
        "env": {"name": "swe", "max_turns": 2, "swe": {"workspace_root": str(tmp_path / "ws"), "eval_timeout_s": 120}},
        "gym_gateway": {
            "max_concurrent_rollouts": 2,
            "rollout_timeout_s": 300,
            "reclaim_idle_s": 600,
            "drain_timeout_s": 5,
        },
    }
    cfg = load_tree(tree, tmp_path / "run.yaml")
    gen_port, gw_port = free_port(), free_port()
    async with trainer_side(cfg, redis_url) as (_, streams):
        with one_torch_thread():  # the generator's engine runs in this process
            async with serve(build_generator(cfg, worker_id="gen-0", port=gen_port), gen_port):
                await publish_v0(streams, fixing_model, "gen-0")
                async with serve(build_gateway(cfg, worker_id="gw-0", port=gw_port), gw_port):
                    yield cfg, streams


async def _one_trajectory(streams: StreamClient, timeout_s: float = 240) -> Trajectory:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        got = await streams.read_group(streams.keys.trajectories, K.TRAINER_GROUP, Trajectory, count=1, block_ms=500)
        if got:
            return got[0].msg
    raise TimeoutError("no trajectory")


async def test_agent_fixes_the_bug_through_the_session_proxy(swe_stack, tiny_tokenizer, tmp_path):
    cfg, streams = swe_stack
    task = make_task(
        "swe0",
        env="swe",
        instance={"instance_id": CALC.instance_id},
        kind="validation",
        sampling=cfg.policy.generation.sampling("validation"),
        deadline_s=300.0,
    )
    await streams.publish(streams.keys.tasks, task)
    traj = await _one_trajectory(streams)

    assert traj.status in ("ok", "truncated"), traj.fallback_reason
    assert traj.reward == 1.0  # the model's edit made the hidden tests pass
    assert len(traj.turns) == 2 and traj.metrics["model_calls"] == 2.0
    assert traj.metrics["tool_calls"] >= 1 and traj.metrics["tool_errors"] == 0
    assert traj.metrics["tests_matched"] == traj.metrics["tests_expected"] == 3.0
    first, second = traj.turns
    assert tiny_tokenizer.decode(first.generated()).startswith("<tool_call>")
    # the tool's output came back to the model as the second turn's new prompt tokens
    fed_back = tiny_tokenizer.decode(second.prompt())
    assert "<tool_response>" in fed_back and "Edited ops.py" in fed_back and "cannot divide by zero" in fed_back
    assert second.context_len == len(first.prompt()) + len(first.generated())
    assert list((tmp_path / "ws").iterdir()) == []  # workspaces are removed after the rollout
