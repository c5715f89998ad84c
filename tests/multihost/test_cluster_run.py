"""The demo across simulated hosts (network namespaces on a bridge, `streamrl.bench.hosts`), every
role started with ``streamrl join`` on its own host (`streamrl.bench.cluster_run`): the run's
Valkey and the trainer's first node on h0, the trainer's second node on h1 (torchrun, c10d
rendezvous, gloo), a vLLM generator on h2, a gateway worker on h3. Weights go from both trainer
nodes to the generator's host with the resharding collective transport. Each host has its own
address and hostname; nothing but the run's Redis URL and token is shared, so any code path that
assumes a peer on loopback fails here.

Needs root (network namespaces): without it the tests skip, in CI (CI or STREAMRL_REQUIRE_ENGINE
set) they fail.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared import keys as K
from shared.protocol import Heartbeat, decode
from shared.records import read_records, step_records
from streamrl.bench.cluster_run import ClusterRun, demo_overrides, link_bytes
from streamrl.bench.hosts import SimCluster, available
from tests.e2e.test_learning import MARGIN, WINDOW
from tests.support.ci import REQUIRED
from tests.support.runs import assert_every_step_trained_once, read_metrics

ROOT = Path(__file__).resolve().parents[2]
WHY = available()
pytestmark = [
    pytest.mark.multihost,
    pytest.mark.skipif(WHY is not None and not REQUIRED, reason=f"simulated hosts: {WHY}"),
]
HOSTS = ["h0", "h1", "h2", "h3"]
STEPS = 12


def on_hosts(prepared: Path, out: Path, hosts: list[str]) -> Iterator[ClusterRun]:
    """A run of the demo prepared in ``prepared`` (copied to ``out``) on simulated ``hosts``."""
    shutil.copytree(prepared, out)
    with SimCluster(hosts) as cluster:
        run = ClusterRun(cluster, ROOT / "deploy" / "configs" / "demo.yaml", out, [])
        yield run
        run.stop()


@pytest.fixture
def cluster_run(demo_prepared, tmp_path):
    yield from on_hosts(demo_prepared, tmp_path / "run", HOSTS)


def start_demo(run: ClusterRun, run_id: str, steps: int, *extra: str) -> None:
    run.overrides = [
        *demo_overrides(run.out, run_id, steps),
        f"run.output_dir={run.out}",
        "refit.transport=collective",
        "trainer.nnodes=2",
        "trainer.rdzv_endpoint=h0:29400",
        *extra,
    ]
    run.start_redis("h0")
    run.join("h2", "generator")
    run.join("h3", "gym-gateway")
    run.join("h0", "trainer")
    run.join("h1", "trainer")


def registry(run: ClusterRun, run_id: str) -> dict[str, Heartbeat]:
    def read() -> dict[bytes, bytes]:
        with redis.Redis.from_url(run.redis_url, socket_timeout=5) as r:
            return r.hgetall(K.RunKeys(run_id).registry_info)

    raw = run.cluster["h0"].call(read)
    return {k.decode(): decode(v, Heartbeat) for k, v in raw.items()}


def test_the_demo_learns_across_four_hosts(cluster_run):
    run = cluster_run
    start_demo(run, "mh-learn", STEPS)
    deadline = time.monotonic() + 900
    seen: dict[str, Heartbeat] = {}
    while run.procs[("h0", "trainer")].poll() is None and time.monotonic() < deadline:
        seen.update(registry(run, "mh-learn"))
        time.sleep(2)
    assert run.wait("h0", "trainer", 60) == 0, run.logs()
    assert run.wait("h1", "trainer", 120) == 0, run.logs()
    # Every service registered the address of its own host, not loopback.
    urls = {h.kind: h.url for h in seen.values()}
    assert urls.get("generator", "").startswith(f"http://{run.cluster['h2'].address}:"), urls
    assert urls.get("gym_gateway", "").startswith(f"http://{run.cluster['h3'].address}:"), urls
    assert urls.get("trainer", "").startswith(f"http://{run.cluster['h0'].address}:"), urls
    # The workers leave on their own once the run ends.
    assert run.wait("h2", "generator", 120) == 0, run.logs()
    assert run.wait("h3", "gym-gateway", 120) == 0, run.logs()

    steps = step_records(read_records(run.out / "metrics.jsonl"))
    rewards = [s.batch.reward_mean for s in steps]
    assert len(rewards) == STEPS
    first, last = statistics.mean(rewards[:WINDOW]), statistics.mean(rewards[-WINDOW:])
    assert last - first >= MARGIN, f"reward {first:.3f} -> {last:.3f} over {STEPS} steps: {rewards}"
    ids = [i for s in steps for i in s.consumed_ids]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    # The weights crossed hosts: the generator's host received them from both trainer nodes.
    rx, _ = link_bytes(run.cluster["h2"])
    _, tx1 = link_bytes(run.cluster["h1"])
    model_bytes = sum(f.stat().st_size for f in (run.out / "policy-init").glob("*.safetensors"))
    assert rx > STEPS * model_bytes * 0.5, (rx, model_bytes)
    assert tx1 > STEPS * model_bytes * 0.25, (tx1, model_bytes)


def wait_for_steps(run: ClusterRun, n: int, timeout_s: float) -> int:
    """Until the run has recorded ``n`` training steps (its trainer still running)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = len(step_records(read_records(run.out / "metrics.jsonl")))
        if done >= n:
            return done
        assert run.procs[("h0", "trainer")].poll() is None, run.logs()
        time.sleep(1)
    raise AssertionError(f"fewer than {n} steps within {timeout_s:.0f}s:\n{run.logs()}")


FAULT_HOSTS = [*HOSTS, "h4"]
FAULT_STEPS = 14


@pytest.fixture
def fault_run(demo_prepared, tmp_path):
    yield from on_hosts(demo_prepared, tmp_path / "run", FAULT_HOSTS)


def test_a_lost_host_heals_or_resumes_and_nothing_is_trained_twice(fault_run):
    """Gateway workers on h3 and h4. h4's link is cut for longer than every deadline that
    concerns it (its tasks are reclaimed by h3 meanwhile) and restored; h3 loses every process at
    once and its join is started again; then h1, the trainer's second node, loses every process:
    the trainer's first node fails naming h1, and its join restarts it to wait for h1 at the
    rendezvous. h1 stays gone: the trainer's join on h0 is stopped and started again with one
    node, and the trainer resumes the two nodes' sharded checkpoint at that node count. The run
    ends with every step trained once and no trajectory trained twice."""
    run = fault_run
    cut_s = 25.0
    start_demo(
        run,
        "mh-faults",
        FAULT_STEPS,
        "gym_gateway.reclaim_idle_s=10",
        "gym_gateway.rollout_timeout_s=20",
        "checkpointing.save_period=2",
        "trainer.collective_timeout_s=30",
        "trainer.refit_timeout_s=30",
    )
    run.join("h4", "gym-gateway")
    h0, h1, h3, h4 = (run.cluster[h] for h in ("h0", "h1", "h3", "h4"))

    wait_for_steps(run, 2, 600)
    h4.link(False)
    time.sleep(cut_s)  # past the gateway's reclaim deadline and the registry's heartbeat TTL
    h4.link(True)

    at = wait_for_steps(run, 4, 600)
    assert h3.kill_all() > 0
    run.join("h3", "gym-gateway")  # the host is back: a restart of its join resumes its worker

    wait_for_steps(run, at + 3, 600)
    assert h1.kill_all() > 0
    h0_log = run.out / "logs" / "trainer-h0.log"
    deadline = time.monotonic() + 300
    while "trainer died (code 1); restarting it" not in run.tail("h0", "trainer"):
        assert time.monotonic() < deadline, run.logs()
        time.sleep(1)
    assert f"lost host h1 ({h1.address}: rank 1)" in h0_log.read_text(errors="replace"), "it names the lost host"
    run.procs[("h0", "trainer")].terminate()  # h1 stays gone: go on with one node
    assert run.wait("h0", "trainer", 120) in (0, 130), run.logs()
    run.join("h0", "trainer", "trainer.nnodes=1")

    assert run.wait("h0", "trainer", 900) == 0, run.logs()
    resumed = h0_log.read_text(errors="replace").split("lost host h1")[-1]  # the one-node trainer's lines
    assert "one rank" in resumed and "resumed from" in resumed and "2 ranks" not in resumed
    records = read_metrics(run.out)
    steps = {r["step"] for r in records if r.get("kind") == "train"}
    assert steps == set(range(FAULT_STEPS))
    assert_every_step_trained_once(records, FAULT_STEPS, 64)  # the demo's 8 prompts x 8 rollouts
