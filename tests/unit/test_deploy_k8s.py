"""deploy/k8s, validated offline: kubectl's kustomize renders every overlay, kubernetes-validate checks
each object strictly against the Kubernetes schemas, and every container's command is parsed by the
real parser of what it runs (torchrun's, then the service's) with its config loaded from the
rendered ConfigMap and the environment Kubernetes would give it ($(VAR) expanded, ConfigMap keys
resolved, secrets as files). The sizes must fit the run config: GPUs per generator = vLLM tensor
parallel size, trainer pods = torchrun nodes, GPUs per trainer pod = ranks per node, ranks divisible
by the Megatron layout. A broken copy fails."""

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.deploy import ROOT, Launch, launch, unknown_env

pytestmark = pytest.mark.unit
K8S_VERSION = "1.32.0"
OVERLAYS = sorted(p.parent.name for p in (ROOT / "deploy/k8s/overlays").glob("*/kustomization.yaml"))
SECRET, SECRET_KEYS = "streamrl-secrets", {"api-token", "redis-password"}
GPU = "nvidia.com/gpu"
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


def schema_problems(objs: list[dict]) -> list[str]:
    problems = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            problems.append(f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: {str(exc)[:300]}")
    return problems


def _find(objs: list[dict], kind: str, name: str) -> dict | None:
    # kustomize appends a content hash to generated ConfigMaps and rewrites references to match.
    return next((o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name), None)


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


class Pod:
    """One workload's pod template as Kubernetes would start it, with its files laid out under a
    temporary root (ConfigMap and Secret volumes) so the service can load them."""

    def __init__(self, workload: dict, objs: list[dict], tmp: Path):
        self.name = workload["metadata"]["name"]
        self.spec = workload["spec"]["template"]["spec"]
        self.labels = workload["spec"]["template"]["metadata"]["labels"]
        self.container = self.spec["containers"][0]
        self.objs, self.tmp, self.problems = objs, tmp / self.name, []
        self.env, self.referenced = self._environment(), set()
        self.paths = self._mount_files()
        self.argv = [
            self._localise(_expand(a, self.env))
            for a in self.container.get("command", []) + self.container.get("args", [])
        ]
        for text in self.container.get("command", []) + [e.get("value", "") for e in self.container.get("env", [])]:
            self.referenced |= set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text))

    def _environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in self.container.get("env", []):
            src = e.get("valueFrom", {})
            if "value" in e:
                env[e["name"]] = _expand(e["value"], env)
            elif "fieldRef" in src:
                env[e["name"]] = FIELD_VALUES[src["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                cm = _find(self.objs, "ConfigMap", ref["name"])
                if cm is None or ref["key"] not in cm.get("data", {}):
                    self.problems.append(f"{self.name}: env {e['name']} names ConfigMap key {ref} that is not rendered")
                env[e["name"]] = (cm or {}).get("data", {}).get(ref["key"], "")
            elif "secretKeyRef" in src:
                self._check_secret(src["secretKeyRef"]["name"], [src["secretKeyRef"]["key"]])
                env[e["name"]] = "secret-value"
        return env

    def _check_secret(self, name: str, keys: list[str]) -> None:
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
                cm = _find(self.objs, "ConfigMap", vol["configMap"]["name"])
                if cm is None:
                    self.problems.append(f"{self.name}: ConfigMap {vol['configMap']['name']} is not rendered")
                    continue
                local.mkdir(parents=True, exist_ok=True)
                for key, text in cm.get("data", {}).items():
                    (local / key).write_text(text)
                paths[m["mountPath"]] = local
            elif "secret" in vol:
                items = vol["secret"].get("items", [])
                self._check_secret(vol["secret"]["secretName"], [i["key"] for i in items])
                local.mkdir(parents=True, exist_ok=True)
                for item in items:
                    (local / item["path"]).write_text("test-token-123\n")
                paths[m["mountPath"]] = local
            elif (
                "persistentVolumeClaim" in vol
                and _find(self.objs, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) is None
            ):
                self.problems.append(f"{self.name}: claim {vol['persistentVolumeClaim']['claimName']} is not rendered")
        return paths

    def _localise(self, value: str) -> str:
        for mount, local in self.paths.items():
            if value.startswith(mount.rstrip("/") + "/"):
                return str(local / value[len(mount.rstrip("/")) + 1 :])
        return value

    def mounted_at(self, path: str, kind: str) -> bool:
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        return any(
            kind in volumes.get(m["name"], {}) and (path + "/").startswith(m["mountPath"].rstrip("/") + "/")
            for m in self.container.get("volumeMounts", [])
        )

    def gpus(self) -> int:
        res = self.container.get("resources", {})
        limit = res.get("limits", {}).get(GPU, 0)
        request = res.get("requests", {}).get(GPU, limit)
        if int(limit) != int(request):
            self.problems.append(f"{self.name}: {GPU} request {request} != limit {limit}")
        return int(limit)

    def run_service(self, argv: list[str]) -> Launch:
        env = {k: self._localise(v) for k, v in self.env.items()}
        run = launch(argv, env, cwd=self.tmp, where=self.name)
        self.problems += run.problems
        self.problems += [f"{self.name}: env {k} is read by no service" for k in unknown_env(env, self.referenced)]
        return run


def _torchrun(pod: Pod, job: dict, objs: list[dict]) -> list[str]:
    """Parse the trainer's torchrun line with torchrun's parser; return the service's argv."""
    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            a = get_args_parser().parse_args(pod.argv[1:])
    except SystemExit:
        pod.problems.append(f"{pod.name}: torchrun rejects {pod.argv[1:]}: {err.getvalue().strip().splitlines()[-1]}")
        return []
    nodes, per_node = int(a.nnodes), int(a.nproc_per_node)
    if not (
        job["spec"].get("completionMode") == "Indexed"
        and job["spec"]["completions"] == job["spec"]["parallelism"] == nodes
    ):
        pod.problems.append(f"{pod.name}: an Indexed Job of {nodes} pods is needed for --nnodes={nodes}")
    if pod.gpus() != per_node:
        pod.problems.append(f"{pod.name}: {pod.gpus()} GPUs per pod but --nproc-per-node={per_node}")
    rank_src = next(
        (
            e
            for e in pod.container["env"]
            if f"$({e['name']})" in " ".join(pod.container["command"])
            and "--node-rank" in " ".join(pod.container["command"])
            and "job-completion-index" in str(e.get("valueFrom", ""))
        ),
        None,
    )
    if rank_src is None:
        pod.problems.append(f"{pod.name}: --node-rank does not come from the Job's completion index")
    host, _, sub = a.master_addr.partition(".")
    rdzv = _find(objs, "Service", sub)
    if (
        host != f"{job['metadata']['name']}-0"
        or pod.spec.get("subdomain") != sub
        or rdzv is None
        or rdzv["spec"].get("clusterIP") != "None"
    ):
        pod.problems.append(f"{pod.name}: --master-addr {a.master_addr} is not rank 0 behind a headless Service")
    pod.world_size = nodes * per_node
    return ["python", "-m", a.training_script, *a.training_script_args] if a.module else []


def _workload_problems(w: dict, objs: list[dict], tmp: Path) -> tuple[Pod, Launch | None]:
    pod = Pod(w, objs, tmp)
    argv = _torchrun(pod, w, objs) if pod.argv[:1] == ["torchrun"] else pod.argv
    if not argv:
        return pod, None
    run = pod.run_service(argv)
    if run.cfg is None:
        return pod, run
    cfg, c = run.cfg, pod.container
    http = next((p for p in c.get("ports", []) if p.get("name") == "http"), {})
    if http.get("containerPort") != run.port:
        pod.problems.append(f"{pod.name}: containerPort {http.get('containerPort')} but the service binds {run.port}")
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        got = c.get(probe, {}).get("httpGet", {})
        if (got.get("path"), got.get("port")) != (path, "http") and not (
            probe == "livenessProbe" and run.service == "trainer"
        ):
            pod.problems.append(f"{pod.name}: {probe} is {got}, expected {path} on port http")
    if run.service in ("generator", "gym_gateway") and run.host != FIELD_VALUES["status.podIP"]:
        pod.problems.append(f"{pod.name}: {run.service}.host is {run.host!r}; it must register the pod IP")
    for key, path in (
        ("run.output_dir", cfg.run.output_dir),
        ("data.train_path", cfg.data.train_path),
        ("policy.model_name", cfg.policy.model_name),
    ):
        if not pod.mounted_at(path, "persistentVolumeClaim"):
            pod.problems.append(f"{pod.name}: {key} {path!r} is not on the shared volume")
    if run.service == "generator" and pod.gpus() != cfg.policy.generation.vllm_cfg.devices_per_engine():
        pod.problems.append(
            f"{pod.name}: {pod.gpus()} GPUs but the engine spans {cfg.policy.generation.vllm_cfg.devices_per_engine()} "
            "(vllm_cfg tensor_parallel_size x pipeline and data parallel sizes)"
        )
    if run.service == "trainer":
        m, world = cfg.policy.megatron_cfg, getattr(pod, "world_size", 1)
        tp, pp, ep = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size
        if cfg.trainer.backend == "megatron" and (world % (tp * pp) or (world // pp) % ep):
            pod.problems.append(f"{pod.name}: {world} ranks do not fit TP{tp} x PP{pp} with EP{ep}")
        svc = _find(objs, "Service", "trainer")
        sel = (svc or {}).get("spec", {}).get("selector", {})
        if (
            not svc
            or sel.get("batch.kubernetes.io/job-completion-index") != "0"
            or any(pod.labels.get(k) != v for k, v in sel.items() if not k.startswith("batch."))
        ):
            pod.problems.append(f"{pod.name}: Service trainer does not select the rank-0 pod")
    return pod, run


def k8s_problems(overlay: Path, tmp: Path) -> tuple[list[str], dict[str, tuple[Pod, Launch | None]]]:
    try:
        objs = render(overlay)
    except AssertionError as exc:
        return [str(exc)], {}
    problems = schema_problems(objs)
    if any(o["kind"] == "Secret" for o in objs):
        problems.append("a Secret is rendered: secrets are created outside the manifests")
    pods = {}
    for w in (o for o in objs if o["kind"] in ("Deployment", "Job")):
        pod, run = _workload_problems(w, objs, tmp)
        pods[pod.name] = (pod, run)
        problems += pod.problems
    if set(pods) != {"generator", "gym-gateway", "trainer"}:
        problems.append(f"workloads are {sorted(pods)}")
    return problems, pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_validates_and_every_container_is_accepted(overlay, tmp_path):
    problems, pods = k8s_problems(ROOT / "deploy/k8s/overlays" / overlay, tmp_path)
    assert problems == []
    assert all(run is not None and run.cfg is not None for _, run in pods.values())


def test_multi_node_overlay_has_the_reference_sizes(tmp_path):
    problems, pods = k8s_problems(ROOT / "deploy/k8s/overlays/multi-node", tmp_path)
    assert problems == []
    gen, trainer = pods["generator"][0], pods["trainer"][0]
    generators = _find(render(ROOT / "deploy/k8s/overlays/multi-node"), "Deployment", "generator")
    assert generators["spec"]["replicas"] * gen.gpus() == 24 * 8
    assert trainer.world_size == 64 and trainer.gpus() == 4
    recipe = ROOT / "deploy/configs/recipes/qwen3_5_397b_a17b_64gpu.yaml"
    assert (trainer.paths["/etc/streamrl"] / "run.yaml").read_text() == recipe.read_text()


def _broken_tree(tmp: Path, rel: str, old: str, new: str) -> Path:
    """A copy of deploy/k8s and deploy/configs with one edit; returns the copy's overlays folder."""
    for part in ("deploy/k8s", "deploy/configs"):
        shutil.copytree(ROOT / part, tmp / part)
    f = tmp / rel
    assert f.read_text().count(old) == 1, f"mutation anchor {old!r} not found once in {rel}"
    f.write_text(f.read_text().replace(old, new))
    return tmp / "deploy/k8s/overlays"


BROKEN = [
    (
        "deploy/k8s/base/generator.yaml",
        "  replicas: 1\n",
        "  replicas: one\n",
        "single-node",
        "is not of type 'integer'",
    ),
    (
        "deploy/k8s/base/gym-gateway.yaml",
        "    app.kubernetes.io/component: gym-gateway\nspec:\n",
        "    app.kubernetes.io/component: gym-gateway\nspec:\n  replica: 2\n",
        "single-node",
        "Additional properties",
    ),
    ("deploy/k8s/base/kustomization.yaml", "  - trainer.yaml\n", "  - trainers.yaml\n", "single-node", "cannot render"),
    (
        "deploy/k8s/base/generator.yaml",
        "httpGet: {path: /ready, port: http}\n            periodSeconds: 5\n            failureThreshold",
        "httpGet: {path: /readyz, port: http}\n            periodSeconds: 5\n            failureThreshold",
        "single-node",
        "readinessProbe",
    ),
    ("deploy/k8s/base/trainer.yaml", '"--nnodes=$(NNODES)"', '"--nodes=$(NNODES)"', "single-node", "torchrun rejects"),
    (
        "deploy/k8s/base/gym-gateway.yaml",
        '"--worker-id", "$(POD_NAME)", "gym_gateway',
        '"--workerid", "$(POD_NAME)", "gym_gateway',
        "single-node",
        "gym_gateway rejects",
    ),
    (
        "deploy/k8s/base/generator.yaml",
        '"generator.host=$(POD_IP)"',
        '"generator.hots=$(POD_IP)"',
        "single-node",
        "generator.hots",
    ),
    (
        "deploy/k8s/base/trainer.yaml",
        "              value: /var/run/secrets/streamrl/api-token\n"
        "          ports:\n            - {name: http, containerPort: 8300}",
        "              value: /var/run/secrets/streamrl/token\n"
        "          ports:\n            - {name: http, containerPort: 8300}",
        "single-node",
        "cannot read",
    ),
    ("deploy/configs/k8s/single_node.yaml", "  port: 8100\n", "  port: 8101\n", "single-node", "containerPort 8100"),
    (
        "deploy/configs/k8s/single_node.yaml",
        "  output_dir: /data/runs/single-node\n",
        "  output_dir: /scratch/run\n",
        "single-node",
        "not on the shared volume",
    ),
    ("deploy/k8s/overlays/multi-node/trainer.yaml", 'value: "4"', 'value: "8"', "multi-node", "--nproc-per-node=8"),
    (
        "deploy/k8s/overlays/multi-node/generator.yaml",
        "nvidia.com/gpu: 8}\n            limits: {nvidia.com/gpu: 8}",
        "nvidia.com/gpu: 4}\n            limits: {nvidia.com/gpu: 4}",
        "multi-node",
        "the engine spans 8",
    ),
    (
        "deploy/configs/recipes/qwen3_5_397b_a17b_64gpu.yaml",
        "expert_model_parallel_size: 32",
        "expert_model_parallel_size: 48",
        "multi-node",
        "do not fit",
    ),
    ("deploy/k8s/base/trainer.yaml", "  completions: 1\n", "  completions: 2\n", "single-node", "Indexed Job"),
]


@pytest.mark.parametrize("rel,old,new,overlay,expected", BROKEN, ids=[b[4][:28] for b in BROKEN])
def test_a_broken_manifest_fails(tmp_path, rel, old, new, overlay, expected):
    overlays = _broken_tree(tmp_path / "tree", rel, old, new)
    problems, _ = k8s_problems(overlays / overlay, tmp_path / "pods")
    assert any(expected in p for p in problems), problems


def test_kubectl_is_the_pinned_one_or_on_path():
    out = subprocess.run([kubectl(), "version", "--client"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "Kustomize Version" in out.stdout, out.stderr
    assert os.access(kubectl(), os.X_OK)
