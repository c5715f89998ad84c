"""Slurm for real: a slurmctld and one slurmd per simulated host (`tests.support.slurm`; hosts h0,
h1, h2 as network namespaces on a bridge), and the demo submitted with the batch script a user
runs, ``sbatch --nodes=3 deploy/slurm/streamrl.sbatch CONFIG ...``:

    h0: the run's Valkey, the trainer's first node (rendezvous), the batch script and its worker
        steps' owner (python -m streamrl.slurm_workers)
    h1: the trainer's second node (trainer.nnodes=2, one rank each), the gym-gateway's step
    h2: the generator's step (vLLM)

After its first step the run is held at a step boundary (``streamrl pause`` at the trainer's
registered URL, so that it cannot end first however fast the machine) while ``streamrl scale
--backend slurm`` (run on h0, as on a login node) takes the gym-gateway workers 1 -> 2 (a new job
step, on h2, registered from h2) and back to 1 (that step drained: SIGTERM to its worker, which
finishes or hands back its tasks, then the step ends), and resumed. The job must complete with the
trainer's exit code 0, the reward rise as tests/e2e/test_learning.py requires of the demo, no
trajectory trained twice, and nothing of the run left on any host.

Needs root (namespaces; slurmd runs the steps) and Slurm with MUNGE (scripts/setup_slurm.sh):
without them the test skips, in CI (CI or STREAMRL_REQUIRE_ENGINE set) it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import pytest

from shared.records import read_records, step_records
from streamrl.bench.cluster_run import demo_overrides
from streamrl.bench.hosts import SimCluster
from streamrl.slurm_workers import SLURM_FILE, read_slurm_file
from tests.e2e.test_learning import MARGIN, WINDOW
from tests.support.ci import REQUIRED
from tests.support.runs import read_metrics
from tests.support.slurm import SlurmCluster, unavailable

ROOT = Path(__file__).resolve().parents[2]
WHY = unavailable()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(WHY is not None and not REQUIRED, reason=f"slurm cluster: {WHY}"),
]
HOSTS = ["h0", "h1", "h2"]
STEPS = 12
JOB_TIMEOUT_S = 900.0
RUN_ID = "slurm-demo"


@pytest.fixture
def slurm(tmp_path):
    if WHY is not None:
        pytest.fail(f"CI needs a Slurm cluster for the slurm tests: {WHY}")
    with SimCluster(HOSTS) as hosts, SlurmCluster(hosts, tmp_path / "slurm") as cluster:
        print(f"slurm cluster of {len(HOSTS)} nodes up in {cluster.bringup_s:.1f}s")
        yield cluster


SCALE = ("--backend", "slurm", "--timeout", "300")


def cli(cluster: SlurmCluster, out: Path, *args: str) -> str:
    """A ``streamrl`` command on h0 (as on the cluster's login node); its output."""
    cmd = [sys.executable, "-m", "streamrl.cli", *args]
    if args[0] == "scale":
        cmd += ["--run-dir", str(out)]
    done = cluster.run("h0", cmd, timeout_s=360, env={"STREAMRL_API_TOKEN_FILE": str(out / "api-token")})
    assert done.returncode == 0, done.stdout + done.stderr + logs(cluster, out)
    return done.stdout


REGISTRY = """
import json, sys
import redis
from shared import keys as K
from shared.protocol import Heartbeat, decode
with redis.Redis.from_url(open(sys.argv[1]).read().strip()) as r:
    for raw in r.hgetall(K.RunKeys(sys.argv[2]).registry_info).values():
        h = decode(raw, Heartbeat)
        print(json.dumps({"kind": h.kind, "host": h.host, "url": h.url}))
"""


def registry(cluster: SlurmCluster, out: Path) -> list[dict]:
    """The run's registry entries, read on h0 (the run's Redis is reachable from the hosts only)."""
    done = cluster.run(
        "h0", [sys.executable, "-c", REGISTRY, str(out / "redis-url"), RUN_ID], env={"PYTHONPATH": str(ROOT)}
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _trained(out: Path) -> int:
    return len({r["step"] for r in read_metrics(out) if r.get("kind") == "train"})


def logs(cluster: SlurmCluster, out: Path, n: int = 40) -> str:
    parts = [
        f"\n== {p.relative_to(out)}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-n:])
        for p in dict.fromkeys(
            [out / "job.out", out / "logs" / "slurm-workers.log", *sorted(out.glob("logs/**/*.log"))]
        )
        if p.is_file()
    ]
    return "".join(parts) + "\n" + cluster.logs(10)


def wait_until(what: str, ready, timeout_s: float, cluster: SlurmCluster, job: str, out: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        state = cluster.job_state(job)
        if state not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f}s (job {state}){logs(cluster, out)}")
        time.sleep(1.0)


@pytest.mark.timeout(1800)
def test_the_demo_learns_on_two_trainer_nodes_and_scales_its_gateway_steps(demo_prepared, slurm, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(demo_prepared, out)
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONUNBUFFERED": "1",
        "STREAMRL_PYTHON": sys.executable,
        "STREAMRL_OUT": str(out),
        "STREAMRL_TRAINER_NODES": "2",
        "STREAMRL_TRAINER_PROCS": "1",
        "STREAMRL_WORKER_NODES": "2,1",  # the generator on h2, the gateway on h1, the added one on h2
    }
    t0 = time.monotonic()
    argv = ["--nodes=3", f"--chdir={ROOT}", f"--output={out / 'job.out'}", str(ROOT / "deploy/slurm/streamrl.sbatch")]
    job = slurm.sbatch(
        "h0", [*argv, str(ROOT / "deploy/configs/demo.yaml"), *demo_overrides(out, RUN_ID, STEPS)], env=env
    )

    # The worker steps are up and answer scale requests; the job's comment names the run's folder.
    wait_until(
        "the worker steps",
        lambda: (out / SLURM_FILE).is_file() and len(read_slurm_file(out).steps) == 2,
        300,
        slurm,
        job,
        out,
    )
    assert slurm.job_field(job, "Comment") == f"streamrl:{out}"
    wait_until("scale requests answered", lambda: "gym-gateway" in _show(slurm, out), 600, slurm, job, out)
    names = {s.name: s.nodes for s in slurm.steps(job)}
    assert names.get("streamrl-generator-0") == "h2" and names.get("streamrl-gym-gateway-0") == "h1", names
    assert names.get("streamrl-trainer") == "h[0-1]" and names.get("streamrl-redis") == "h0", names

    # Held at a step boundary after its first step (so that the run cannot end before the scaling
    # is done, however fast the machine), through the trainer's API on h0 as registered.
    wait_until("the first step", lambda: _trained(out) >= 1, 600, slurm, job, out)
    trainer = next(h for h in registry(slurm, out) if h["kind"] == "trainer")
    assert trainer["host"] == "h0", trainer
    epoch = json.loads(cli(slurm, out, "pause", "--url", trainer["url"]))["epoch"]

    t_scale = time.monotonic()
    assert "gym-gateway: 1 -> 2" in cli(slurm, out, "scale", *SCALE, "gym-gateway=2")
    names = {s.name: s.nodes for s in slurm.steps(job)}
    assert names.get("streamrl-gym-gateway-1") == "h2", names
    gateways = sorted(h["host"] for h in registry(slurm, out) if h["kind"] == "gym_gateway")
    assert gateways == ["h1", "h2"], gateways
    assert "gym-gateway: 2 -> 1" in cli(slurm, out, "scale", *SCALE, "gym-gateway=1")
    scaled_s = time.monotonic() - t_scale
    names = {s.name: s.nodes for s in slurm.steps(job)}
    assert "streamrl-gym-gateway-1" not in names and "streamrl-gym-gateway-0" in names, names
    # Drained, not killed: the step's worker answered SIGTERM by draining and exiting (the join's
    # exit code on SIGTERM), within its stop limit.
    owner = (out / "logs" / "slurm-workers.log").read_text()
    assert "streamrl-gym-gateway-1 stopped (code 130)" in owner, owner[-3000:]
    assert "did not stop within" not in owner, owner[-3000:]
    cli(slurm, out, "resume", "--epoch", str(epoch), "--url", trainer["url"])

    wait_until(
        "the job's end", lambda: slurm.job_state(job) not in ("PENDING", "RUNNING"), JOB_TIMEOUT_S, slurm, job, out
    )
    state, exit_code = slurm.job_state(job), slurm.job_field(job, "ExitCode")
    assert (state, exit_code) == ("COMPLETED", "0:0"), logs(slurm, out)
    print(f"job {job}: {time.monotonic() - t0:.0f}s; paused, gateway 1 -> 2 -> 1 in {scaled_s:.0f}s")

    # The trainer's ranks ran on h0 and h1 and met there.
    for host in ("h0", "h1"):
        assert f"trainer on host {host}" in (out / "logs" / "steps" / f"streamrl-trainer-{host}.log").read_text()
    steps = step_records(read_records(out / "metrics.jsonl"))
    rewards = [s.batch.reward_mean for s in steps]
    assert len(rewards) == STEPS
    first, last = statistics.mean(rewards[:WINDOW]), statistics.mean(rewards[-WINDOW:])
    assert last - first >= MARGIN, f"reward {first:.3f} -> {last:.3f} over {STEPS} steps: {rewards}"
    ids = [i for s in steps for i in s.consumed_ids]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    assert not read_slurm_file(out).steps, "worker steps left at the end"
    deadline = time.monotonic() + 60
    while (left := _leftovers(slurm)) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert not left, f"processes of the run left after the job: {left}"


DAEMONS = {"munged", "slurmctld", "slurmscriptd", "slurmd"}


def _leftovers(cluster: SlurmCluster) -> list[str]:
    """The processes on the simulated hosts other than Slurm's and MUNGE's daemons."""
    found = []
    for host in cluster.hosts.hosts.values():
        for pid in host.pids():
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm not in DAEMONS:
                found.append(f"{host.name}: {pid} {comm}")
    return found


def _show(cluster: SlurmCluster, out: Path) -> str:
    cmd = [sys.executable, "-m", "streamrl.cli", "scale", *SCALE, "--run-dir", str(out), "--show"]
    done = cluster.run("h0", cmd, timeout_s=60)
    return done.stdout if done.returncode == 0 else ""
