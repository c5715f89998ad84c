"""A fake Kubernetes API server on loopback, for testing the k8s scale backend over HTTP.

It serves the few endpoints the backend uses, shaped as the real API answers them (apps/v1
Deployment and DeploymentList; leaderworkerset.x-k8s.io/v1 LeaderWorkerSet and its list, as the LWS
controller fills them in; autoscaling/v1 Scale; v1 PodList; v1 Status errors; zero-valued status
fields left out), checks the bearer token, and records every request. Without the LeaderWorkerSet
CRD (``lws_crd=False``) its paths answer 404, as a cluster without the LWS controller does. A small
controller stands in for the Deployment and LWS controllers: after a change of replicas the next
read still shows the old observedGeneration; new pods (a group of ``size`` pods per LWS replica)
become ready, and removed pods stay terminating (draining), for ``settle_reads`` reads of their
workload.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from aiohttp import web

from tests.support.fakes.http import ThreadedServer, read_json

MERGE_PATCHES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
LWS_API = ["apis", "leaderworkerset.x-k8s.io", "v1"]
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


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
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Workload:
    """A Deployment (``size`` 1) or a LeaderWorkerSet (``size`` pods per replica, a group)."""

    name: str
    labels: dict[str, str]
    replicas: int
    kind: str = "Deployment"
    size: int = 1
    generation: int = 1
    observed: int = 1
    pods: list[Pod] = field(default_factory=list)  # a group's pods are adjacent, leader first


@dataclass
class FakeKubeAPI:
    token: str
    namespace: str = "default"
    settle_reads: int = 2
    never_ready: bool = False
    lws_crd: bool = True
    calls: list[Call] = field(default_factory=list)
    workloads: dict[str, Workload] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._pod_ids = itertools.count(1)
        self._server = ThreadedServer("fake API server", self._handle, lambda r: web.TCPSite(r, "127.0.0.1", 0))

    def add_deployment(self, name: str, component: str, replicas: int, part_of: str = "streamrl") -> None:
        self._add(Workload(name, _labels(component, part_of), replicas))

    def add_leaderworkerset(
        self, name: str, component: str, replicas: int, size: int = 2, part_of: str = "streamrl"
    ) -> None:
        self._add(Workload(name, _labels(component, part_of), replicas, kind="LeaderWorkerSet", size=size))

    def _add(self, w: Workload) -> None:
        for _ in range(w.replicas):
            self._add_group(w, ready_after=0)
        self.workloads[w.name] = w

    def live_pods(self, name: str) -> list[Pod]:
        return [p for p in self.workloads[name].pods if not p.terminating]

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
            return self._workloads(request, "Deployment", parts[6:], body)
        if parts[:3] == LWS_API and len(parts) >= 6 and parts[3] == "namespaces" and parts[5] == "leaderworkersets":
            if not self.lws_crd:
                return _status(404, "NotFound", f"the server could not find the requested resource ({request.path})")
            if parts[4] != self.namespace:
                return _status(404, "NotFound", f'namespaces "{parts[4]}" not found')
            return self._workloads(request, "LeaderWorkerSet", parts[6:], body)
        if parts[:2] == ["api", "v1"] and parts[-1] == "pods" and request.method == "GET":
            return web.json_response(self._pod_list(request.query.get("labelSelector", "")))
        return _status(404, "NotFound", f"the server could not find the requested resource ({request.path})")

    def _workloads(self, request: web.Request, kind: str, rest: list[str], body) -> web.Response:
        api = "apps/v1" if kind == "Deployment" else "leaderworkerset.x-k8s.io/v1"
        if not rest and request.method == "GET":
            wanted = _selector(request.query.get("labelSelector", ""))
            items = [
                self._object(d, tick=False)
                for d in self.workloads.values()
                if d.kind == kind and all(d.labels.get(k) == v for k, v in wanted.items())
            ]
            return web.json_response(
                {"apiVersion": api, "kind": f"{kind}List", "metadata": {"resourceVersion": "1"}, "items": items}
            )
        d = self.workloads.get(rest[0]) if rest else None
        if d is None or d.kind != kind:
            plural = "deployments.apps" if kind == "Deployment" else "leaderworkersets.leaderworkerset.x-k8s.io"
            return _status(404, "NotFound", f'{plural} "{rest[0] if rest else ""}" not found')
        if rest[1:] == [] and request.method == "GET":
            return web.json_response(self._object(d, tick=True))
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

    def _add_group(self, d: Workload, ready_after: int) -> None:
        """One more replica: a pod, or an LWS group of ``size`` pods (<name>-<group>, then its
        workers <name>-<group>-<index>) carrying the LWS controller's labels."""
        if d.kind == "Deployment":
            d.pods.append(Pod(self._pod_name(d), ready_after, labels=d.labels))
            return
        group = sum(not p.terminating for p in d.pods) // d.size  # the leaders' StatefulSet ordinal
        for index in range(d.size):
            labels = {
                **d.labels,
                LWS_NAME_LABEL: d.name,
                "leaderworkerset.sigs.k8s.io/group-index": str(group),
                "leaderworkerset.sigs.k8s.io/worker-index": str(index),
            }
            name = f"{d.name}-{group}" + (f"-{index}" if index else "")
            d.pods.append(Pod(name, ready_after, labels=labels))

    def _set_replicas(self, d: Workload, n: int) -> None:
        d.replicas, d.generation = n, d.generation + 1
        live = [p for p in d.pods if not p.terminating]
        for _ in range(n - len(live) // d.size):
            self._add_group(d, ready_after=self.settle_reads)
        for p in live[n * d.size :] if n * d.size < len(live) else []:  # the highest groups go
            p.terminating, p.reads_left = True, self.settle_reads

    def _tick(self, d: Workload) -> None:
        """One step of the controller, per read of the workload."""
        if d.observed < d.generation:
            d.observed = d.generation
            return
        for p in list(d.pods):
            if p.reads_left > 0 and not (self.never_ready and not p.terminating):
                p.reads_left -= 1
            if p.terminating and p.reads_left == 0:
                d.pods.remove(p)

    def _object(self, d: Workload, tick: bool) -> dict:
        if tick:
            self._tick(d)
        return self._deployment(d) if d.kind == "Deployment" else self._leaderworkerset(d)

    def _deployment(self, d: Workload) -> dict:
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

    def _groups(self, d: Workload) -> tuple[int, int]:
        """(live groups, ready groups): a group is ready when all its pods are."""
        live = [p for p in d.pods if not p.terminating]
        groups = [live[i : i + d.size] for i in range(0, len(live), d.size)]
        return len(groups), sum(all(p.reads_left == 0 for p in g) for g in groups)

    def _leaderworkerset(self, d: Workload) -> dict:
        replicas, ready = self._groups(d)
        template = {
            "metadata": {"labels": d.labels},
            "spec": {"containers": [{"name": "c", "image": "streamrl:0.1.0"}]},
        }
        status = {
            "observedGeneration": d.observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
            "hpaPodSelector": f"{LWS_NAME_LABEL}={d.name},leaderworkerset.sigs.k8s.io/worker-index=0",
        }
        return {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
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
                "startupPolicy": "LeaderCreated",
                "leaderWorkerTemplate": {
                    "size": d.size,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": template,
                    "workerTemplate": template,
                },
                "rolloutStrategy": {
                    "type": "RollingUpdate",
                    "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1, "partition": 0},
                },
            },
            "status": {k: v for k, v in status.items() if v},  # omitempty
        }

    def _scale(self, d: Workload) -> dict:
        live = [p for p in d.pods if not p.terminating]
        if d.kind == "Deployment":
            status = {"replicas": len(live), "selector": ",".join(f"{k}={v}" for k, v in d.labels.items())}
        else:  # the CRD's scale subresource: .status.replicas and .status.hpaPodSelector
            lws = self._leaderworkerset(d)["status"]
            status = {"replicas": lws.get("replicas", 0), "selector": lws["hpaPodSelector"]}
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": d.name, "namespace": self.namespace, "resourceVersion": str(d.generation)},
            "spec": {"replicas": d.replicas},
            "status": status,
        }

    def _pod_list(self, selector: str) -> dict:
        wanted = _selector(selector)
        items = []
        for d in self.workloads.values():
            for p in d.pods:
                if not all(p.labels.get(k) == v for k, v in wanted.items()):
                    continue
                meta = {"name": p.name, "namespace": self.namespace, "labels": p.labels}
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

    def _pod_name(self, d: Workload) -> str:
        return f"{d.name}-{next(self._pod_ids):05d}"


def _labels(component: str, part_of: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": part_of, "app.kubernetes.io/component": component}


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
