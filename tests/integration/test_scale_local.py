"""The local scale backend end to end except for the services themselves: `streamrl scale`'s end
(`LocalBackend`) and the supervisor's end (`ScaleChannel` over `WorkerPool`s) talk through a real
Valkey, and the pool members are real child processes (a small HTTP worker that answers /ready and
drains half a second on SIGTERM). The real services are scaled in tests/e2e/test_scale_e2e.py.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import redis

from shared import keys as K
from shared.protocol import RunFile, write_run_file
from streamrl.scale import ScaleError
from streamrl.scale_local import LocalBackend
from tests.support.scale import Rig

pytestmark = pytest.mark.integration


@pytest.fixture
def rig_factory(tmp_path, redis_url):
    rigs = []

    def make(**kw) -> Rig:
        rigs.append(Rig(tmp_path, redis_url, **kw))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def test_scale_up_starts_ready_workers_on_new_ports_then_down_drains_the_newest(rig_factory, tmp_path):
    rig = rig_factory()
    cli = LocalBackend(tmp_path)
    up = cli.scale({"generator": 3}, timeout_s=30)
    assert up.before == {"generator": 1, "gym-gateway": 1} and up.after == {"generator": 3, "gym-gateway": 1}
    members = rig.pool.children()
    assert [c.name for c in members] == ["w0", "w1", "w2"] and len({c.port for c in members}) == 3
    assert all(httpx.get(f"{c.url}/ready").status_code == 200 for c in members)

    t0 = time.monotonic()
    down = cli.scale({"generator": 1}, timeout_s=30)
    assert down.after == {"generator": 1, "gym-gateway": 1}
    # "done" only once the removed workers finished draining (half a second each): a lower bound,
    # which a slow machine only makes easier to meet.
    assert time.monotonic() - t0 >= 0.5
    assert rig.marked() == {"w1", "w2"}  # the newest got SIGTERM; the first one keeps serving
    assert not members[1].alive() and not members[2].alive() and members[0].alive()
    assert cli.counts() == {"generator": 1, "gym-gateway": 1}


def test_a_worker_that_does_not_drain_in_time_is_killed(rig_factory, tmp_path):
    rig = rig_factory(modes={1: "stubborn"}, stop_timeout_s=1.5)
    cli = LocalBackend(tmp_path)
    cli.scale({"generator": 2}, timeout_s=30)
    stubborn = rig.pool.children()[1]
    t0 = time.monotonic()
    cli.scale({"generator": 1}, timeout_s=30)
    assert "w1" in rig.marked() and not stubborn.alive()
    # Killed, and only once its stop_timeout_s (1.5 s) to drain had passed.
    assert stubborn.proc.returncode == -9 and time.monotonic() - t0 >= 1.5


def test_a_new_worker_that_dies_at_start_fails_the_request_with_its_log(rig_factory, tmp_path):
    rig_factory(modes={1: "crash"})
    cli = LocalBackend(tmp_path)
    with pytest.raises(ScaleError, match="(?s)w1 exited while starting.*cannot load the model"):
        cli.scale({"generator": 2}, timeout_s=30)
    assert cli.counts() == {"generator": 1, "gym-gateway": 1}  # the run keeps its workers


def test_an_unknown_service_is_refused_by_name(rig_factory, tmp_path):
    rig_factory()
    cli = LocalBackend(tmp_path)
    cli.request({"trainer": 2})
    deadline = time.monotonic() + 60
    while (st := cli.status()).phase != "failed":
        assert time.monotonic() < deadline, "the request was not refused"
        time.sleep(0.1)
    assert "trainer=2" in st.error


def test_no_supervisor_is_a_clear_error(tmp_path, redis_url):
    write_run_file(tmp_path, RunFile(run_id="nobody-here", redis_url=redis_url, trainer_url="http://127.0.0.1:1"))
    with pytest.raises(ScaleError, match="no supervisor"):
        LocalBackend(tmp_path).counts()
    with pytest.raises(ScaleError, match="no .*run.json"):
        LocalBackend(tmp_path / "elsewhere")


def test_a_run_that_ends_while_scaling_is_reported(tmp_path, redis_url):
    from shared.protocol import ScaleStatus, encode

    run_id = f"ended-{uuid.uuid4().hex[:6]}"
    keys, r = K.RunKeys(run_id), redis.Redis.from_url(redis_url)
    r.set(keys.scale_status, encode(ScaleStatus(request_id="up", phase="done", ready={"generator": 1})))
    r.set(keys.stop, b"finished")  # the supervisor is gone and will never answer
    write_run_file(tmp_path, RunFile(run_id=run_id, redis_url=redis_url, trainer_url="http://127.0.0.1:1"))
    # Its own error, not the timeout's ("not done within 60s"): the stop key ended the wait.
    with pytest.raises(ScaleError, match="ended before scaling finished"):
        LocalBackend(tmp_path).scale({"generator": 2}, timeout_s=60)


def test_a_request_left_by_an_earlier_job_of_the_run_is_not_applied(rig_factory, tmp_path, redis_url):
    from shared.protocol import ScaleRequest, encode

    run_id = f"resumed-{uuid.uuid4().hex[:6]}"
    stale = ScaleRequest(request_id="from-the-last-job", targets={"generator": 3})
    redis.Redis.from_url(redis_url).set(K.RunKeys(run_id).scale_request, encode(stale))
    rig = rig_factory(run_id=run_id)
    rig.wait_turns(10)  # had the supervisor taken the request, it would have acted on it by now
    assert rig.pool.target == 1 and len(rig.pool.children()) == 1
    assert LocalBackend(tmp_path).counts() == {"generator": 1, "gym-gateway": 1}
