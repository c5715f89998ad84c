"""The real NeMo-Gym package against streamrl, set up and started exactly as the set-up of
docs/nemo_gym.md says: its YAML blocks and its command are read from that section, only hosts and
ports are replaced. So NeMo-Gym's head server, the package's ``example_session_state_mgmt``
resources server and its ``simple_agent`` run unchanged, in the package's own virtualenv
(scripts/setup_nemo_gym.sh), started by scripts/nemo_gym_serve.py, with a real gateway (worker,
session proxy, NeMo-Gym routes) as their policy model server.

The policy is the scripted generator (a deterministic policy, so the package's verifier has a
non-trivial reward to give): ``counter`` does what the task row asks, one tool call per turn
(increment by each number, read the counter, say the count), ``idle`` answers at once without a
tool. The rows are the package's own example rows, as shipped (no ``agent_ref``: the guide's
``default_agent`` names the agent). Checked through the tasks and trajectories streams: the reward
is the verifier's (1.0 when the counter the agent's tool calls left in the resources server's
session matches the row, 0.0 otherwise), every model call of the episode is a turn, and no turn
broke the token prefix. Checked on a session the test opens itself and runs through the agent's
``/run``: the token ids and logprobs on the agent's output items are exactly the session's turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from shared.openai_api import ChatMessage, ResponseMessage
from shared.protocol import SamplingParams, Task
from tests.support.fakes.generator import call, say
from tests.support.gateway import collect, single_task
from tests.support.ports import HeldPorts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
POLICY_FILE = "streamrl_policy.yaml"  # the NeMo-Gym config the guide's first step writes
STARTUP_TIMEOUT_S = 300.0  # a slow 2-core machine importing NeMo-Gym in three processes


@dataclass(frozen=True)
class Readme:
    """What the set-up of docs/nemo_gym.md has the reader write and run."""

    policy_config: dict[str, Any]  # step 1: the NeMo-Gym config naming the gateway
    command: list[str]  # step 2: the command starting NeMo-Gym's servers
    env: dict[str, Any]  # step 3: the streamrl run config's env section

    @property
    def package_config(self) -> str:
        [path] = [a for a in self.command if a.endswith(".yaml") and a != POLICY_FILE]
        return path


@pytest.fixture(scope="module")
def readme() -> Readme:
    text = (ROOT / "docs/nemo_gym.md").read_text()
    section = text.split("\n## Set-up\n", 1)[1].split("\n## ", 1)[0]
    blocks = [textwrap.dedent(m[2]) for m in re.finditer(r"^( *)```\w*\n(.*?)^\1```", section, re.S | re.M)]
    [policy_config] = [yaml.safe_load(b) for b in blocks if "policy_model:" in b]
    [script] = [b for b in blocks if "nemo_gym_serve.py" in b]
    [run_config] = [yaml.safe_load(b) for b in blocks if "nemo_gym:" in b]
    [line] = [ln for ln in script.replace("\\\n", " ").splitlines() if "nemo_gym_serve.py" in ln]
    readme = Readme(policy_config, shlex.split(line), run_config["env"])
    assert POLICY_FILE in readme.command
    return readme


@pytest.fixture(scope="module", autouse=True)
def nemo_gym_venv(readme):
    python = ROOT / readme.command[0]
    if not python.exists():
        pytest.fail(f"{readme.command[0]} is missing: run scripts/setup_nemo_gym.sh (scripts/test.sh does)")


@pytest.fixture(scope="module")
def example_rows(readme) -> list[dict]:
    """The rows the package ships for the guide's environment, as they are."""
    venv = Path(readme.command[0]).parents[1]
    data = Path(readme.package_config).parents[1] / "data/example.jsonl"
    [path] = ROOT.glob(f"{venv}/lib/python3.*/site-packages/{data}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def _counter(messages: list[ChatMessage]) -> ResponseMessage:
    """Plays the row: ``increment_counter`` by each number the user names, then ``get_counter_value``,
    then says the count the tool returned."""
    numbers = _numbers(str(messages[0].content))
    done = sum(m.role == "assistant" for m in messages)
    if done < len(numbers):
        return call("increment_counter", {"count": numbers[done]})
    if done == len(numbers):
        return call("get_counter_value", {})
    return say(f"The count is {json.loads(messages[-1].content)['count']}.")


POLICIES = {"counter": _counter, "idle": lambda messages: say("The count is 0.")}


@contextlib.asynccontextmanager
async def nemo_gym_servers(command: list[str], workdir: Path) -> AsyncIterator[dict[str, str]]:
    """The guide's command, run in ``workdir``; yields the URLs of its ``ready`` line by name.
    Stopped with SIGTERM (it stops its servers), its process group killed if it lingers."""
    log = workdir / "nemo_gym_serve.log"
    python, script, *args = command
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(ROOT / python), str(ROOT / script), *args],
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        while not (ready := [ln for ln in log.read_text().splitlines() if ln.startswith("ready ")]):
            if proc.poll() is not None or asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"NeMo-Gym servers did not start (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
            await asyncio.sleep(0.2)
        yield dict(item.split("=", 1) for item in ready[0].split()[1:])
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.asynccontextmanager
async def deployment(scripted_gateway, readme: Readme, workdir: Path):
    """The scripted gateway configured with the guide's env section and, pointing at it, NeMo-Gym's
    servers started as the guide says; only hosts and ports differ."""
    held = HeldPorts(("head",))
    try:
        policy_config = json.loads(json.dumps(readme.policy_config))
        head = policy_config["head_server"]
        env = json.loads(json.dumps(readme.env))
        env["nemo_gym"]["head_server_url"] = f"http://{head['host']}:{held.ports['head']}"
        async with scripted_gateway(POLICIES, env=env) as gw:
            host, port = gw.url.removeprefix("http://").rsplit(":", 1)
            [gateway] = policy_config["policy_model"]["responses_api_models"].values()
            gateway.update(host=host, port=int(port))
            head["port"] = held.release("head")
            (workdir / POLICY_FILE).write_text(yaml.safe_dump(policy_config))
            async with nemo_gym_servers(readme.command, workdir) as urls:
                yield gw, urls
    finally:
        held.close()


def _task(policy: str, i: int, row: dict) -> Task:
    return single_task(f"{policy}-{i}", "nemo_gym", row, prompt_index=i, deadline_s=120.0)


async def test_the_package_s_agent_and_verifier_drive_rollouts_token_exact(
    scripted_gateway, readme, example_rows, tmp_path
):
    row, other = example_rows[:2]
    numbers = [_numbers(r["responses_create_params"]["input"][0]["content"]) for r in (row, other)]
    for r, n in zip((row, other), numbers, strict=True):  # the counter policy's increments earn the reward
        assert r["initial_count"] + sum(n) == r["expected_count"]
    async with deployment(scripted_gateway, readme, tmp_path) as (gw, urls):
        tasks = [_task("counter", 0, row), _task("idle", 1, row), _task("counter", 2, other)]
        await gw.streams.publish_many(gw.streams.keys.tasks, tasks)
        trajs = {t.prompt_index: t for t in await collect(gw.streams, len(tasks), timeout_s=180)}

        session = await gw.gateway.state.proxy.open("counter-direct.0", "train", SamplingParams(max_tokens=16))
        body = {**row, "_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_rollout_id": session.session_id}
        agent = urls[readme.env["nemo_gym"]["default_agent"]]
        async with httpx.AsyncClient(timeout=120) as http:
            verified = (await http.post(f"{agent}/run", json=body)).json()

    assert set(trajs) == {0, 1, 2}
    # counter: one turn per increment, one to read the counter, one to answer; idle: one turn
    for i, reward, turns in ((0, 1.0, len(numbers[0]) + 2), (1, 0.0, 1), (2, 1.0, len(numbers[1]) + 2)):
        t = trajs[i]
        assert t.status == "ok", t.fallback_reason
        assert t.reward == reward and len(t.turns) == turns and t.metrics["prefix_breaks"] == 0.0
    assert verified["reward"] == 1.0
    items = [o for o in verified["response"]["output"] if "generation_token_ids" in o]
    assert [o["type"] for o in items] == ["function_call"] * (len(numbers[0]) + 1) + ["message"]
    assert len(items) == len(session.turns) and session.prefix_breaks == 0
    for item, turn in zip(items, session.turns, strict=True):
        assert item["generation_token_ids"] == list(turn.generated())
        assert item["generation_log_probs"] == pytest.approx(list(turn.logprobs()))
        assert item["prompt_token_ids"][turn.context_len :] == list(turn.prompt())
