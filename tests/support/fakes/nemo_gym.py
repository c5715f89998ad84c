"""Servers written to NeMo-Gym's HTTP protocol, for the driver's tests that need what the real
package's servers do not offer: parts broken on purpose (a resources server that is down, an agent
whose model server is not the gateway, a verify response forcing a failure kind) and an agent
that keeps every model response it got. The real package (scripts/setup_nemo_gym.sh) is tested in
tests/integration/test_nemo_gym_package.py.

* ``head_server_app(config)``: ``GET /global_config_dict_yaml`` (the global config as YAML, sent as a
  JSON string, as NeMo-Gym's head server does).
* ``crossing_resources_app()``: a resources server. ``/seed_session`` keeps the row's ``light`` in a
  cookie session; one tool, ``/look``, tells the light; ``/verify`` scores the final answer
  (0.5 for having looked, 0.5 for the right action) and passes a row's ``force_failure_kind``
  through as ``failure_kind`` with ``mask_sample``. Paths may carry the ``/ng-rollout/<id>`` prefix.
* ``simple_agent_app(name, config)``: an agent like NeMo-Gym's simple_agent. ``/run``: seed
  session, then its own ``/ng-rollout/<id>/v1/responses`` (the model <-> tools loop, up to
  ``max_steps``), then ``/verify``; the verify response is the answer. Servers are found by name
  in the global config; with ``observability_enabled`` model calls go to
  ``/ng-rollout/<_ng_rollout_id>/v1/responses``. Every model response is validated as OpenAI's
  ``Response`` (as NeMo-Gym validates ``NeMoGymResponse``) and kept in ``app.state.model_responses``.
* ``canned_model_app()``: a model server that answers every Responses call with one fixed message.

Every app keeps the bodies it answered in ``app.state`` lists for the tests to compare.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import httpx
import yaml
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from openai.types.responses import Response as OpenAIResponse

_PREFIX = re.compile(r"^/ng-rollout/(?P<rid>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<rest>/.*)$")
ACTIONS = {"red": "stop", "yellow": "wait", "green": "go"}


class StripRolloutPrefix:
    """ASGI middleware: ``/ng-rollout/<id>/x`` is served as ``/x`` (NeMo-Gym's servers do this)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        m = _PREFIX.match(scope.get("path", "")) if scope.get("type") == "http" else None
        if m is not None:
            scope = {**scope, "path": m.group("rest"), "raw_path": m.group("rest").encode()}
        await self.app(scope, receive, send)


def server_url(config: dict, name: str) -> str:
    """host:port of server ``name``: ``{name: {<server type>: {<impl>: {host, port}}}}``."""
    (by_impl,) = config[name].values()
    (inst,) = by_impl.values()
    return f"http://{inst['host']}:{inst['port']}"


def server_config(config: dict, name: str) -> dict:
    (by_impl,) = config[name].values()
    (inst,) = by_impl.values()
    return inst


def head_server_app(config: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/global_config_dict_yaml")
    async def global_config_dict_yaml() -> str:
        return yaml.safe_dump(config)

    return app


def crossing_resources_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(StripRolloutPrefix)
    sessions: dict[str, dict] = {}
    app.state.verified = []

    def state(request: Request) -> dict:
        sid = request.cookies.get("ng_session")
        if sid not in sessions:
            raise HTTPException(400, "no seeded session (cookie ng_session)")
        return sessions[sid]

    @app.post("/seed_session")
    async def seed_session(request: Request) -> JSONResponse:
        row = await request.json()
        sid = uuid.uuid4().hex
        sessions[sid] = {"light": row.get("light", "red")}
        resp = JSONResponse({})
        resp.set_cookie("ng_session", sid)
        return resp

    @app.post("/look")
    async def look(request: Request) -> dict:
        return {"light": state(request)["light"]}

    @app.post("/verify")
    async def verify(request: Request) -> dict:
        body = await request.json()
        output = body["response"]["output"]
        looked = any(o.get("type") == "function_call_output" for o in output)
        said = " ".join(c.get("text", "") for o in output if o.get("type") == "message" for c in o["content"])
        right = ACTIONS[state(request)["light"]] in said.lower().split()
        kind = body.get("force_failure_kind")
        result = {
            **body,
            "reward": 0.5 * looked + 0.5 * right,
            "mask_sample": kind is not None,
            "failure_kind": kind,
            "failure_reason": f"forced {kind}" if kind else None,
        }
        app.state.verified.append(result)
        return result

    return app


def simple_agent_app(name: str, config: dict) -> FastAPI:
    me = server_config(config, name)
    app = FastAPI()
    app.state.model_responses = []

    def prefix(rollout_id: str | None) -> str:
        return f"/ng-rollout/{rollout_id}" if rollout_id and config.get("observability_enabled") else ""

    async def post(http: httpx.AsyncClient, url: str, body: Any, cookies: dict) -> httpx.Response:
        cookie = "; ".join(f"{k}={v}" for k, v in cookies.items())
        return await http.post(url, json=body, headers={"cookie": cookie} if cookie else {})

    async def episode(body: dict, rollout_id: str | None, cookies: dict) -> dict:
        model = server_url(config, me["model_server"]["name"]) + prefix(rollout_id) + "/v1/responses"
        resources = server_url(config, me["resources_server"]["name"])
        new_outputs: list[dict] = []
        async with httpx.AsyncClient(timeout=120) as http:
            for _ in range(me.get("max_steps", 3)):
                r = await post(http, model, {**body, "input": body["input"] + new_outputs}, {})
                r.raise_for_status()
                response = r.json()
                OpenAIResponse.model_validate(response)
                app.state.model_responses.append(response)
                new_outputs += response["output"]
                calls = [o for o in response["output"] if o["type"] == "function_call"]
                if response.get("incomplete_details") or not calls:
                    break
                for call in calls:
                    t = await post(http, f"{resources}/{call['name']}", json.loads(call["arguments"]), cookies)
                    new_outputs.append({"type": "function_call_output", "call_id": call["call_id"], "output": t.text})
        return {**response, "output": new_outputs}

    @app.post("/v1/responses")
    @app.post("/ng-rollout/{rollout_id}/v1/responses")
    async def responses(request: Request, rollout_id: str | None = None) -> dict:
        return await episode(await request.json(), rollout_id, dict(request.cookies))

    @app.post("/run")
    async def run(request: Request) -> dict:
        row = await request.json()
        rid = row.get("_ng_rollout_id")
        resources = server_url(config, me["resources_server"]["name"]) + prefix(rid)
        async with httpx.AsyncClient(timeout=120) as http:
            seeded = await post(http, f"{resources}/seed_session", row, {})
            seeded.raise_for_status()
            cookies = dict(seeded.cookies)
            r = await post(
                http, f"{server_url(config, name)}{prefix(rid)}/v1/responses", row["responses_create_params"], cookies
            )
            r.raise_for_status()
            v = await post(http, f"{resources}/verify", {**row, "response": r.json()}, cookies)
            v.raise_for_status()
            return v.json()

    return app


def canned_model_app() -> FastAPI:
    """A model server that is not the gateway: one fixed answer, no token ids of this rollout."""
    app = FastAPI()
    app.add_middleware(StripRolloutPrefix)

    @app.post("/v1/responses")
    async def responses(request: Request) -> dict:
        body = await request.json()
        return {
            "id": "resp_canned",
            "created_at": 0.0,
            "model": "elsewhere",
            "object": "response",
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": body.get("tools", []),
            "output": [
                {
                    "type": "message",
                    "id": "msg_canned",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "stop", "annotations": []}],
                }
            ],
        }

    return app
