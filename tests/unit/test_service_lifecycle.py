"""`shared.service`: the one lifecycle every service shares. A dead background task fails the
service (hooks, /ready 503, exit code 1); a task that ends the service stops it with 0; probes
and their OpenAPI description are the same on every service."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from shared.admin_api import Readiness
from shared.service import EXIT_FAILED, EXIT_OK, ServiceLifecycle, add_probe_routes

pytestmark = pytest.mark.unit


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_dead_task_fails_the_service_once_and_asks_for_exit_code_1():
    lc = ServiceLifecycle("svc")
    seen, exits = [], []
    lc.on_failure(seen.append)
    lc.attach_server(lambda: exits.append(lc.exit_code))

    async def boom() -> None:
        raise RuntimeError("disk gone")

    lc.supervise("watcher", boom())
    lc.supervise("other", boom())
    await _settle()
    assert lc.failed and lc.error == "watcher died: RuntimeError: disk gone"
    assert seen == [lc.error]  # hooks run once, for the first failure
    assert lc.exit_code == EXIT_FAILED and exits and set(exits) == {EXIT_FAILED}


async def test_a_task_that_ends_the_service_exits_0_and_a_cancelled_one_changes_nothing():
    lc = ServiceLifecycle("svc")
    exits = []

    async def done() -> None:
        return None

    async def forever() -> None:
        await asyncio.Event().wait()

    t = lc.supervise("loop", forever())
    await _settle()
    t.cancel()
    await _settle()
    assert lc.exit_code is None and not lc.failed
    lc.supervise("run", done(), ends_service=True)
    await _settle()
    assert lc.exit_code == EXIT_OK and not lc.failed
    lc.attach_server(lambda: exits.append(True))  # decided before a server ran: it stops at once
    assert exits == [True]
    lc.fail("late")  # a later failure is logged and marked, but the exit code stays the first decision
    assert lc.failed and lc.exit_code == EXIT_OK


async def test_stop_tasks_cancels_what_still_runs():
    lc = ServiceLifecycle("svc")
    t = lc.supervise("loop", asyncio.Event().wait())
    await lc.stop_tasks(timeout_s=1.0)
    assert t.cancelled() and not lc.failed


async def test_probes_answer_and_a_failed_service_is_not_ready():
    app = FastAPI()
    app.state.lifecycle = lc = ServiceLifecycle("svc")

    async def metrics() -> bytes:
        return b"streamrl_up 1\n"

    add_probe_routes(app, lambda: Readiness(ready=True, state="ready", weight_version=3), metrics)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://svc") as client:
        assert (await client.get("/health")).json() == {"status": "ok"}
        r = await client.get("/ready")
        assert r.status_code == 200 and r.json() == {"ready": True, "state": "ready", "weight_version": 3}
        m = await client.get("/metrics")
        assert m.headers["content-type"].startswith("text/plain") and m.text == "streamrl_up 1\n"
        lc.fail("engine died")
        r = await client.get("/ready")
        assert r.status_code == 503 and r.json()["state"] == "failed" and r.json()["error"] == "engine died"
    doc = app.openapi()["paths"]
    assert list(doc["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "application/json" in doc["/ready"]["get"]["responses"]["200"]["content"]


def test_start_up_objects_are_left_out_of_later_collections():
    import gc

    from shared.service import freeze_startup_objects

    class Kept:
        pass

    kept = Kept()
    try:
        frozen = freeze_startup_objects()
        # the interpreter's and the test's modules; frozen objects that other threads of this
        # process (earlier tests') free meanwhile leave the count, nothing joins it
        assert frozen > 1000 and frozen - 1000 < gc.get_freeze_count() <= frozen
        assert not any(o is kept for o in gc.get_objects())  # a later collection never walks it
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
