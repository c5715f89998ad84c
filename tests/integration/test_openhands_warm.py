"""The OpenHands driver's warm runners (``env.openhands.warm_runners``) with the real SDK in its
own virtualenv.

Covers: an episode from the tasks stream to a trajectory through a warm runner (the real gateway
and generator, as in test_openhands_agent.py), the runners stopped with the gateway; episodes
forked by one runner each in their own workspace, HOME and tmux socket folder, the SDK imported
once; a runner killed while it runs an episode failing that episode as a sandbox error, its
episode's processes killed, and the next episode running in a replacement; and the rollout's
deadline (cancellation) and the agent time limit killing the episode's processes. The direct
tests play the model with the bench's scripted endpoint (a terminal command and ``finish``).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from services.gym_gateway.envs.base import SandboxError
from services.gym_gateway.envs.openhands import OpenHandsEnv
from shared.protocol import SamplingParams
from shared.sections.env_openhands import OpenHandsSection
from streamrl.bench.openhands import ScriptedModel, scripted_client
from tests.support.gateway import collect
from tests.support.openhands import OPENHANDS, env_section, openhands_task
from tests.support.pids import gone, text_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("openhands_venv")]


@pytest.fixture
async def model():
    scripted = ScriptedModel()
    await scripted.start()
    yield scripted
    await scripted.aclose()


def _env(**overrides) -> OpenHandsEnv:
    return OpenHandsEnv(OpenHandsSection(**{**OPENHANDS, "warm_runners": 1, **overrides}))


async def _episode(env: OpenHandsEnv, model: ScriptedModel, command: str, job_dir: Path, max_turns: int = 2):
    """``command`` run by the agent in ``job_dir/ws``; the job's files stay in ``job_dir``."""
    ws = job_dir / "ws"
    ws.mkdir(parents=True)
    return await env.run_agent(f"RUN: {command}", ws, scripted_client(model.url), max_turns=max_turns, job_dir=job_dir)


async def test_warm_runner_runs_an_episode_from_task_to_trajectory(gateway_stack, tmp_path):
    scratch = tmp_path / "scratch"  # workspaces and the runners' folder; the system one is shared
    async with gateway_stack(env=env_section(warm_runners=1, workspace_root=str(scratch))) as st:
        await st.streams.publish(st.streams.keys.tasks, openhands_task(30, sampling=SamplingParams(max_tokens=8)))
        [traj] = await collect(st.streams, 1, timeout_s=300)
        env = st.gateway.state.worker._envs["openhands"]
        assert isinstance(env, OpenHandsEnv) and env.pool is not None
        runners = env.pool.pids
    assert traj.status in ("ok", "truncated"), traj.fallback_reason
    assert traj.turns and traj.metrics["model_calls"] == len(traj.turns) >= traj.metrics["iterations"] >= 1
    assert traj.reward == 0.0 and traj.metrics["check_exit"] == 1.0  # the untrained model writes no answer
    assert scratch.is_dir() and not any(scratch.iterdir())  # workspace, job and runners' folders removed
    assert len(runners) == 1 and await gone(runners[0])  # stopped with the gateway


async def test_episodes_are_isolated_and_a_killed_runner_is_replaced(tmp_path, model):
    env = _env()
    probe = 'echo "$HOME" > home.txt; pwd > pwd.txt; echo "$TMUX_TMPDIR" > tmux.txt; ls -a "$HOME" > seen.txt'
    probe += '; touch "$HOME/mark"'
    try:
        for name in ("a", "b"):
            run = await _episode(env, model, probe, tmp_path / name)
            assert run.status == "finished" and run.actions == {"terminal": 1, "finish": 1}
        assert env.pool is not None and env.pool.started == 1  # one runner, the SDK imported once
        tmux_dirs: set[str] = set()
        for name in ("a", "b"):
            ws = tmp_path / name / "ws"
            assert (ws / "home.txt").read_text().strip() == str(tmp_path / name / "home")
            assert (ws / "pwd.txt").read_text().strip() == str(ws)
            tmux_dirs.add((ws / "tmux.txt").read_text().strip())
            assert "mark" not in (ws / "seen.txt").read_text()  # b's HOME is not a's
            assert (tmp_path / name / "home" / "mark").exists()
        assert len(tmux_dirs) == 2 and not any(Path(d).exists() for d in tmux_dirs)  # each its own, removed

        # killed while it runs an episode: that episode fails, its processes die with it
        [runner] = env.pool.pids
        pidfile = tmp_path / "sleeper.pid"
        busy = asyncio.create_task(_episode(env, model, f"sleep 300 & echo $! > {pidfile}; wait", tmp_path / "c"))
        sleeper = int(await text_of(pidfile))
        [episode] = [ep.pid for r in env.pool.runners for ep in r.episodes.values()]
        os.kill(runner, signal.SIGKILL)
        with pytest.raises(SandboxError, match="warm OpenHands runner exited"):
            await asyncio.wait_for(busy, 60)
        assert await gone(episode) and await gone(sleeper)

        # the next episode gets a new runner
        run = await _episode(env, model, "echo ok > ok.txt", tmp_path / "d")
        assert run.status == "finished" and (tmp_path / "d" / "ws" / "ok.txt").read_text().strip() == "ok"
        assert env.pool.started == 2 and env.pool.pids != [runner]
    finally:
        await env.aclose()


async def test_deadline_and_time_limit_kill_the_episodes_processes(tmp_path, model):
    # The time limit leaves a loaded machine time to fork the episode and run its first command
    # (5 s did not, on 2 cores beside the multi-host runs); the cancelled episode does not wait for it.
    env = _env(timeout_s=20.0)
    try:
        await _episode(env, model, "true", tmp_path / "warmup")  # the runner's start is not the episode's
        assert env.pool is not None

        # the rollout's deadline: the rollout is cancelled
        pidfile = tmp_path / "cancelled.pid"
        task = asyncio.create_task(_episode(env, model, f"sleep 300 & echo $! > {pidfile}; wait", tmp_path / "c"))
        sleeper = int(await text_of(pidfile))
        [episode] = [ep.pid for r in env.pool.runners for ep in r.episodes.values()]
        assert os.getpgid(episode) == episode  # the episode leads its own group
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await gone(episode) and await gone(sleeper)

        # env.openhands.timeout_s: stopped, reported as timed out. The model never finishes and the
        # turns outlast the limit, so that a terminal call that returns early (its own timeout, a
        # slow tmux on a loaded machine) cannot end the episode first.
        pidfile = tmp_path / "late.pid"
        model.finish = False
        try:
            command = f"sleep 300 & echo $! > {pidfile}; wait"
            run = await _episode(env, model, command, tmp_path / "t", max_turns=50)
        finally:
            model.finish = True
        assert run.timed_out and run.status == "timeout"
        assert await gone(int(await text_of(pidfile)))
        assert env.pool.started == 1  # episodes ended, the runner stays
    finally:
        await env.aclose()
