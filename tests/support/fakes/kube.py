"""A fake Kubernetes API server on loopback, for testing the k8s scale backend over HTTP.

It serves the few endpoints the backend uses, shaped as the real API answers them (apps/v1
Deployment and DeploymentList, autoscaling/v1 Scale, v1 PodList, v1 Status errors; zero-valued
status fields left out), checks the bearer token, and records every request. A small controller
stands in for the Deployment controller: after a change of replicas the next read still shows the
old observedGeneration; new pods become ready, and removed pods stay terminating (draining), for
``settle_reads`` reads of their Deployment.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from aiohttp import web

from tests.support.fakes.http import ThreadedServer, read_json

MERGE_PATCHES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    authorization: str
    body: object


@dataclass
class Pod:
    name: str
    reads_left: int  # until ready (new) or gone (terminating)
    terminating: bool = False


@dataclass
class Deployment:
    name: str
    labels: dict[str, str]
    replicas: int
    generation: int = 1
    observed: int = 1
    pods: list[Pod] = field(default_factory=list)


@dataclass
class FakeKubeAPI:
    token: str
    namespace: str = "default"
    settle_reads: int = 2
    never_ready: bool = False
    calls: list[Call] = field(default_factory=list)
    deployments: dict[str, Deployment] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._pod_ids = itertools.count(1)
        self._server = ThreadedServer("fake API server", self._handle, lambda r: web.TCPSite(r, "127.0.0.1", 0))

    def add_deployment(self, name: str, component: str, replicas: int, part_of: str = "streamrl") -> None:
        labels = {"app.kubernetes.io/name": part_of, "app.kubernetes.io/component": component}
        d = Deployment(name, labels, replicas)
        d.pods = [Pod(self._pod_name(d), 0) for _ in range(replicas)]
        self.deployments[name] = d

    def live_pods(self, name: str) -> list[Pod]:
        return [p for p in self.deployments[name].pods if not p.terminating]

    def patches(self) -> list[Call]:
        return [c for c in self.calls if c.method == "PATCH"]

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._server.port

    def start(self) -> str:
        self._server.start()
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop()

    # -- the API --------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self.calls.append(
            Call(
                request.method,
                request.path,
                dict(request.query),
                request.content_type,
                request.headers.get("Authorization", ""),
                body,
            )
        )
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        parts = request.path.strip("/").split("/")
        # /apis/apps/v1/namespaces/<ns>/deployments[/<name>[/scale]]
        if parts[:4] == ["apis", "apps", "v1", "namespaces"] and len(parts) >= 6 and parts[5] == "deployments":
            if parts[4] != self.namespace:
                if request.method == "GET" and len(parts) == 6:
                    return web.json_response(
                        {"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {}, "items": []}
                    )
                return _status(404, "NotFound", f'namespaces "{parts[4]}" not found')
            return self._deployments(request, parts[6:], body)
        if parts[:2] == ["api", "v1"] and parts[-1] == "pods" and request.method == "GET":
            return web.json_response(self._pod_list(request.query.get("labelSelector", "")))
        return _status(404, "NotFound", f"the server could not find the requested resource ({request.path})")

    def _deployments(self, request: web.Request, rest: list[str], body) -> web.Response:
        if not rest and request.method == "GET":
            wanted = _selector(request.query.get("labelSelector", ""))
            items = [
                self._deployment(d, tick=False)
                for d in self.deployments.values()
                if all(d.labels.get(k) == v for k, v in wanted.items())
            ]
            return web.json_response(
                {
                    "apiVersion": "apps/v1",
                    "kind": "DeploymentList",
                    "metadata": {"resourceVersion": "1"},
                    "items": items,
                }
            )
        d = self.deployments.get(rest[0]) if rest else None
        if d is None:
            return _status(404, "NotFound", f'deployments.apps "{rest[0] if rest else ""}" not found')
        if rest[1:] == [] and request.method == "GET":
            return web.json_response(self._deployment(d, tick=True))
        if rest[1:] == ["scale"] and request.method == "GET":
            return web.json_response(self._scale(d))
        if rest[1:] == ["scale"] and request.method == "PATCH":
            if request.content_type in MERGE_PATCHES and isinstance(body, dict):
                replicas = body.get("spec", {}).get("replicas")
            elif request.content_type == "application/json-patch+json" and isinstance(body, list):
                replicas = next((op["value"] for op in body if op.get("path") == "/spec/replicas"), None)
            else:
                return _status(
                    415, "UnsupportedMediaType", f"the body of content type {request.content_type} is not supported"
                )
            if not isinstance(replicas, int) or replicas < 0:
                return _status(422, "Invalid", f'Scale.autoscaling "{d.name}" is invalid: spec.replicas')
            self._set_replicas(d, replicas)
            return web.json_response(self._scale(d))
        return _status(405, "MethodNotAllowed", f"{request.method} is not allowed")

    def _set_replicas(self, d: Deployment, n: int) -> None:
        d.replicas, d.generation = n, d.generation + 1
        live = [p for p in d.pods if not p.terminating]
        for _ in range(n - len(live)):
            d.pods.append(Pod(self._pod_name(d), self.settle_reads))
        for p in live[n:][::-1] if n < len(live) else []:
            p.terminating, p.reads_left = True, self.settle_reads

    def _tick(self, d: Deployment) -> None:
        """One step of the controller, per read of the Deployment."""
        if d.observed < d.generation:
            d.observed = d.generation
            return
        for p in list(d.pods):
            if p.reads_left > 0 and not (self.never_ready and not p.terminating):
                p.reads_left -= 1
            if p.terminating and p.reads_left == 0:
                d.pods.remove(p)

    def _deployment(self, d: Deployment, tick: bool) -> dict:
        if tick:
            self._tick(d)
        live = [p for p in d.pods if not p.terminating]
        ready = sum(p.reads_left == 0 for p in live)
        status = {
            "observedGeneration": d.observed,
            "replicas": len(live),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": len(live),
        }
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": d.name,
                "namespace": self.namespace,
                "labels": d.labels,
                "generation": d.generation,
                "uid": f"uid-{d.name}",
                "resourceVersion": str(d.generation),
            },
            "spec": {
                "replicas": d.replicas,
                "selector": {"matchLabels": d.labels},
                "template": {
                    "metadata": {"labels": d.labels},
                    "spec": {
                        "containers": [{"name": d.labels["app.kubernetes.io/component"], "image": "streamrl:0.1.0"}]
                    },
                },
            },
            "status": {k: v for k, v in status.items() if v},  # the API leaves zero values out
        }

    def _scale(self, d: Deployment) -> dict:
        live = [p for p in d.pods if not p.terminating]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": d.name, "namespace": self.namespace, "resourceVersion": str(d.generation)},
            "spec": {"replicas": d.replicas},
            "status": {"replicas": len(live), "selector": ",".join(f"{k}={v}" for k, v in d.labels.items())},
        }

    def _pod_list(self, selector: str) -> dict:
        wanted = _selector(selector)
        items = []
        for d in self.deployments.values():
            if not all(d.labels.get(k) == v for k, v in wanted.items()):
                continue
            for p in d.pods:
                meta = {"name": p.name, "namespace": self.namespace, "labels": d.labels}
                if p.terminating:
                    meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
                items.append(
                    {
                        "metadata": meta,
                        "spec": {"containers": [{"name": "c", "image": "streamrl:0.1.0"}]},
                        "status": {"phase": "Running"},
                    }
                )
        return {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": items}

    def _pod_name(self, d: Deployment) -> str:
        return f"{d.name}-{next(self._pod_ids):05d}"


def _selector(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if "=" in part)


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        },
        status=code,
    )
