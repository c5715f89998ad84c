"""Fault injectors for the tests in tests/faults: each waits for the moment its fault means
something (a gateway with rollouts running, a generator with requests in flight, a refit under
way), injects it by pid, and returns what happened for the test to assert on.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

from streamrl.redis_server import RedisServer
from tests.support.runs import FaultRun


@dataclass
class Injected:
    """One injected fault: when it began and ended (wall clock) and what the test saw."""

    name: str
    began_at: float
    ended_at: float = 0.0
    details: dict = field(default_factory=dict)


def kill_gateway_mid_rollout(run: FaultRun, worker_id: str, timeout_s: float = 120.0) -> Injected:
    """SIGKILL a gateway worker while it has rollouts running; record the tasks it held."""
    gw = run.services[worker_id]
    run.wait_for(
        f"{worker_id} running a rollout",
        lambda: gw.metric("streamrl_gateway_active_rollouts") > 0,
        timeout_s,
        poll_s=0.02,
    )
    began = time.time()
    gw.kill9()
    held = run.pending_tasks(worker_id)  # read, not acked: nothing was published for them
    return Injected("gateway_kill", began, time.time(), {"held_entries": held, "held_task_ids": run.task_ids(held)})


def kill_generator_mid_request(run: FaultRun, worker_id: str, timeout_s: float = 120.0) -> Injected:
    """SIGKILL a generator while it has requests in flight."""
    gen = run.services[worker_id]
    run.wait_for(
        f"{worker_id} serving a request", lambda: gen.get_json("/admin/state")["in_flight"] > 0, timeout_s, poll_s=0.02
    )
    began = time.time()
    gen.kill9()
    return Injected("generator_kill", began, time.time())


def _all_heartbeat_after(run: FaultRun, worker_ids: list[str], t: float) -> bool:
    live = run.live_workers()
    return all(wid in live and live[wid].at > t for wid in worker_ids)


def restart_redis(
    run: FaultRun, server: RedisServer, *, down_s: float, survivors: list[str], reconnect_timeout_s: float = 60.0
) -> Injected:
    """SIGKILL the Redis server (AOF on), keep it down ``down_s``, start it again on the same port
    and data folder; then wait until every surviving service has sent a heartbeat again."""
    with run.client() as r:
        before = {
            "tasks": [e for e, _ in r.xrange(run.keys.tasks)],
            "trajectories": [e for e, _ in r.xrange(run.keys.trajectories)],
        }
    began = time.time()
    server.proc.kill()
    server.proc.wait(10)
    time.sleep(down_s)
    server.start()
    up = time.time()
    with run.client() as r:
        after = {
            "tasks": [e for e, _ in r.xrange(run.keys.tasks)],
            "trajectories": [e for e, _ in r.xrange(run.keys.trajectories)],
        }
    reconnect_s = run.wait_for(
        "every service to reconnect after the Redis restart",
        lambda: _all_heartbeat_after(run, survivors, up),
        reconnect_timeout_s,
        poll_s=0.1,
    )
    return Injected("redis_restart", began, up, {"before": before, "after_restart": after, "reconnect_s": reconnect_s})


def pause_redis_during_refit(
    run: FaultRun, server: RedisServer, *, pause_s: float, survivors: list[str], timeout_s: float = 120.0
) -> Injected:
    """Freeze the Redis server (SIGSTOP) for ``pause_s`` as a new refit closes the launch gate
    (before it announces the version: writing it takes longer than the poll), then let it go on
    (SIGCONT) and wait until every surviving service has sent a heartbeat again."""

    def refit_under_way() -> bool:
        with run.client() as r:
            return b"refit" in r.hkeys(run.keys.pause)

    run.wait_for("the gate open between refits", lambda: not refit_under_way(), timeout_s, poll_s=0.01)
    run.wait_for("a refit beginning", refit_under_way, timeout_s, poll_s=0.005)
    began = time.time()
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(pause_s)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    resumed = time.time()
    recover_s = run.wait_for(
        "every service to heartbeat after Redis answered again",
        lambda: _all_heartbeat_after(run, survivors, resumed),
        60.0,
        poll_s=0.1,
    )
    return Injected("redis_pause", began, resumed, {"recover_s": recover_s})
