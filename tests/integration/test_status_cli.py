"""``streamrl status`` against a live Valkey holding a run: registered heartbeats, a task stream
with entries pending on a gateway consumer, the trainer's step and a pause. The command runs as
a process, finding Redis through --redis-url, REDIS_URL or the run file, and the run by id or as
the only one there."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import keys as K
from shared.protocol import RunChild, RunFile, SamplingParams, Task, write_run_file
from shared.records import encode_record
from shared.registry import publish_heartbeat
from shared.streams import StreamClient, connect
from tests.support.messages import make_heartbeat, make_task
from tests.support.records import step_record
from tests.support.redis import start_valkey

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "status-run"


@pytest.fixture(scope="module")
def run_in_redis(tmp_path_factory):
    """A Valkey of its own (so the run is the only one) with a run's workers, queues and step."""
    server = start_valkey(tmp_path_factory.mktemp("valkey-status"))
    asyncio.run(_populate(server.url))
    yield server
    server.stop()


async def _populate(url: str) -> None:
    redis = connect(url)
    keys = K.RunKeys(RUN_ID)
    workers = [
        make_heartbeat("generator-0", url="http://127.0.0.1:1", pid=11, weight_version=6, in_flight=3),
        make_heartbeat(
            "generator-1", url="http://127.0.0.1:2", pid=12, state="failed", weight_version=5, error="engine died"
        ),
        make_heartbeat("gateway-0", kind="gym_gateway", url="http://127.0.0.1:3", pid=13, in_flight=2),
        # A trainer URL nobody listens on: status must still print Redis' view.
        make_heartbeat("trainer-0", kind="trainer", url="http://127.0.0.1:9", pid=14, weight_version=6),
    ]
    for hb in workers:
        await publish_heartbeat(redis, keys, hb)
    gateway = StreamClient(redis, keys, "gateway-0")
    await gateway.ensure_group(keys.tasks, K.GATEWAYS_GROUP)
    await gateway.ensure_group(keys.trajectories, K.TRAINER_GROUP)
    tasks = [make_task(f"g{i}", prompt_index=i, target_step=7, sampling=SamplingParams(max_tokens=4)) for i in range(5)]
    await gateway.publish_many(keys.tasks, tasks)
    await gateway.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=2, block_ms=100)  # 2 pending, 3 undelivered
    await redis.set(keys.trainer_step, "7")
    await redis.hset(keys.pause, "user", "4")
    await redis.aclose()


def _status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {
        k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "STREAMRL_API_TOKEN", "STREAMRL_API_TOKEN_FILE")
    }
    return subprocess.run(
        [sys.executable, "-m", "streamrl.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**base, "COLUMNS": "200", **(env or {})},
    )


def test_json_snapshot_has_services_queues_and_step(run_in_redis):
    t0 = time.time()
    out = _status("--redis-url", run_in_redis.url, "--run-id", RUN_ID, "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["run_id"] == RUN_ID and s["step"] == 7 and s["pause"] == {"user": 4}
    workers = {w["worker_id"]: w for w in s["workers"]}
    assert sorted(workers) == ["gateway-0", "generator-0", "generator-1", "trainer-0"]
    assert workers["generator-0"]["weight_version"] == 6 and workers["generator-0"]["in_flight"] == 3
    assert workers["generator-1"]["state"] == "failed" and workers["generator-1"]["error"] == "engine died"
    health = s["health"]  # each generator's (shared.fleet_health): no calls seen, so judged on heartbeats
    assert health["generator-0"]["state"] == "serving"
    assert health["generator-1"]["state"] == "lost" and "engine died" in health["generator-1"]["reason"]
    for w in workers.values():  # published when the module started, well within the heartbeat TTL
        assert 0.0 <= w["heartbeat_age_s"] <= time.time() - t0 + K.HEARTBEAT_TTL_S
    assert s["streams"]["tasks"] == 5 and s["streams"]["trajectories"] == 0
    tasks = next(g for g in s["groups"] if g["stream"] == "tasks")
    assert tasks["group"] == K.GATEWAYS_GROUP and tasks["pending"] == 2 and tasks["lag"] == 3
    assert [(c["name"], c["pending"]) for c in tasks["consumers"]] == [("gateway-0", 2)]
    assert s["trainer"] is None  # its URL does not answer


def test_table_from_redis_url_in_the_environment_finds_the_only_run(run_in_redis):
    out = _status(env={"REDIS_URL": run_in_redis.url})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"run {RUN_ID}: step 7" in text and "pause user" in text
    for cell in ("generator-0", "http://127.0.0.1:1", "failed (engine died)", "gym_gateway", "trainer-0"):
        assert cell in text
    tasks_row = next(line for line in text.splitlines() if line.strip("│ ").startswith("tasks"))
    assert "5" in tasks_row and "gateway-0=2" in tasks_row


def test_run_file_supplies_redis_and_run_id(run_in_redis, tmp_path):
    # the trainer's URL as it registered it (nobody listens there)
    write_run_file(tmp_path, RunFile(run_id=RUN_ID, redis_url=run_in_redis.url, trainer_url="http://127.0.0.1:9"))
    out = _status("--run-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["step"] == 7


def test_a_run_file_without_the_password_asks_for_redis_url(tmp_path):
    redacted = "redis://app:***@h:6379/0"
    write_run_file(tmp_path, RunFile(run_id=RUN_ID, redis_url=redacted, trainer_url="http://127.0.0.1:9"))
    out = _status("--run-dir", str(tmp_path))
    assert out.returncode == 1 and "set REDIS_URL" in out.stderr and "***" in out.stderr


def test_a_file_that_is_no_run_file_is_refused_naming_it(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": RUN_ID}))  # neither trainer nor Redis
    out = _status("--run-dir", str(tmp_path))
    assert out.returncode == 1 and "run.json is not the run file of a `streamrl up` job" in out.stderr
    assert "trainer_url" in out.stderr


def test_unknown_redis_is_a_clear_error():
    out = _status("--redis-url", "redis://127.0.0.1:1/0", "--run-id", RUN_ID)
    assert out.returncode == 1 and "cannot read Redis at redis://127.0.0.1:1/0" in out.stderr


def _ended_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_run_that_has_ended_is_said_plainly_with_where_its_records_are(tmp_path):
    """The run file of a finished `streamrl up` job: its embedded Redis and every process it
    records are gone. Not a connection error to a stale port: no run is live, and where the last
    one wrote its records, with its last step."""
    children = {"trainer": RunChild(pid=_ended_pid(), url="http://127.0.0.1:9", log="logs/trainer.log")}
    write_run_file(
        tmp_path, RunFile(run_id=RUN_ID, redis_url="redis://127.0.0.1:1/0", trainer_url="", children=children)
    )
    (tmp_path / "metrics.jsonl").write_bytes(
        b"".join(encode_record(r) + b"\n" for r in (step_record(0), step_record(1)))
    )
    out = _status("--run-dir", str(tmp_path))
    assert out.returncode == 1, out.stdout
    assert "no run is live" in out.stderr and "cannot read Redis" not in out.stderr
    assert f"its last step record is step 1. Records: {tmp_path / 'metrics.jsonl'}" in " ".join(out.stderr.split())


def test_a_run_whose_processes_live_but_whose_redis_does_not_answer_is_a_connection_error(tmp_path):
    children = {"trainer": RunChild(pid=os.getpid(), url="http://127.0.0.1:9", log="logs/trainer.log")}
    write_run_file(
        tmp_path, RunFile(run_id=RUN_ID, redis_url="redis://127.0.0.1:1/0", trainer_url="", children=children)
    )
    out = _status("--run-dir", str(tmp_path))
    assert out.returncode == 1 and "cannot read Redis at redis://127.0.0.1:1/0" in out.stderr
