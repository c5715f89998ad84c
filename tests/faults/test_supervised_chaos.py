"""A `streamrl up` job heals itself: a generator, a gateway worker, the trainer and the embedded
Valkey are each killed (SIGKILL) once, in a seeded random order at seeded random steps of the run,
and nobody restarts anything but the supervisor. The job must end with exit code 0, and the ledger,
read from metrics.jsonl and from the streams (the Valkey's append-only file is opened again after
the job), must show what docs/fault_tolerance.md promises: every step trained once with its full
batch, no trajectory trained twice, and every published training trajectory trained, evicted by id,
or still pending (delivered and unacknowledged, or published after the trainer's last read); none
lost.

The seed is printed; set STREAMRL_CHAOS_SEED to replay one. Kill points are steps, not times, and
each kill waits until the previous victim is back, so the test does not depend on how fast the
machine is.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from shared import keys as K
from shared.protocol import Trajectory, decode
from streamrl.redis_server import RedisServer
from tests.support.pids import alive
from tests.support.redis import valkey_pid
from tests.support.runs import assert_every_step_trained_once, batch, ledger, output_dir, read_metrics, write_run_config
from tests.support.services import start_job

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

STEPS, PROMPTS, GENS = 10, 2, 2
VICTIMS = ["generator-0", "gateway-0", "trainer", "valkey"]
HEALING = {  # the job's own Valkey, durable; victims restarted soon; a killed gateway's tasks reclaimed
    "redis.embedded_appendfsync": "always",
    "checkpointing.save_period": 2,
    "gym_gateway.reclaim_idle_s": 3.0,
    "env.failure_policy": "retry",
    "supervisor.restart_backoff_s": 0.5,
}


def _steps_done(out: Path) -> int:
    return len({r["step"] for r in read_metrics(out) if r.get("kind") == "train"})


def _pid(out: Path, victim: str) -> int | None:
    run = json.loads((out / "run.json").read_text())
    if victim == "valkey":
        return valkey_pid(run["redis_url"])
    return run["children"][victim]["pid"]


@pytest.fixture(scope="module")
def healed_job(tmp_path_factory, tiny_model_dir):
    seed = int(os.environ.get("STREAMRL_CHAOS_SEED", "20261201"))
    print(f"chaos seed {seed} (STREAMRL_CHAOS_SEED replays it)")
    rng = random.Random(seed)
    order = rng.sample(VICTIMS, len(VICTIMS))
    at_steps = sorted(rng.sample(range(1, STEPS - 1), len(VICTIMS)))
    tmp = tmp_path_factory.mktemp("healed")
    overrides = {**batch(STEPS, PROMPTS, GENS), **HEALING}
    config = write_run_config(tmp, tiny_model_dir, None, f"healed-{os.getpid()}", overrides)
    out = output_dir(config)
    sup = start_job(config, tmp / "up.log")
    kills = []
    try:
        for victim, step in zip(order, at_steps, strict=True):
            deadline = time.monotonic() + 600
            while _steps_done(out) < step:
                assert sup.poll() is None, (tmp / "up.log").read_text()[-4000:]
                assert time.monotonic() < deadline, f"step {step} not reached"
                time.sleep(0.1)
            pid = _pid(out, victim)
            assert pid is not None and alive(pid), (victim, pid)
            os.kill(pid, signal.SIGKILL)
            kills.append((victim, step))
            # The next kill waits until this victim is back (a new pid that is alive).
            while time.monotonic() < deadline:
                new = _pid(out, victim)
                if new is not None and new != pid and alive(new):
                    break
                assert sup.poll() is None, (tmp / "up.log").read_text()[-4000:]
                time.sleep(0.2)
        code = sup.wait(900)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGTERM)
            sup.wait(120)
    up_log = (tmp / "up.log").read_text()
    # Open the job's Valkey again on its append-only file to read the streams it left.
    run = json.loads((out / "run.json").read_text())
    server = RedisServer(out / "redis", appendonly=True, appendfsync="always")
    server.start()
    try:
        import redis

        keys = K.RunKeys(run["run_id"])
        with redis.Redis.from_url(server.url) as r:
            published = [decode(f[K.ENTRY_FIELD], Trajectory) for _, f in r.xrange(keys.trajectories)]
            pending_entries = [
                p["message_id"] for p in r.xpending_range(keys.trajectories, K.TRAINER_GROUP, "-", "+", 10_000)
            ]
            pending = {
                decode(r.xrange(keys.trajectories, e, e)[0][1][K.ENTRY_FIELD], Trajectory).task_id
                for e in pending_entries
            }
            # Published after the trainer's last read (a rollout reclaimed late, finishing as the run
            # ends): never delivered to its group, so a resumed run reads them first.
            [group] = [g for g in r.xinfo_groups(keys.trajectories) if g["name"].decode() == K.TRAINER_GROUP]
            last = group["last-delivered-id"].decode()
            pending |= {
                decode(f[K.ENTRY_FIELD], Trajectory).task_id for _, f in r.xrange(keys.trajectories, min=f"({last}")
            }
    finally:
        server.stop()
    return {
        "seed": seed,
        "code": code,
        "kills": kills,
        "log": up_log,
        "run": run,
        "records": read_metrics(out),
        "published": [t for t in published if t.kind == "train"],
        "pending": pending,
    }


def test_the_supervisor_heals_every_kill_and_the_job_finishes(healed_job):
    j = healed_job
    assert j["code"] == 0, f"seed {j['seed']}, kills {j['kills']}:\n{j['log'][-4000:]}"
    assert [v for v, _ in j["kills"]] and len(j["kills"]) == len(VICTIMS)
    assert set(j["run"]["restarts"]) == {"generator", "gym-gateway", "trainer", "redis"}, j["run"]["restarts"]


def test_every_step_trained_once_and_nothing_lost(healed_job):
    j = healed_job
    assert_every_step_trained_once(j["records"], STEPS, PROMPTS * GENS)
    trained = {i for ids in ledger(j["records"]).values() for i in ids}
    evicted = {i for r in j["records"] if r.get("kind") == "train" for i in r.get("evicted_ids", [])}
    lost = {t.task_id for t in j["published"]} - trained - evicted - j["pending"]
    assert not lost, f"seed {j['seed']}: {sorted(lost)}"
