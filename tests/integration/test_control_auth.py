"""The API token on every service, served for real: 401 (missing or malformed header, with
``WWW-Authenticate: Bearer``), 403 (wrong token) and 200 on each control route; probes and
/metrics stay open; agent routes are open unless auth.protect_agent_routes, and then a whole
rollout still runs because the gateway sends the token on its own calls. The trainer runs on a
password-protected Valkey: neither the token nor the Redis password shows in logs, /status or
/metrics. The ``streamrl`` CLI sends the token from the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
import msgspec
import pytest

from shared.auth import AuthPolicy
from shared.run_config import RunConfig
from streamrl.redis_server import free_port
from tests.support.gateway import collect, gateway_task
from tests.support.redis import start_valkey

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "ctl-7d1e94b2c05a4f3e"
WRONG = "ctl-wrong-0000000000"
REDIS_PASSWORD = "redis-pw-5c2b"


async def _check_route(client: httpx.AsyncClient, method: str, path: str, body: dict | None = None) -> httpx.Response:
    """401 without and with a malformed header, 403 with a wrong token, then the answer with the right one."""
    r = await client.request(method, path, json=body)
    assert r.status_code == 401, (path, r.text)
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["error"]["type"] == "authentication_error"
    r = await client.request(method, path, json=body, headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status_code == 401
    r = await client.request(method, path, json=body, headers={"Authorization": f"Bearer {WRONG}"})
    assert r.status_code == 403 and WRONG not in r.text and TOKEN not in r.text
    return await client.request(method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})


# ---- trainer ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory):
    server = start_valkey(tmp_path_factory.mktemp("valkey-pw"), extra_args=["--requirepass", REDIS_PASSWORD])
    yield f"redis://:{quote(REDIS_PASSWORD)}@127.0.0.1:{server.port}/0"
    server.stop()


@pytest.fixture
async def trainer(tiny_model_dir, secured_redis, tmp_path, serve_app):
    from tests.support.trainer import control_plane, serving_app, trainer_config

    cfg = trainer_config(tmp_path, secured_redis, tiny_model_dir, "auth")
    port = free_port()
    control = control_plane(cfg, url=f"http://127.0.0.1:{port}")
    await control.open()
    async with serve_app(serving_app(cfg, control, auth=AuthPolicy(TOKEN)), port) as url:
        yield control, url, secured_redis
    await control.aclose()


async def test_trainer_control_routes_need_the_token(trainer, caplog):
    rt, url, redis_url = trainer
    caplog.set_level(logging.DEBUG)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        assert (await client.get("/health")).status_code == 200 and (await client.get("/metrics")).status_code == 200
        assert (await client.get("/ready")).status_code == 503  # answered (no weights yet), not refused
        status = await _check_route(client, "GET", "/status")
        assert status.status_code == 200 and status.json()["step"] == 0
        epoch = (await _check_route(client, "POST", "/pause")).json()["epoch"]
        resumed = await _check_route(client, "POST", "/resume", {"epoch": epoch})
        assert resumed.json() == {"resumed": True, "epoch": epoch}
        vid = (await _check_route(client, "POST", "/validate")).json()["validation_id"]
        assert (await _check_route(client, "GET", f"/validations/{vid}")).json()["status"] == "queued"
        shown = status.text + (await client.get("/metrics")).text
    for secret in (TOKEN, WRONG, REDIS_PASSWORD):
        assert secret not in caplog.text and secret not in shown
    assert redis_url.split("@")[1] not in shown  # not even the Redis address is exposed


async def _cli(*args: str, token: str | None = None, token_file: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI as a process, off the event loop (which serves the trainer it calls)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_API_TOKEN") and k != "REDIS_URL"}
    if token:
        env["STREAMRL_API_TOKEN"] = token
    if token_file:
        env["STREAMRL_API_TOKEN_FILE"] = str(token_file)
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "streamrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


async def test_cli_sends_the_token_from_the_environment(trainer, tmp_path):
    rt, url, redis_url = trainer
    refused = await _cli("pause", "--url", url)
    assert refused.returncode == 1 and "401" in refused.stderr
    assert "403" in (await _cli("pause", "--url", url, token=WRONG)).stderr
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    ok = await _cli("pause", "--url", url, token_file=token_file)
    assert ok.returncode == 0, ok.stderr
    assert "user" in await rt.pause.reasons()
    # status: Redis with its password from --redis-url, the trainer's /status with the token
    out = await _cli("status", "--redis-url", redis_url, "--run-id", rt.cfg.run.run_id, "--json", token=TOKEN)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["trainer"]["run_id"] == rt.cfg.run.run_id and s["pause"]["user"] >= 1
    assert REDIS_PASSWORD not in out.stdout + out.stderr and TOKEN not in out.stdout + out.stderr
    wrong = await _cli("status", "--redis-url", redis_url, "--run-id", rt.cfg.run.run_id, "--json", token=WRONG)
    assert wrong.returncode == 0 and json.loads(wrong.stdout)["trainer"] is None  # Redis' view without the trainer's
    # no Redis at hand (a port-forwarded trainer): the trainer's own view, with the token
    only = await _cli("status", "--url", url, "--json", token=TOKEN)
    assert only.returncode == 0, only.stderr
    assert json.loads(only.stdout)["trainer"]["run_id"] == rt.cfg.run.run_id
    refused = await _cli("status", "--url", url, token=WRONG)
    assert refused.returncode == 1 and f"the trainer at {url} answered 403" in refused.stderr


# ---- generator -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _generator(cfg: RunConfig):
    from services.generator.app import build_app

    app = build_app(cfg, worker_id=f"gen-auth-{uuid.uuid4().hex[:6]}", port=0)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://generator", timeout=60.0
        ) as client:
            deadline = asyncio.get_running_loop().time() + 60
            while (await client.get("/ready")).status_code != 200:  # the engine loads in the lifespan
                assert asyncio.get_running_loop().time() < deadline, "generator not ready"
                await asyncio.sleep(0.05)
            yield client


async def test_generator_admin_routes_need_the_token(tiny_model_dir, write_config, monkeypatch):
    monkeypatch.setenv("STREAMRL_API_TOKEN", TOKEN)
    _, cfg = write_config(tiny_model_dir)
    async with _generator(cfg) as client:

        async def check(method: str, path: str, body: dict | None = None) -> httpx.Response:
            r = await client.request(method, path, json=body)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), path
            r = await client.request(method, path, json=body, headers={"Authorization": f"Bearer {WRONG}"})
            assert r.status_code == 403, path
            return await client.request(method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})

        assert (await check("GET", "/admin/state")).json()["worker_id"].startswith("gen-auth-")
        assert (await check("POST", "/admin/pause", {"mode": "drain"})).json()["state"] == "paused"
        assert (await check("POST", "/admin/resume")).json()["state"] != "paused"
        assert (await check("POST", "/admin/reset_prefix_cache")).status_code == 200
        r = await check("POST", "/admin/load_weights", {"version": 1, "path": "/no/such/weights", "checksum": "x"})
        # authorised, then refused naming the field: the folder holds no weights
        assert r.status_code == 400 and r.json()["error"]["param"] == "path"
        for path in ("/health", "/metrics", "/v1/models"):  # probes, scrapes and agents need no token
            assert (await client.get(path)).status_code == 200, path


async def test_generator_agent_routes_with_protect_agent_routes(tiny_model_dir, write_config, monkeypatch):
    monkeypatch.setenv("STREAMRL_API_TOKEN", TOKEN)
    _, cfg = write_config(tiny_model_dir)
    cfg = msgspec.structs.replace(cfg, auth=msgspec.structs.replace(cfg.auth, protect_agent_routes=True))
    async with _generator(cfg) as client:
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {WRONG}"})).status_code == 403
        # OpenAI clients send their api_key as this bearer token
        assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 200
        assert (await client.get("/health")).status_code == 200


# ---- gym gateway (with its generator) ------------------------------------------------------


async def test_gateway_session_routes_open_by_default(gateway_stack, monkeypatch):
    monkeypatch.setenv("STREAMRL_API_TOKEN", TOKEN)
    async with gateway_stack() as st:
        async with httpx.AsyncClient(base_url=st.url, timeout=30) as client:
            r = await client.get("/sessions/nope/v1/models")
            assert r.status_code == 404  # reached the route: no token needed for agents


async def test_protected_agent_routes_still_run_rollouts(gateway_stack, monkeypatch):
    monkeypatch.setenv("STREAMRL_API_TOKEN", TOKEN)
    async with gateway_stack(auth={"protect_agent_routes": True}) as st:
        async with httpx.AsyncClient(base_url=st.url, timeout=30) as client:
            assert (await client.get("/sessions/nope/v1/models")).status_code == 401
            bad = await client.get("/sessions/nope/v1/models", headers={"Authorization": f"Bearer {WRONG}"})
            assert bad.status_code == 403
            good = await client.get("/sessions/nope/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
            assert good.status_code == 404  # past auth: the session does not exist
            assert (await client.get("/metrics")).status_code == 200
        gen_url = st.generators[0].url
        async with httpx.AsyncClient(base_url=gen_url, timeout=30) as client:
            assert (await client.get("/v1/models")).status_code == 401
        # environment -> session proxy -> generator: every hop carries the token
        await st.streams.publish(st.streams.keys.tasks, gateway_task(0))
        (traj,) = await collect(st.streams, 1)
        assert traj.status == "ok" and traj.turns, traj.fallback_reason
