"""A fake Docker Engine API on a unix socket, for testing what the compose binary and the compose
scale backend do without a container engine.

It keeps containers, networks and volumes in memory and answers the endpoints ``docker compose
up`` and ``GET /containers/...`` use, as the Engine API documents them (API 1.47), recording every
request. A container with a healthcheck reports Health "starting" for its first inspections after
start, then "healthy". ``fail_create`` makes container creation answer 500, as an engine that
cannot create the container would.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from tests.support.fakes.http import ThreadedServer, read_json

API_VERSION = "1.47"
IMAGE_ID = "sha256:" + "ab" * 32


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    body: dict | None


@dataclass
class Container:
    id: str
    name: str
    config: dict
    created: int
    status: str = "created"
    exit_code: int = 0
    inspections_since_start: int = 0

    @property
    def labels(self) -> dict[str, str]:
        return self.config.get("Labels") or {}


@dataclass
class FakeEngine:
    socket_path: Path
    healthy_after: int = 2  # inspections that still show "starting"
    fail_create: bool = False
    calls: list[Call] = field(default_factory=list)
    containers: dict[str, Container] = field(default_factory=dict)
    networks: dict[str, dict] = field(default_factory=dict)
    volumes: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._ids = itertools.count(1)
        self._server = ThreadedServer("fake engine", self._handle, lambda r: web.UnixSite(r, str(self.socket_path)))

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> str:
        self._server.start()
        return f"unix://{self.socket_path}"

    def stop(self) -> None:
        self._server.stop()

    # -- what tests look at ---------------------------------------------------------------------

    def service(self, name: str) -> list[Container]:
        return sorted(
            (c for c in self.containers.values() if c.labels.get("com.docker.compose.service") == name),
            key=lambda c: c.name,
        )

    def mutations(self) -> list[str]:
        """ "METHOD container-name/action" for every state change, in order."""
        out = []
        for c in self.calls:
            if c.method in ("POST", "DELETE") and "/containers/" in c.path:
                out.append(f"{c.method} {c.path.split('/containers/', 1)[1]}")
        return out

    # -- the API --------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        path = request.path
        if path.startswith(f"/v{API_VERSION}/"):
            path = path[len(API_VERSION) + 2 :]
        self.calls.append(Call(request.method, self._named(path), dict(request.query), body))
        if path == "/_ping":
            return web.Response(text="OK", headers={"API-Version": API_VERSION, "OSType": "linux"})
        if path == "/version":
            return web.json_response(
                {
                    "Version": "27.0.0",
                    "ApiVersion": API_VERSION,
                    "MinAPIVersion": "1.24",
                    "Os": "linux",
                    "Arch": "amd64",
                }
            )
        if path == "/info":
            return web.json_response({"ID": "fake", "Name": "fake", "ServerVersion": "27.0.0", "OSType": "linux"})
        if path.startswith("/images/") and path.endswith("/json"):
            return web.json_response(
                {
                    "Id": IMAGE_ID,
                    "RepoTags": [path[len("/images/") : -len("/json")]],
                    "Config": {"Env": [], "Labels": {}},
                    "Os": "linux",
                    "Architecture": "amd64",
                }
            )
        if path.startswith("/networks") or path.startswith("/volumes"):
            return self._named_objects(request.method, path, body, request.query)
        if path.startswith("/containers"):
            return self._containers(request.method, path, body, request.query)
        return _error(404, f"page not found: {request.method} {path}")

    def _named(self, path: str) -> str:
        """The path with container ids replaced by names (recorded calls read better)."""
        parts = path.split("/")
        if len(parts) > 2 and parts[1] == "containers" and parts[2] in self.containers:
            parts[2] = self.containers[parts[2]].name
        return "/".join(parts)

    def _named_objects(self, method: str, path: str, body: dict | None, query) -> web.Response:
        kind = "networks" if path.startswith("/networks") else "volumes"
        store = getattr(self, kind)
        if method == "POST" and path.endswith("/create"):
            name = body["Name"]
            store[name] = {
                "Name": name,
                "Id": name,
                "Labels": body.get("Labels") or {},
                "Driver": "local",
                "Scope": "local",
                "Containers": {},
                "Options": {},
                "IPAM": {"Config": []},
                "Mountpoint": "/x",
            }
            return web.json_response(store[name] if kind == "volumes" else {"Id": name, "Warning": ""}, status=201)
        if method == "GET" and path in ("/networks", "/volumes"):
            items = list(store.values())
            return web.json_response(items if kind == "networks" else {"Volumes": items, "Warnings": []})
        name = path.split("/", 2)[2]
        if method == "GET" and name in store:
            return web.json_response(store[name])
        return _error(404, f"{kind[:-1]} {name} not found")

    def _containers(self, method: str, path: str, body: dict | None, query) -> web.Response:
        if method == "GET" and path == "/containers/json":
            filters = json.loads(query.get("filters", "{}"))
            shown = [
                c
                for c in self.containers.values()
                if _matches(c, filters) and (query.get("all") in ("1", "true") or c.status == "running")
            ]
            return web.json_response([self._summary(c) for c in sorted(shown, key=lambda c: c.created)])
        if method == "POST" and path == "/containers/create":
            if self.fail_create:
                return _error(500, "failed to create the container: no space left on device")
            cid = f"{next(self._ids):064x}"
            self.containers[cid] = Container(cid, query["name"], body, created=int(time.time()))
            return web.json_response({"Id": cid, "Warnings": []}, status=201)
        _, _, key, *action = path.split("/")
        c = self.containers.get(key) or next((c for c in self.containers.values() if c.name == key), None)
        if c is None:
            return _error(404, f"No such container: {key}")
        if method == "GET" and action == ["json"]:
            return web.json_response(self._inspect(c))
        if method == "POST" and action == ["start"]:
            c.status, c.inspections_since_start = "running", 0
            return web.Response(status=204)
        if method == "POST" and action == ["stop"]:
            c.status, c.exit_code = "exited", 0
            return web.Response(status=204)
        if method == "DELETE" and not action:
            del self.containers[c.id]
            return web.Response(status=204)
        return _error(404, f"page not found: {method} {path}")

    def _summary(self, c: Container) -> dict:
        return {
            "Id": c.id,
            "Names": [f"/{c.name}"],
            "Image": c.config.get("Image"),
            "ImageID": IMAGE_ID,
            "Command": " ".join(c.config.get("Cmd") or []),
            "Created": c.created,
            "Labels": c.labels,
            "State": c.status,
            "Status": c.status,
            "Ports": [],
            "Mounts": [],
            "NetworkSettings": {"Networks": {}},
        }

    def _inspect(self, c: Container) -> dict:
        state = {"Status": c.status, "Running": c.status == "running", "ExitCode": c.exit_code}
        if c.config.get("Healthcheck") and c.status == "running":
            c.inspections_since_start += 1
            state["Health"] = {"Status": "healthy" if c.inspections_since_start > self.healthy_after else "starting"}
        return {
            "Id": c.id,
            "Name": f"/{c.name}",
            "Created": "2026-01-01T00:00:00Z",
            "Image": IMAGE_ID,
            "State": state,
            "Config": c.config,
            "HostConfig": c.config.get("HostConfig") or {},
            "NetworkSettings": {"Networks": {}},
            "Mounts": [],
        }


def _matches(c: Container, filters: dict) -> bool:
    labels = filters.get("label", [])
    for want in labels if isinstance(labels, list) else list(labels):
        key, eq, value = want.partition("=")
        if (eq and c.labels.get(key) != value) or (not eq and key not in c.labels):
            return False
    return True


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"message": message}, status=status)
