"""The ``k8s`` scale backend: the ``scale`` subresource of the generator and gym-gateway workloads,
Deployments or LeaderWorkerSets (multi-node engines: one replica is a group of pods, one engine),
through the kubernetes Python client (the ``k8s`` extra).

    client: in-cluster service account, else the kubeconfig (--kubeconfig, KUBECONFIG,
            ~/.kube/config; --context)
    namespace: --namespace, else the kubeconfig context's, else the pod's own, else "default"
    workload of a service: --generator-deployment / --gateway-deployment (NAME, deployment/NAME or
            leaderworkerset/NAME; a plain NAME is the Deployment, else the LeaderWorkerSet), else
            the one Deployment or LeaderWorkerSet matching --selector plus
            app.kubernetes.io/component=<service> (deploy/k8s labels; no LWS CRD: Deployments only)
    PATCH .../deployments/<name>/scale or
          /apis/leaderworkerset.x-k8s.io/v1/.../leaderworkersets/<name>/scale
          {"spec": {"replicas": N}}  (merge patch)
    -> poll until each workload has observed the change, N replicas (groups) ready, and none of its
       pods is still terminating (removed pods drain on SIGTERM within terminationGracePeriodSeconds)

Scaling down is the controller's: it picks the pods (for an LWS, the highest groups, leader and
workers) to delete and sends them SIGTERM; the services drain on it (a generator leaves routing
first, a gateway finishes or releases its tasks), so the wait for terminating pods is the wait for
their drain. A workload an autoscaler owns (the multi-node overlay's gym-gateway, under KEDA) is
scaled back by it: change its ScaledObject's bounds instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.scale import SERVICES, ScaleError, ScaleResult

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

COMPONENT_LABEL = "app.kubernetes.io/component"
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
POLL_S = 1.0
DEPLOYMENT, LWS = "Deployment", "LeaderWorkerSet"
LWS_API = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")  # group, version, plural
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
_RAISE = object()


@dataclass(frozen=True)
class _State:
    """What a wait needs of a Deployment or LeaderWorkerSet (its replicas: pods, or LWS groups)."""

    generation: int
    observed: int
    replicas: int
    ready: int
    pods: str  # label selector of all its pods


def _api_client(kubeconfig: str | None, context: str | None) -> tuple[ApiClient, str | None]:
    """(ApiClient, namespace of the context or pod, or None)."""
    from kubernetes import client, config

    if kubeconfig is None and context is None:
        try:
            cfg = client.Configuration()
            # kubernetes ships py.typed but leaves its config loaders unannotated.
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
            ns = SA_NAMESPACE_FILE.read_text().strip() if SA_NAMESPACE_FILE.is_file() else None
            return client.ApiClient(cfg), ns
        except config.ConfigException:
            pass  # not inside a pod: the kubeconfig
    try:
        # The same unannotated loaders (kubernetes' py.typed does not cover kubernetes.config).
        api = config.new_client_from_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
        _, active = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        if context is not None:
            contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
            active = next(c for c in contexts if c["name"] == context)
    except (config.ConfigException, OSError, StopIteration) as exc:
        raise ScaleError(f"no Kubernetes access: {exc} (--kubeconfig, --context, or run inside the cluster)") from exc
    return api, (active.get("context") or {}).get("namespace")


class KubernetesBackend:
    name = "k8s"

    def __init__(
        self,
        *,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        selector: str | None = "app.kubernetes.io/name=streamrl",
        deployments: dict[str, str] | None = None,
        api_client: ApiClient | None = None,
    ) -> None:
        try:
            from kubernetes import client
        except ImportError as exc:
            raise ScaleError("the k8s backend needs the kubernetes package: pip install 'streamrl[k8s]'") from exc
        if api_client is None:
            api_client, context_ns = _api_client(kubeconfig, context)
        else:
            context_ns = None
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.namespace = namespace or context_ns or "default"
        self.selector = selector or ""
        self.kinds: dict[str, str] = {}
        self.deployments: dict[str, str] = {}  # service -> name of its workload (kind in `kinds`)
        for s in SERVICES:
            given = (deployments or {}).get(s)
            self.kinds[s], self.deployments[s] = self._named(given) if given else self._find(s)

    def _call(self, what: str, fn: Callable[..., object], *args: Any, not_found: Any = _RAISE, **kw: Any) -> Any:
        """``fn(*args, **kw)``, its failures as ScaleError (a 404 answers ``not_found`` if given).
        The answer is read untyped: the client's generated models declare every field Optional,
        even the metadata and status the API server always fills in on the objects it returns."""
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, **kw)
        except ApiException as exc:
            if exc.status == 404 and not_found is not _RAISE:
                return not_found
            raise ScaleError(
                f"Kubernetes API: {what} in namespace {self.namespace!r} failed "
                f"({exc.status} {exc.reason}): {(exc.body or '')[:300]}"
            ) from exc
        except OSError as exc:  # urllib3 connection errors are OSErrors
            raise ScaleError(f"Kubernetes API unreachable: {what}: {exc}") from exc

    def _named(self, given: str) -> tuple[str, str]:
        """(kind, name) of a workload given as NAME, deployment/NAME or leaderworkerset/NAME."""
        prefix, _, name = given.rpartition("/")
        kind = {"": "", "deployment": DEPLOYMENT, "leaderworkerset": LWS, "lws": LWS}.get(prefix.lower())
        if kind is None:
            raise ScaleError(f"{given!r}: name a workload as NAME, deployment/NAME or leaderworkerset/NAME")
        if kind:
            return kind, name
        if self._get(DEPLOYMENT, name, not_found=None) is not None:
            return DEPLOYMENT, name
        if self._get(LWS, name, not_found=None) is not None:
            return LWS, name
        raise ScaleError(f"no Deployment or LeaderWorkerSet {name!r} in namespace {self.namespace!r}")

    def _get(self, kind: str, name: str, **kw: Any) -> Any:
        if kind == DEPLOYMENT:
            return self._call(
                f"reading Deployment {name}", self.apps.read_namespaced_deployment, name, self.namespace, **kw
            )
        group, version, plural = LWS_API
        return self._call(
            f"reading LeaderWorkerSet {name}",
            self.custom.get_namespaced_custom_object,
            group,
            version,
            self.namespace,
            plural,
            name,
            **kw,
        )

    def _find(self, service: str) -> tuple[str, str]:
        labels = ",".join(x for x in (self.selector, f"{COMPONENT_LABEL}={service}") if x)
        deployments = self._call(
            f"listing Deployments with labels {labels}",
            self.apps.list_namespaced_deployment,
            self.namespace,
            label_selector=labels,
        ).items
        group, version, plural = LWS_API
        lws = self._call(  # 404: the LWS CRD is not installed, so there is none
            f"listing LeaderWorkerSets with labels {labels}",
            self.custom.list_namespaced_custom_object,
            group,
            version,
            self.namespace,
            plural,
            label_selector=labels,
            not_found={"items": []},
        )["items"]
        found = sorted(
            [(DEPLOYMENT, d.metadata.name) for d in deployments] + [(LWS, o["metadata"]["name"]) for o in lws]
        )
        if len(found) != 1:
            flag = "--generator-deployment" if service == "generator" else "--gateway-deployment"
            names = [n if k == DEPLOYMENT else f"leaderworkerset/{n}" for k, n in found]
            raise ScaleError(
                f"{len(found)} Deployments or LeaderWorkerSets in namespace {self.namespace!r} match {labels}"
                f"{': ' + ', '.join(names) if names else ''}; name the {service} one with {flag}"
            )
        return found[0]

    def counts(self) -> dict[str, int]:
        return {s: self._read(s).ready for s in SERVICES}

    def _read(self, service: str) -> _State:
        kind, name = self.kinds[service], self.deployments[service]
        obj = self._get(kind, name)
        if kind == DEPLOYMENT:  # a V1Deployment, read untyped as _call says
            st = obj.status
            selector = ",".join(f"{k}={v}" for k, v in (obj.spec.selector.match_labels or {}).items())
            return _State(
                obj.metadata.generation or 0,
                st.observed_generation or 0,
                st.replicas or 0,
                st.ready_replicas or 0,
                selector,
            )
        st = obj.get("status") or {}  # a LeaderWorkerSet as JSON; its status leaves zero values out
        return _State(
            obj["metadata"].get("generation", 0),
            st.get("observedGeneration", 0),
            st.get("replicas", 0),
            st.get("readyReplicas", 0),
            f"{LWS_NAME_LABEL}={name}",
        )

    def scale(self, targets: dict[str, int], timeout_s: float) -> ScaleResult:
        before = self.counts()
        merge = "application/merge-patch+json"
        for service, n in targets.items():
            kind, name = self.kinds[service], self.deployments[service]
            body = {"spec": {"replicas": n}}
            if kind == DEPLOYMENT:
                self._call(
                    f"scaling Deployment {name}",
                    self.apps.patch_namespaced_deployment_scale,
                    name,
                    self.namespace,
                    body,
                    _content_type=merge,
                )
            else:
                group, version, plural = LWS_API
                self._call(
                    f"scaling LeaderWorkerSet {name}",
                    self.custom.patch_namespaced_custom_object_scale,
                    group,
                    version,
                    self.namespace,
                    plural,
                    name,
                    body,
                    _content_type=merge,
                )
        deadline = time.monotonic() + timeout_s
        while True:
            state = {s: self._settled(s, n) for s, n in targets.items()}
            if all(ok for ok, _ in state.values()):
                return ScaleResult(before, {**before, **targets})
            if time.monotonic() > deadline:
                raise ScaleError(
                    f"not scaled within {timeout_s:.0f}s: "
                    + "; ".join(f"{self.deployments[s]}: {why}" for s, (ok, why) in state.items() if not ok)
                )
            time.sleep(POLL_S)

    def _settled(self, service: str, n: int) -> tuple[bool, str]:
        st = self._read(service)
        if st.observed < st.generation:
            return False, "the controller has not seen the change yet"
        pods = self._call(
            f"listing pods of {self.deployments[service]}",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=st.pods,
        ).items
        terminating = sum(p.metadata.deletion_timestamp is not None for p in pods)
        if st.ready != n or st.replicas != n or terminating:
            what = " group(s)" if self.kinds[service] == LWS else ""
            return False, f"{st.ready} ready of {st.replicas}{what} (want {n}), {terminating} pod(s) still draining"
        return True, ""
