"""Scaling a live run with the local backend: ``streamrl up`` trains while ``streamrl scale`` takes
generators and gateway workers 1 -> 2 -> 1.

Asserts what a user scaling a run relies on: the command reports the counts before and after and
returns once the new workers are ready; the trainer's refits include the new generator while it
runs and only the remaining one after it left (the test scales down once rollouts ran on both new
workers); the run still trains every step on its full batch with no trajectory id twice (the
per-step ledger in metrics.jsonl); no task is lost: the removed gateway leaves nothing pending,
every task of the run's settled steps has its trajectory, and no rollout failed.
Every service is a process; the generators use the transformers engine on the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import redis

from shared import keys as K
from shared.protocol import Task, Trajectory, decode
from tests.support.redis import entries
from tests.support.runs import read_metrics
from tests.support.services import make_data, start_job, streamrl

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, GENS = 24, 2, 2


def _records(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if r.get("kind") == "train"]


def _wait_for(what: str, check, proc: subprocess.Popen, log: Path, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert proc.poll() is None, f"the run ended while waiting for {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)
    return found


def _scale(out: Path, redis_url: str, *targets: str) -> subprocess.CompletedProcess:
    args = ("scale", *targets, "--run-dir", str(out), "--timeout", "240")
    return streamrl(*args, timeout_s=300, env={**os.environ, "REDIS_URL": redis_url})


def _hold(out: Path, proc: subprocess.Popen, log: Path) -> int:
    """``streamrl pause``, then wait until the trainer holds at a step boundary; the pause's epoch."""
    paused = streamrl("pause", "--run-dir", str(out), timeout_s=60)
    assert paused.returncode == 0, paused.stdout + paused.stderr

    def held() -> bool:
        status = streamrl("status", "--json", "--run-dir", str(out), timeout_s=60)
        return status.returncode == 0 and (json.loads(status.stdout)["trainer"] or {}).get("state") == "paused"

    _wait_for("the pause to hold the run", held, proc, log, 240)
    epoch: int = json.loads(paused.stdout)["epoch"]
    return epoch


def _release(out: Path, epoch: int) -> None:
    resumed = streamrl("resume", "--epoch", str(epoch), "--run-dir", str(out), timeout_s=60)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr


def _trajectories(redis_url: str, run_id: str) -> list[Trajectory]:
    return entries(redis.Redis.from_url(redis_url), K.RunKeys(run_id).trajectories, Trajectory)


def _new_workers_used(redis_url: str, run_id: str) -> bool:
    """A rollout ran on the new gateway and a model call was served by the new generator."""
    trajs = _trajectories(redis_url, run_id)
    return any(t.gateway_id == "gateway-1" for t in trajs) and any(
        turn.generator_id == "generator-1" for t in trajs for turn in t.turns
    )


@pytest.fixture(scope="module")
def scaled_run(tmp_path_factory, tiny_model_dir, redis_url):
    out = tmp_path_factory.mktemp("scaled")
    data = out / "data"
    make_data(data / "train.jsonl", 200)
    run_id = f"scale-e2e-{os.getpid()}"
    overrides = [
        f"run.run_id={run_id}",
        f"run.output_dir={out}",
        f"data.train_path={data / 'train.jsonl'}",
        "data.val_path=null",
        f"policy.model_name={tiny_model_dir}",
        "policy.generation.backend=transformers",
        "policy.generation.max_new_tokens=8",
        f"grpo.max_num_steps={STEPS}",
        f"grpo.num_prompts_per_step={PROMPTS}",
        f"grpo.num_generations_per_prompt={GENS}",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.save_period=100",
        "generator.drain_session_idle_s=1",
        "logger.plot=false",
    ]
    log = out / "up.log"
    proc = start_job(ROOT / "deploy/configs/demo.yaml", log, *overrides, env={**os.environ, "REDIS_URL": redis_url})
    try:
        _wait_for("first step", lambda: _records(out), proc, log, 300)
        # Each scaling runs while a pause holds the run at a step boundary, so that the run cannot
        # end before the new workers serve, however long they take to start on a loaded machine.
        epoch = _hold(out, proc, log)
        up = _scale(out, redis_url, "generator=2", "gym-gateway=2")
        _release(out, epoch)
        _wait_for(
            "refit confirmed by the new generator",
            lambda: any("generator-1" in r["refit"]["generators"] for r in _records(out)),
            proc,
            log,
            120,
        )
        _wait_for("rollouts through the new workers", lambda: _new_workers_used(redis_url, run_id), proc, log, 120)
        epoch = _hold(out, proc, log)
        steps_at_down = len(_records(out))  # before the command: it returns once the workers drained
        down = _scale(out, redis_url, "generator=1", "gym-gateway=1")
        _release(out, epoch)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out, run_id, proc.returncode, log, up, down, steps_at_down


def test_scale_commands_report_counts_and_return_when_done(scaled_run):
    _, _, code, log, up, down, steps_at_down = scaled_run
    assert code == 0, log.read_text()[-4000:]
    assert up.returncode == 0, up.stdout + up.stderr
    assert "generator: 1 -> 2, gym-gateway: 1 -> 2" in up.stdout
    assert down.returncode == 0, down.stdout + down.stderr
    assert "generator: 2 -> 1, gym-gateway: 2 -> 1" in down.stdout
    assert steps_at_down < STEPS, "the run should still be training when scaled down"


def test_refits_follow_the_generators_that_serve(scaled_run):
    out, *_ = scaled_run
    records = _records(out)
    assert records[0]["refit"]["generators"] == ["generator-0"]
    assert any(r["refit"]["generators"] == ["generator-0", "generator-1"] for r in records)
    assert records[-1]["refit"]["generators"] == ["generator-0"]  # it left; the trainer no longer waits for it


def test_every_step_trains_its_full_batch_once_and_no_task_is_lost(scaled_run, redis_url):
    out, run_id, *_ = scaled_run
    records = _records(out)
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(len(r["consumed_ids"]) == PROMPTS * GENS for r in records)
    ids = [i for r in records for i in r["consumed_ids"]]
    assert len(ids) == len(set(ids))  # no trajectory trained twice

    r, keys = redis.Redis.from_url(redis_url), K.RunKeys(run_id)
    tasks = [decode(f[K.ENTRY_FIELD], Task) for _, f in r.xrange(keys.tasks)]
    trajs = _trajectories(redis_url, run_id)
    assert not [t.task_id for t in trajs if t.status == "failed"]
    # The removed gateway left nothing pending: it finished its rollouts or released them.
    pending = r.xpending_range(keys.tasks, K.GATEWAYS_GROUP, "-", "+", 1000, consumername="gateway-1")
    assert pending == []
    # Every task of the settled steps (long before the run ended) came back as a trajectory.
    done = {t.task_id for t in trajs}
    settled = {t.task_id for t in tasks if t.kind == "train" and t.target_step <= STEPS - 3}
    assert settled and settled <= done, sorted(settled - done)
