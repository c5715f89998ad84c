"""The ``k8s`` scale backend: the ``scale`` subresource of the generator and gym-gateway
Deployments, through the kubernetes Python client (the ``k8s`` extra).

    client: in-cluster service account, else the kubeconfig (--kubeconfig, KUBECONFIG,
            ~/.kube/config; --context)
    namespace: --namespace, else the kubeconfig context's, else the pod's own, else "default"
    Deployment of a service: --generator-deployment / --gateway-deployment, else the one Deployment
            matching --selector plus app.kubernetes.io/component=<service> (deploy/k8s labels)
    PATCH .../deployments/<name>/scale {"spec": {"replicas": N}}  (merge patch)
    -> poll until each Deployment has observed the change, N replicas ready, and none of its pods
       is still terminating (removed pods drain on SIGTERM within terminationGracePeriodSeconds)

Scaling down is the Deployment controller's: it picks the pods to delete and sends them SIGTERM;
the services drain on it (a generator leaves routing first, a gateway finishes or releases its
tasks), so the wait for terminating pods is the wait for their drain.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.scale import SERVICES, ScaleError, ScaleResult

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

COMPONENT_LABEL = "app.kubernetes.io/component"
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
POLL_S = 1.0


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
        self.namespace = namespace or context_ns or "default"
        self.selector = selector or ""
        self.deployments = {s: (deployments or {}).get(s) or self._find(s) for s in SERVICES}

    def _call(self, what: str, fn: Callable[..., object], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``, its failures as ScaleError. The answer is read untyped: the client's
        generated models declare every field Optional, even the metadata and status the API server
        always fills in on the objects it returns."""
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, **kw)
        except ApiException as exc:
            raise ScaleError(
                f"Kubernetes API: {what} in namespace {self.namespace!r} failed "
                f"({exc.status} {exc.reason}): {(exc.body or '')[:300]}"
            ) from exc
        except OSError as exc:  # urllib3 connection errors are OSErrors
            raise ScaleError(f"Kubernetes API unreachable: {what}: {exc}") from exc

    def _find(self, service: str) -> str:
        labels = ",".join(x for x in (self.selector, f"{COMPONENT_LABEL}={service}") if x)
        found = self._call(
            f"listing Deployments with labels {labels}",
            self.apps.list_namespaced_deployment,
            self.namespace,
            label_selector=labels,
        ).items
        names: list[str] = sorted(d.metadata.name for d in found)
        if len(names) != 1:
            flag = "--generator-deployment" if service == "generator" else "--gateway-deployment"
            raise ScaleError(
                f"{len(names)} Deployments in namespace {self.namespace!r} match {labels}"
                f"{': ' + ', '.join(names) if names else ''}; name the {service} one with {flag}"
            )
        return names[0]

    def counts(self) -> dict[str, int]:
        return {s: self._read(s).status.ready_replicas or 0 for s in SERVICES}

    def _read(self, service: str) -> Any:  # a V1Deployment, read untyped as _call says
        name = self.deployments[service]
        return self._call(f"reading Deployment {name}", self.apps.read_namespaced_deployment, name, self.namespace)

    def scale(self, targets: dict[str, int], timeout_s: float) -> ScaleResult:
        before = self.counts()
        for service, n in targets.items():
            name = self.deployments[service]
            self._call(
                f"scaling Deployment {name}",
                self.apps.patch_namespaced_deployment_scale,
                name,
                self.namespace,
                {"spec": {"replicas": n}},
                _content_type="application/merge-patch+json",
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
        dep = self._read(service)
        st = dep.status
        ready, replicas = st.ready_replicas or 0, st.replicas or 0
        if (st.observed_generation or 0) < (dep.metadata.generation or 0):
            return False, "the controller has not seen the change yet"
        selector = ",".join(f"{k}={v}" for k, v in (dep.spec.selector.match_labels or {}).items())
        pods = self._call(
            f"listing pods of {dep.metadata.name}",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=selector,
        ).items
        terminating = sum(p.metadata.deletion_timestamp is not None for p in pods)
        if ready != n or replicas != n or terminating:
            return False, f"{ready} ready of {replicas} (want {n}), {terminating} pod(s) still draining"
        return True, ""
