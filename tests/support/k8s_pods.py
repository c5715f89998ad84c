"""deploy/k8s rendered, and each workload's pod templates as Kubernetes would start them.

`render` runs kubectl's kustomize on an overlay. `pod_templates` finds every pod template of the
rendered workloads (a Deployment's or Job's, each replicated job's of a JobSet, a LeaderWorkerSet's
leader and worker), with the environment its controller injects. `Pod` lays one out for the
service's own parsers: ``$(VAR)`` expanded, ConfigMap keys resolved, ConfigMap and Secret volumes
written as files under a temporary root.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.support.deploy import Launch, launch, unknown_env

SECRET, SECRET_KEYS = "streamrl-secrets", {"api-token", "redis-password"}
GPU = "nvidia.com/gpu"
NAMESPACE = "default"
FIELD_VALUES = {  # what the downward API gives a pod (addresses from the documentation range)
    "metadata.name": "pod-0",
    "status.podIP": "192.0.2.10",
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
}


def kubectl() -> str:
    exe = Path(sys.executable).parent / "kubectl"
    found = str(exe) if exe.is_file() else shutil.which("kubectl")
    assert found, "kubectl is missing: run scripts/k8s_tools.sh (scripts/test.sh does)"
    return found


def render(overlay: Path) -> list[dict]:
    proc = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise AssertionError(f"kustomize cannot render {overlay}: {proc.stderr.strip()}")
    return [o for o in yaml.safe_load_all(proc.stdout) if o]


def find(objs: list[dict], kind: str, name: str) -> dict | None:
    # kustomize appends a content hash to generated ConfigMaps and rewrites references to match.
    return next((o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name), None)


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


@dataclass
class Template:
    """One pod template of a rendered workload."""

    name: str  # the workload's name; "<name>-worker" for a LeaderWorkerSet's worker template
    owner: dict  # the rendered workload
    template: dict  # its PodTemplateSpec
    job: dict | None = None  # the JobSpec around it (Job, JobSet replicated job)
    first_pod: str = ""  # host name of the pod of index 0 (Job, JobSet)
    copies: int = 1  # Jobs made from the template (a JobSet replicated job's replicas)
    injected: dict[str, str] = field(default_factory=dict)  # env the controller adds first


def pod_templates(obj: dict) -> list[Template]:
    name, spec = obj["metadata"]["name"], obj.get("spec", {})
    if obj["kind"] == "Deployment":
        return [Template(name, obj, spec["template"])]
    if obj["kind"] == "Job":
        return [Template(name, obj, spec["template"], job=spec, first_pod=f"{name}-0")]
    if obj["kind"] == "JobSet":
        rjs = spec.get("replicatedJobs", [])
        return [
            Template(
                name if len(rjs) == 1 else f"{name}-{rj['name']}",
                obj,
                rj["template"]["spec"]["template"],
                job=rj["template"]["spec"],
                first_pod=f"{name}-{rj['name']}-0-0",  # <jobset>-<replicated job>-<job index>-<pod index>
                copies=int(rj.get("replicas", 1)),
            )
            for rj in rjs
        ]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        size = int(lwt.get("size", 1))

        def lws_env(index: int) -> dict[str, str]:  # injected by the LWS webhook, before the pod's own
            return {
                "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{NAMESPACE}",
                "LWS_GROUP_SIZE": str(size),
                "LWS_WORKER_INDEX": str(index),
            }

        out = [Template(name, obj, lwt.get("leaderTemplate", lwt["workerTemplate"]), injected=lws_env(0))]
        if size > 1:
            out.append(Template(f"{name}-worker", obj, lwt["workerTemplate"], injected=lws_env(1)))
        return out
    return []


class Pod:
    """One pod template as Kubernetes would start it, with its files laid out under a temporary
    root (ConfigMap and Secret volumes) so the service can load them."""

    def __init__(self, t: Template, objs: list[dict], tmp: Path):
        self.t, self.name = t, t.name
        self.spec = t.template["spec"]
        self.labels = t.template.get("metadata", {}).get("labels", {})
        self.container = self.spec["containers"][0]
        self.objs, self.tmp, self.problems = objs, tmp / self.name, []
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.world_size = 1
        self.env, self.referenced = self._environment(), set()
        self.paths = self._mount_files()
        self.argv = [
            self._localise(expand(a, self.env))
            for a in self.container.get("command", []) + self.container.get("args", [])
        ]
        for text in self.container.get("command", []) + [e.get("value", "") for e in self.container.get("env", [])]:
            self.referenced |= set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text))

    def _environment(self) -> dict[str, str]:
        env: dict[str, str] = dict(self.t.injected)
        for e in self.container.get("env", []):
            src = e.get("valueFrom", {})
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "fieldRef" in src:
                env[e["name"]] = FIELD_VALUES[src["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                cm = find(self.objs, "ConfigMap", ref["name"])
                if cm is None or ref["key"] not in cm.get("data", {}):
                    self.problems.append(f"{self.name}: env {e['name']} names ConfigMap key {ref} that is not rendered")
                env[e["name"]] = (cm or {}).get("data", {}).get(ref["key"], "")
            elif "secretKeyRef" in src:
                self.check_secret(src["secretKeyRef"]["name"], [src["secretKeyRef"]["key"]])
                env[e["name"]] = "secret-value"
        return env

    def check_secret(self, name: str, keys: list[str]) -> None:
        if name != SECRET or not set(keys) <= SECRET_KEYS:
            self.problems.append(
                f"{self.name}: secret {name} keys {keys}; docs/deploying.md documents {SECRET} {sorted(SECRET_KEYS)}"
            )

    def _mount_files(self) -> dict[str, Path]:
        """mountPath -> local folder holding the files a ConfigMap or Secret volume would show."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        paths = {}
        for m in self.container.get("volumeMounts", []):
            vol = volumes.get(m["name"])
            if vol is None:
                self.problems.append(f"{self.name}: mount {m['name']} has no volume")
                continue
            local = self.tmp / m["mountPath"].strip("/")
            if "configMap" in vol:
                cm = find(self.objs, "ConfigMap", vol["configMap"]["name"])
                if cm is None:
                    self.problems.append(f"{self.name}: ConfigMap {vol['configMap']['name']} is not rendered")
                    continue
                local.mkdir(parents=True, exist_ok=True)
                for key, text in cm.get("data", {}).items():
                    (local / key).write_text(text)
                paths[m["mountPath"]] = local
            elif "secret" in vol:
                items = vol["secret"].get("items", [])
                self.check_secret(vol["secret"]["secretName"], [i["key"] for i in items])
                local.mkdir(parents=True, exist_ok=True)
                for item in items:
                    (local / item["path"]).write_text("test-token-123\n")
                paths[m["mountPath"]] = local
            elif "persistentVolumeClaim" in vol and self.claim(vol) is None:
                self.problems.append(f"{self.name}: claim {vol['persistentVolumeClaim']['claimName']} is not rendered")
        return paths

    def claim(self, vol: dict) -> dict | None:
        return find(self.objs, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])

    def _localise(self, value: str) -> str:
        for mount, local in self.paths.items():
            if value.startswith(mount.rstrip("/") + "/"):
                return str(local / value[len(mount.rstrip("/")) + 1 :])
        return value

    def volume_at(self, path: str) -> dict | None:
        """The volume mounted where ``path`` lies (the deepest mount), or None."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        mounts = [
            m
            for m in self.container.get("volumeMounts", [])
            if (path.rstrip("/") + "/").startswith(m["mountPath"].rstrip("/") + "/")
        ]
        best = max(mounts, key=lambda m: len(m["mountPath"]), default=None)
        return volumes.get(best["name"]) if best else None

    def mounted_at(self, path: str, kind: str) -> bool:
        return kind in (self.volume_at(path) or {})

    def shared_at(self, path: str) -> bool:
        """Whether ``path`` is on a rendered ReadWriteMany claim (every node sees the same files)."""
        vol = self.volume_at(path) or {}
        pvc = self.claim(vol) if "persistentVolumeClaim" in vol else None
        return pvc is not None and "ReadWriteMany" in pvc["spec"].get("accessModes", [])

    def gpus(self) -> int:
        res = self.container.get("resources", {})
        limit = res.get("limits", {}).get(GPU, 0)
        request = res.get("requests", {}).get(GPU, limit)
        if int(limit) != int(request):
            self.problems.append(f"{self.name}: {GPU} request {request} != limit {limit}")
        return int(limit)

    def unknown_env(self) -> list[str]:
        """Variables of the pod's own env that nothing reads (the controller's are not the pod's)."""
        own = {k: v for k, v in self.env.items() if k not in self.t.injected}
        return [f"{self.name}: env {k} is read by no service" for k in unknown_env(own, self.referenced)]

    def run_service(self, argv: list[str]) -> Launch:
        env = {k: self._localise(v) for k, v in self.env.items()}
        run = launch(argv, env, cwd=self.tmp, where=self.name)
        self.problems += run.problems + self.unknown_env()
        return run
