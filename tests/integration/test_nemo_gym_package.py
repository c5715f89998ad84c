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
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from shared.openai_api import ChatMessage, ResponseMessage
from shared.protocol import SamplingParams, Task
from shared.records import read_records, step_records
from tests.support.fakes.generator import call, say
from tests.support.gateway import Stack, collect, single_task
from tests.support.nemo_gym_policy import counter_policy
from tests.support.ports import HeldPorts
from tests.support.services import start_job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
POLICY_FILE = "streamrl_policy.yaml"  # the NeMo-Gym config the guide's first step writes
STARTUP_TIMEOUT_S = 300.0  # a slow 2-core machine importing NeMo-Gym in three processes
MAX_TOKENS = 48  # a tool call of the counter rows is about 30 tokens


@dataclass(frozen=True)
class Readme:
    """What the set-up of docs/nemo_gym.md has the reader write and run."""

    policy_config: dict[str, Any]  # step 1: the NeMo-Gym config naming the gateway
    command: list[str]  # step 2: the command starting NeMo-Gym's servers
    env: dict[str, Any]  # step 3: the streamrl run config's env section

    def run_env(self, head_port: int) -> dict[str, Any]:
        """Step 3's env section with the head server on ``head_port``."""
        env = json.loads(json.dumps(self.env))
        env["nemo_gym"]["head_server_url"] = f"http://{self.policy_config['head_server']['host']}:{head_port}"
        return env

    def write_policy_config(self, workdir: Path, head_port: int, gateway_host: str, gateway_port: int) -> None:
        """Step 1's config, written to ``workdir``: the head server on ``head_port``, the gateway at
        ``gateway_host:gateway_port``."""
        config = json.loads(json.dumps(self.policy_config))
        config["head_server"]["port"] = head_port
        [gateway] = config["policy_model"]["responses_api_models"].values()
        gateway.update(host=gateway_host, port=gateway_port)
        (workdir / POLICY_FILE).write_text(yaml.safe_dump(config))

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
async def deployment(open_gateway: Callable[[dict], AbstractAsyncContextManager[Stack]], readme: Readme, workdir: Path):
    """A gateway configured with the guide's env section (``open_gateway(env)``: scripted or on a
    real model) and, pointing at it, NeMo-Gym's servers started as the guide says; only hosts and
    ports differ."""
    held = HeldPorts(("head",))
    try:
        async with open_gateway(readme.run_env(held.ports["head"])) as gw:
            host, port = gw.url.removeprefix("http://").rsplit(":", 1)
            readme.write_policy_config(workdir, held.release("head"), host, int(port))
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
    async with deployment(lambda env: scripted_gateway(POLICIES, env=env), readme, tmp_path) as (gw, urls):
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


@pytest.fixture(scope="module")
def counter_model(tiny_model_dir, example_rows, tmp_path_factory) -> Path:
    """The tiny model fine-tuned to play the package's counter rows (`tests.support.nemo_gym_policy`)."""
    return counter_policy(tiny_model_dir, tmp_path_factory.mktemp("counter-policy"), example_rows)


TEMPERATURE = 0.8
GENERATION = {"backend": "transformers", "temperature": TEMPERATURE, "top_p": 1.0, "max_new_tokens": MAX_TOKENS}


async def test_the_package_s_agent_drives_a_real_model_token_exact_and_a_broken_prefix_is_counted(
    gateway_stack, readme, example_rows, counter_model, tmp_path
):
    """The same deployment with a real generator (transformers engine, the fine-tuned tiny model,
    its tokenizer and chat template): the agent's tool calls are the model's parsed output, its
    replayed turns are spliced back into the model's own tokens (no break over multi-turn
    episodes), and the output items carry exactly the tokens the session recorded. A call that does
    not continue the session's context is counted as a break."""

    def real_model(env: dict) -> AbstractAsyncContextManager[Stack]:
        return gateway_stack(model_dir=counter_model, env=env, policy={"generation": GENERATION})

    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
    async with deployment(real_model, readme, tmp_path) as (gw, urls):
        tasks = [
            single_task(f"row{i}-{k}", "nemo_gym", row, sampling=sampling, prompt_index=i, deadline_s=240.0)
            for i, row in enumerate(example_rows)
            for k in range(2)
        ]
        await gw.streams.publish_many(gw.streams.keys.tasks, tasks)
        trajs = await collect(gw.streams, len(tasks), timeout_s=300)

        session = await gw.gateway.state.proxy.open("direct.0", "train", sampling)
        row = example_rows[0]
        body = {**row, "_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_rollout_id": session.session_id}
        agent = urls[readme.env["nemo_gym"]["default_agent"]]
        async with httpx.AsyncClient(timeout=240) as http:
            verified = (await http.post(f"{agent}/run", json=body)).json()
            turns_of_the_run, breaks_of_the_run = list(session.turns), session.prefix_breaks
            restart = {**row["responses_create_params"], "input": [{"role": "user", "content": "get the count"}]}
            broken = await http.post(f"{gw.url}/ng-rollout/{session.session_id}/v1/responses", json=restart)

    assert len(trajs) == len(tasks)
    assert all(t.status == "ok" for t in trajs), [(t.task_id, t.fallback_reason) for t in trajs]
    assert all(t.metrics["prefix_breaks"] == 0.0 for t in trajs)
    assert {t.reward for t in trajs} <= {0.0, 1.0}  # the package's verifier
    assert max(len(t.turns) for t in trajs) >= 3  # tool calls answered and replayed: multi-turn splices

    items = [o for o in verified["response"]["output"] if "generation_token_ids" in o]
    assert len(items) == len(turns_of_the_run) >= 2 and breaks_of_the_run == 0
    assert any(o["type"] == "function_call" for o in items)  # the model's own output, parsed as a call
    for item, turn in zip(items, turns_of_the_run, strict=True):
        assert item["generation_token_ids"] == list(turn.generated())
        assert item["generation_log_probs"] == pytest.approx(list(turn.logprobs()))
        assert item["prompt_token_ids"][turn.context_len :] == list(turn.prompt())
    assert broken.status_code == 200, broken.text
    last = turns_of_the_run[-1]
    context = last.context_len + len(last.prompt()) + len(last.generated())  # the session's tokens so far
    assert session.prefix_breaks == 1 and session.turns[-1].context_len < context


STEPS, PROMPTS, GENS = 3, 2, 4


async def test_a_short_run_trains_on_the_package_s_rollouts(readme, example_rows, counter_model, tmp_path, redis_url):
    """``streamrl up`` with the guide's env section, the package's rows as training data, and
    NeMo-Gym's servers started by the guide's command pointing at the run's gateway: every step
    trains PROMPTS x GENS rollouts that the package's agent played and its verifier scored, none
    failed or broke its prefix, and groups whose rewards differ give the loss a signal."""
    held = HeldPorts(("head", "gateway"))
    readme.write_policy_config(tmp_path, held.ports["head"], "127.0.0.1", held.ports["gateway"])
    env = readme.run_env(held.ports["head"])
    out = tmp_path / "run"
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in example_rows))
    tree = {
        "run": {"run_id": f"nemo-gym-{os.getpid()}", "output_dir": str(out), "seed": 3},
        "data": {"train_path": str(train)},
        "policy": {
            "model_name": str(counter_model),
            "max_total_sequence_length": 1024,
            "optimizer": {"lr": 1e-4},
            "generation": GENERATION,
        },
        "grpo": {"num_prompts_per_step": PROMPTS, "num_generations_per_prompt": GENS, "max_num_steps": STEPS},
        "env": env,
        "generator": {"port": 0},
        "gym_gateway": {"port": held.ports["gateway"], "max_concurrent_rollouts": PROMPTS * GENS},
    }
    config = tmp_path / "nemo_gym_run.yaml"
    config.write_text(yaml.safe_dump(tree))

    try:
        held.release("head")
        async with nemo_gym_servers(readme.command, tmp_path):
            held.release("gateway")
            job = start_job(config, tmp_path / "up.log", env={**os.environ, "REDIS_URL": redis_url})
            try:
                await asyncio.to_thread(job.wait, 900)
            finally:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()
    finally:
        held.close()
    assert job.returncode == 0, (tmp_path / "up.log").read_text()[-4000:]
    steps = step_records(read_records(out / "metrics.jsonl"))
    assert [s.step for s in steps] == list(range(STEPS))
    for s in steps:
        assert len(s.consumed_ids) == PROMPTS * GENS and s.batch.num_placeholders == 0
        assert s.batch.rollout_failures == {} and s.batch.num_prefix_breaks == 0 and s.batch.num_masked_samples == 0
        assert 0.0 <= s.batch.reward_mean <= 1.0 and s.learner.train_tokens > 0
    assert any(s.batch.advantages_abs_mean > 0 and s.learner.grad_norm > 0 for s in steps)
