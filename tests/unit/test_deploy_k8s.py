"""deploy/k8s, validated offline: kubectl's kustomize renders every overlay; every object is checked
strictly against its schema (core kinds by kubernetes-validate, the JobSet, LeaderWorkerSet and KEDA
objects against their CRDs' published schemas in deploy/k8s/crds, and the pod and job templates
they embed as core objects: tests/support/k8s_schemas.py); and every container's command is parsed
by the real parser of what it runs (torchrun's, the service's, vLLM's for an engine worker) with its
config loaded from the rendered ConfigMap and the environment Kubernetes and the controller would
give it ($(VAR) expanded, ConfigMap keys resolved, secrets as files). The sizes must fit the run
config: GPUs per engine = vLLM's parallel sizes over the engine's nodes, trainer pods = torchrun
nodes, GPUs per trainer pod = ranks per node, ranks divisible by the Megatron layout; an engine
worker's arguments equal the generator's; KEDA's trigger reads the run's tasks stream and consumer
group at the run's Redis. A broken copy fails."""

import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from shared.keys import GATEWAYS_GROUP, RunKeys
from tests.support.deploy import ROOT, Launch, engine_worker
from tests.support.k8s_pods import FIELD_VALUES, SECRET, Pod, find, kubectl, pod_templates, render
from tests.support.k8s_schemas import schema_problems

pytestmark = pytest.mark.unit
OVERLAYS = sorted(p.parent.name for p in (ROOT / "deploy/k8s/overlays").glob("*/kustomization.yaml"))
WORKLOADS = ("Deployment", "Job", "JobSet", "LeaderWorkerSet")
POD_IP = FIELD_VALUES["status.podIP"]


def _rendezvous_service(pod: Pod, objs: list[dict]) -> tuple[str | None, bool]:
    """(subdomain of the trainer's pods, whether a headless Service answers for it)."""
    owner = pod.t.owner
    if owner["kind"] == "JobSet":  # the JobSet controller creates the headless Service
        net = owner["spec"].get("network", {})
        if not net.get("enableDNSHostnames"):
            return None, False
        return net.get("subdomain") or owner["metadata"]["name"], net.get("publishNotReadyAddresses", True)
    sub = pod.spec.get("subdomain")
    svc = find(objs, "Service", sub or "")
    return sub, svc is not None and svc["spec"].get("clusterIP") == "None"


def _torchrun(pod: Pod, objs: list[dict]) -> list[str]:
    """Parse the trainer's torchrun line with torchrun's parser; return the service's argv."""
    import contextlib
    import io

    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            a = get_args_parser().parse_args(pod.argv[1:])
    except SystemExit:
        pod.problems.append(f"{pod.name}: torchrun rejects {pod.argv[1:]}: {err.getvalue().strip().splitlines()[-1]}")
        return []
    nodes, per_node, job = int(a.nnodes), int(a.nproc_per_node), pod.t.job or {}
    if (
        not (job.get("completionMode") == "Indexed" and job.get("completions") == job.get("parallelism") == nodes)
        or pod.t.copies != 1
    ):
        pod.problems.append(f"{pod.name}: an Indexed Job of {nodes} pods is needed for --nnodes={nodes}")
    if pod.gpus() != per_node:
        pod.problems.append(f"{pod.name}: {pod.gpus()} GPUs per pod but --nproc-per-node={per_node}")
    sub, headless = _rendezvous_service(pod, objs)
    if a.rdzv_backend == "c10d":
        host, _, port = a.rdzv_endpoint.rpartition(":")
        first, _, domain = host.partition(".")
        rdzv = next((p for p in pod.container.get("ports", []) if p.get("name") == "rendezvous"), {})
        if first != pod.t.first_pod or domain != sub or not headless or str(rdzv.get("containerPort")) != port:
            pod.problems.append(
                f"{pod.name}: --rdzv-endpoint {a.rdzv_endpoint} is not the rendezvous port of the first pod "
                f"({pod.t.first_pod}.{sub}) behind a headless Service"
            )
        waits = [c for c in pod.spec.get("initContainers", []) if host in c.get("command", []) + c.get("args", [])]
        if not waits:  # the first pod hosts the c10d store only once its own name resolves to it
            pod.problems.append(f"{pod.name}: no init container waits until {host} resolves")
        if int(a.max_restarts) != 0:
            pod.problems.append(f"{pod.name}: --max-restarts={a.max_restarts}: a rank that dies must end the trainer")
    else:
        uses_index = any(
            f"$({e['name']})" in " ".join(pod.container["command"])
            and "--node-rank" in " ".join(pod.container["command"])
            and "job-completion-index" in str(e.get("valueFrom", ""))
            for e in pod.container["env"]
        )
        if not uses_index:
            pod.problems.append(f"{pod.name}: --node-rank does not come from the Job's completion index")
        host, _, domain = a.master_addr.partition(".")
        if host != pod.t.first_pod or domain != sub or not headless:
            pod.problems.append(f"{pod.name}: --master-addr {a.master_addr} is not rank 0 behind a headless Service")
    if nodes > 1 and not (
        pod.t.owner["kind"] == "JobSet"
        and job.get("backoffLimit") == 0
        and pod.t.owner["spec"].get("failurePolicy", {}).get("maxRestarts", 0) >= 1
    ):
        pod.problems.append(
            f"{pod.name}: {nodes} nodes must restart together: a JobSet whose Job has backoffLimit 0 "
            "and whose failurePolicy has maxRestarts >= 1"
        )
    pod.world_size = nodes * per_node
    return ["python", "-m", a.training_script, *a.training_script_args] if a.module else []


def _engine_problems(pod: Pod, run: Launch) -> None:
    """A generator's engine: its GPUs and, across nodes, its LeaderWorkerSet group."""
    assert run.cfg is not None
    v = run.cfg.policy.generation.vllm_cfg
    nnodes, group = int(v.vllm_kwargs.get("nnodes", 1)), int(pod.t.injected.get("LWS_GROUP_SIZE", 1))
    if pod.gpus() * nnodes != v.devices_per_engine():
        pod.problems.append(
            f"{pod.name}: {pod.gpus()} GPUs x {nnodes} node(s) but the engine spans {v.devices_per_engine()} "
            "(vllm_cfg tensor_parallel_size x pipeline and data parallel sizes)"
        )
    if nnodes != group:
        pod.problems.append(f"{pod.name}: vllm_kwargs.nnodes is {nnodes} but the engine's group has {group} pod(s)")
    if nnodes > 1:
        kw, lwt = v.vllm_kwargs, pod.t.owner["spec"]["leaderWorkerTemplate"]
        if kw.get("node_rank", 0) != 0 or kw.get("master_addr") != pod.env.get("LWS_LEADER_ADDRESS"):
            pod.problems.append(f"{pod.name}: the generator must be node rank 0 with master_addr = LWS_LEADER_ADDRESS")
        if pod.env.get("VLLM_HOST_IP") != POD_IP:
            pod.problems.append(f"{pod.name}: VLLM_HOST_IP is not the pod IP: the engine's peers cannot reach loopback")
        if lwt.get("restartPolicy", "RecreateGroupOnPodRestart") != "RecreateGroupOnPodRestart":
            pod.problems.append(f"{pod.name}: restartPolicy {lwt['restartPolicy']}: an engine cannot lose one node")


def _engine_worker(pod: Pod, leader: tuple[Pod, Launch | None] | None) -> None:
    """A LeaderWorkerSet's worker: vLLM's headless worker joining its leader's engine."""
    if leader is None or leader[1] is None or leader[1].cfg is None:
        pod.problems.append(f"{pod.name}: no generator leader whose config the engine worker could match")
        return
    lead, run = leader
    env = {k: pod._localise(v) for k, v in pod.env.items()}
    w = engine_worker(pod.argv, env, run.cfg, where=pod.name)
    pod.problems += w.problems + pod.unknown_env()
    if not w.args:
        return
    kw = run.cfg.policy.generation.vllm_cfg.vllm_kwargs
    if not w.args["headless"] or w.args["nnodes"] != int(pod.env["LWS_GROUP_SIZE"]):
        pod.problems.append(f"{pod.name}: a worker runs `vllm serve --headless --nnodes=$(LWS_GROUP_SIZE)`")
    if "LWS_WORKER_INDEX" not in pod.referenced or w.args["node_rank"] != int(pod.env["LWS_WORKER_INDEX"]):
        pod.problems.append(f"{pod.name}: --node-rank must be $(LWS_WORKER_INDEX)")
    if (w.args["master_addr"], w.args["master_port"]) != (kw.get("master_addr"), kw.get("master_port")):
        pod.problems.append(f"{pod.name}: --master-addr/--master-port differ from the leader's vllm_kwargs")
    pod.problems += [f"{pod.name}: engine argument {n}: generator {a}, worker {b}" for n, a, b in w.differ]
    if pod.gpus() != lead.gpus():
        pod.problems.append(f"{pod.name}: {pod.gpus()} GPUs but the leader has {lead.gpus()}")
    if pod.env.get("VLLM_HOST_IP") != POD_IP:
        pod.problems.append(f"{pod.name}: VLLM_HOST_IP is not the pod IP: the leader cannot reach loopback")
    if not pod.shared_at(w.args["model"]):
        pod.problems.append(f"{pod.name}: the model {w.args['model']!r} is not on the shared volume")


def _workload_problems(pod: Pod, objs: list[dict], done: dict) -> Launch | None:
    argv = pod.argv
    if argv[:1] == ["torchrun"]:
        argv = _torchrun(pod, objs)
    elif argv[:2] == ["vllm", "serve"]:
        _engine_worker(pod, done.get(pod.t.owner["metadata"]["name"]))
        return None
    if not argv:
        return None
    run = pod.run_service(argv)
    if run.cfg is None:
        return run
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
    if run.service in ("generator", "gym_gateway") and run.host != POD_IP:
        pod.problems.append(f"{pod.name}: {run.service}.host is {run.host!r}; it must register the pod IP")
    for key, path in (
        ("run.output_dir", cfg.run.output_dir),
        ("data.train_path", cfg.data.train_path),
        ("policy.model_name", cfg.policy.model_name),
    ):
        if not pod.mounted_at(path, "persistentVolumeClaim"):
            pod.problems.append(f"{pod.name}: {key} {path!r} is not on the shared volume")
    if run.service == "generator":
        _engine_problems(pod, run)
    if run.service == "trainer":
        m, world = cfg.policy.megatron_cfg, pod.world_size
        tp, pp, ep = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size
        if cfg.trainer.backend == "megatron" and (world % (tp * pp) or (world // pp) % ep):
            pod.problems.append(f"{pod.name}: {world} ranks do not fit TP{tp} x PP{pp} with EP{ep}")
        ckpt = cfg.checkpointing.checkpoint_dir or f"{cfg.run.output_dir}/checkpoints"
        if not pod.shared_at(ckpt):
            pod.problems.append(f"{pod.name}: checkpoints {ckpt!r} are not on a ReadWriteMany volume every node sees")
        svc = find(objs, "Service", "trainer")
        sel = (svc or {}).get("spec", {}).get("selector", {})
        if (
            not svc
            or sel.get("batch.kubernetes.io/job-completion-index") != "0"
            or any(pod.labels.get(k) != v for k, v in sel.items() if not k.startswith("batch."))
        ):
            pod.problems.append(f"{pod.name}: Service trainer does not select the rank-0 pod")
    return run


def _trigger_params(objs: list[dict], trigger: dict, pod: Pod, where: str) -> tuple[dict, list[str]]:
    """A KEDA trigger's connection parameters (metadata, then its TriggerAuthentication) as values;
    a secret as ("secret", name, key)."""
    params: dict = {k: v for k, v in trigger.get("metadata", {}).items() if k in ("address", "host", "port")}
    ref, problems = trigger.get("authenticationRef"), []
    auth = find(objs, ref.get("kind", "TriggerAuthentication"), ref["name"]) if ref else None
    if ref and auth is None:
        problems.append(f"{where}: authenticationRef {ref} is not rendered")
    spec = (auth or {}).get("spec", {})
    for s in spec.get("secretTargetRef", []):
        params[s["parameter"]] = ("secret", s["name"], s["key"])
    for c in spec.get("configMapTargetRef", []):
        cm = find(objs, "ConfigMap", c["name"])
        if cm is None or c["key"] not in cm.get("data", {}):
            problems.append(f"{where}: ConfigMap key {c['name']}/{c['key']} is not rendered")
        params[c["parameter"]] = (cm or {}).get("data", {}).get(c["key"])
    for e in spec.get("env", []):
        params[e["parameter"]] = pod.env.get(e["name"])
    return params, problems


def _autoscaling_problems(objs: list[dict], pods: dict[str, tuple[Pod, Launch | None]]) -> list[str]:
    problems = []
    for so in (o for o in objs if o["kind"] == "ScaledObject"):
        where, spec = f"ScaledObject/{so['metadata']['name']}", so["spec"]
        ref = spec["scaleTargetRef"]
        target = find(objs, ref.get("kind", "Deployment"), ref["name"])
        pod, run = pods.get(ref["name"], (None, None))
        if target is None or ref.get("apiVersion", "apps/v1") != target["apiVersion"] or pod is None or run is None:
            problems.append(f"{where}: scaleTargetRef {ref} is not a rendered workload")
            continue
        if run.service != "gym_gateway" or run.cfg is None:
            problems.append(f"{where}: scales {ref['name']}, not the gym-gateway workers")
            continue
        low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
        if not low <= target["spec"].get("replicas", 1) <= high:
            problems.append(f"{where}: {ref['name']} starts outside [{low}, {high}] replicas")
        triggers = spec.get("triggers", [])
        if [t["type"] for t in triggers] != ["redis-streams"]:
            problems.append(f"{where}: triggers {[t['type'] for t in triggers]}, expected one redis-streams")
            continue
        md, tasks = triggers[0].get("metadata", {}), RunKeys(run.cfg.run.run_id).tasks
        if md.get("stream") != tasks:
            problems.append(f"{where}: stream {md.get('stream')!r} is not the run's tasks stream {tasks!r}")
        if md.get("consumerGroup") != GATEWAYS_GROUP:
            problems.append(f"{where}: consumerGroup {md.get('consumerGroup')!r}, the gateways read {GATEWAYS_GROUP!r}")
        if not str(md.get("lagCount", "")).isdigit() or int(md["lagCount"]) < 1:
            problems.append(f"{where}: lagCount {md.get('lagCount')!r}: the lag mode needs a positive target")
        url = urlsplit(pod.env.get("REDIS_URL", ""))
        if md.get("databaseIndex", "0") != (url.path.strip("/") or "0"):
            problems.append(f"{where}: databaseIndex {md.get('databaseIndex')!r} but the workers use {url.path!r}")
        params, missing = _trigger_params(objs, triggers[0], pod, where)
        problems += missing
        if params.get("address") != url.netloc.rpartition("@")[2]:
            problems.append(f"{where}: Redis address {params.get('address')!r} is not the workers' {url.netloc!r}")
        if params.get("password") != ("secret", SECRET, "redis-password"):
            problems.append(f"{where}: password {params.get('password')} is not {SECRET}/redis-password")
    return problems


def k8s_problems(overlay: Path, tmp: Path) -> tuple[list[str], dict[str, tuple[Pod, Launch | None]]]:
    try:
        objs = render(overlay)
    except AssertionError as exc:
        return [str(exc)], {}
    problems = schema_problems(objs)
    if any(o["kind"] == "Secret" for o in objs):
        problems.append("a Secret is rendered: secrets are created outside the manifests")
    pods: dict[str, tuple[Pod, Launch | None]] = {}
    for w in (o for o in objs if o["kind"] in WORKLOADS):
        for t in pod_templates(w):
            pod = Pod(t, objs, tmp)
            run = _workload_problems(pod, objs, pods)
            pods[pod.name] = (pod, run)
            problems += pod.problems
    if {n for n in pods if not n.endswith("-worker")} != {"generator", "gym-gateway", "trainer"}:
        problems.append(f"workloads are {sorted(pods)}")
    images = {c.get("image") for p, _ in pods.values() for c in p.spec["containers"] + p.spec.get("initContainers", [])}
    if len(images) > 1:
        problems.append(f"the containers run different images: {sorted(map(str, images))}")
    return problems + _autoscaling_problems(objs, pods), pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_validates_and_every_container_is_accepted(overlay, tmp_path):
    problems, pods = k8s_problems(ROOT / "deploy/k8s/overlays" / overlay, tmp_path)
    assert problems == []
    assert all(run is not None and run.cfg is not None for name, (_, run) in pods.items() if name != "generator-worker")


def test_multi_node_overlay_has_the_reference_sizes(tmp_path):
    problems, pods = k8s_problems(ROOT / "deploy/k8s/overlays/multi-node", tmp_path)
    assert problems == []
    objs = render(ROOT / "deploy/k8s/overlays/multi-node")
    lws, leader, worker = find(objs, "LeaderWorkerSet", "generator"), pods["generator"][0], pods["generator-worker"][0]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert size == 2 and leader.gpus() == worker.gpus() == 4  # an 8-GPU engine on two 4-GPU nodes
    assert lws["spec"]["replicas"] * size * leader.gpus() == 24 * 8
    trainer, jobset = pods["trainer"][0], find(objs, "JobSet", "trainer")
    assert trainer.world_size == 64 and trainer.gpus() == 4 and trainer.t.job["parallelism"] == 16
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    so, cfg = find(objs, "ScaledObject", "gym-gateway"), pods["gym-gateway"][1].cfg
    g, slots = cfg.grpo, cfg.gym_gateway.max_concurrent_rollouts
    in_flight = g.num_prompts_per_step * g.num_generations_per_prompt * (g.async_grpo.max_trajectory_age_steps + 1)
    assert so["spec"]["minReplicaCount"] * slots == in_flight == 512 and so["spec"]["maxReplicaCount"] == 16
    assert so["spec"]["triggers"][0]["metadata"]["lagCount"] == str(slots)
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


BASE, MN = "deploy/k8s/base/", "deploy/k8s/overlays/multi-node/"
LEADER_GPUS = (  # the leader's resources (the worker's are the same, after other lines)
    "failureThreshold: 180\n            resources:\n"
    '              requests: {cpu: "64", memory: 800Gi, nvidia.com/gpu: 4}\n'
    "              limits: {nvidia.com/gpu: 4}"
)
BROKEN = [
    (BASE + "generator.yaml", "  replicas: 1\n", "  replicas: one\n", "single-node", "is not of type 'integer'"),
    (
        BASE + "gym-gateway.yaml",
        "    app.kubernetes.io/component: gym-gateway\nspec:\n",
        "    app.kubernetes.io/component: gym-gateway\nspec:\n  replica: 2\n",
        "single-node",
        "Additional properties",
    ),
    (BASE + "kustomization.yaml", "  - trainer.yaml\n", "  - trainers.yaml\n", "single-node", "cannot render"),
    (
        BASE + "generator.yaml",
        "httpGet: {path: /ready, port: http}\n            periodSeconds: 5\n            failureThreshold",
        "httpGet: {path: /readyz, port: http}\n            periodSeconds: 5\n            failureThreshold",
        "single-node",
        "readinessProbe",
    ),
    (BASE + "trainer.yaml", '"--nnodes=$(NNODES)"', '"--nodes=$(NNODES)"', "single-node", "torchrun rejects"),
    (
        BASE + "gym-gateway.yaml",
        '"--worker-id", "$(POD_NAME)", "gym_gateway',
        '"--workerid", "$(POD_NAME)", "gym_gateway',
        "single-node",
        "gym_gateway rejects",
    ),
    (BASE + "generator.yaml", '"generator.host=$(POD_IP)"', '"generator.hots=$(POD_IP)"', "single-node", "hots"),
    (
        BASE + "trainer.yaml",
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
    (BASE + "trainer.yaml", "  completions: 1\n", "  completions: 2\n", "single-node", "Indexed Job"),
    (BASE + "kustomization.yaml", "      - db=0 ", "      - db=1 ", "multi-node", "databaseIndex '0'"),
    (MN + "trainer.yaml", 'value: "4"', 'value: "8"', "multi-node", "--nproc-per-node=8"),
    (MN + "trainer.yaml", "completions: 16\n", "completions: 12\n", "multi-node", "Indexed Job of 16 pods"),
    (
        MN + "trainer.yaml",
        "--rdzv-endpoint=trainer-node-0-0.",
        "--rdzv-endpoint=trainer-node-0-1.",
        "multi-node",
        "first pod",
    ),
    (MN + "trainer.yaml", '"trainer-node-0-0.trainer-rdzv"]', '"trainer-node-0-0"]', "multi-node", "init container"),
    (MN + "trainer.yaml", "enableDNSHostnames: true", "enableDNSHostnames: false", "multi-node", "headless"),
    (MN + "trainer.yaml", "backoffLimit: 0 ", "backoffLimit: 3 ", "multi-node", "restart together"),
    (MN + "trainer.yaml", "  network:\n", "  networks:\n", "multi-node", "'networks' was unexpected"),
    (
        "deploy/configs/recipes/qwen3_5_397b_a17b_64gpu.yaml",
        "expert_model_parallel_size: 32",
        "expert_model_parallel_size: 48",
        "multi-node",
        "do not fit",
    ),
    (MN + "generator.yaml", LEADER_GPUS, LEADER_GPUS.replace("gpu: 4", "gpu: 2"), "multi-node", "the engine spans 8"),
    (MN + "generator.yaml", "    size: 2\n", "    size: 3\n", "multi-node", "the engine spans 8"),
    (
        MN + "generator.yaml",
        "restartPolicy: RecreateGroupOnPodRestart",
        "restartPolicy: None",
        "multi-node",
        "lose one",
    ),
    (MN + "generator.yaml", "  replicas: 24\n", "  replicas: '24'\n", "multi-node", "is not of type 'integer'"),
    (MN + "generator.yaml", '"--max-num-seqs=256"', '"--max-num-seqs=128"', "multi-node", "max_num_seqs: generator"),
    (MN + "generator.yaml", '"--tensor-parallel-size=8"', '"--tensor-parallel-size=eight"', "multi-node", "vllm serve"),
    (
        MN + "generator.yaml",
        "              - name: VLLM_HOST_IP\n                value: $(POD_IP)\n              - name: REDIS_ADDRESS",
        "              - name: REDIS_ADDRESS",
        "multi-node",
        "loopback",
    ),
    (MN + "gym-gateway-autoscaling.yaml", "{qwen3_5-397b-a17b-r2e-easy}", "{qwen3_5}", "multi-node", "tasks stream"),
    (
        MN + "gym-gateway-autoscaling.yaml",
        "consumerGroup: gateways",
        "consumerGroup: gateway",
        "multi-node",
        "gateways read",
    ),
    (MN + "gym-gateway-autoscaling.yaml", "key: redis-password}", "key: redis-pass}", "multi-node", "password"),
    (MN + "gym-gateway-autoscaling.yaml", "minReplicaCount: 8", "minReplicaCount: 20", "multi-node", "less than"),
    (MN + "gym-gateway-autoscaling.yaml", "  pollingInterval: 15\n", "  pollingIntervall: 15\n", "multi-node", "unexp"),
]


@pytest.mark.parametrize(
    "rel,old,new,overlay,expected", BROKEN, ids=[f"{b[0].split('/')[-1]}:{b[4][:24]}" for b in BROKEN]
)
def test_a_broken_manifest_fails(tmp_path, rel, old, new, overlay, expected):
    overlays = _broken_tree(tmp_path / "tree", rel, old, new)
    problems, _ = k8s_problems(overlays / overlay, tmp_path / "pods")
    assert any(expected in p for p in problems), problems


def test_kubectl_is_the_pinned_one_or_on_path():
    out = subprocess.run([kubectl(), "version", "--client"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "Kustomize Version" in out.stdout, out.stderr
    assert os.access(kubectl(), os.X_OK)
