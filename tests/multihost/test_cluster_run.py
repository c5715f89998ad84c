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

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from shared import keys as K
from shared.protocol import Heartbeat, decode
from shared.records import read_records, step_records
from streamrl.bench.cluster_run import ClusterRun, link_bytes
from streamrl.bench.hosts import SimCluster, available
from tests.e2e.test_learning import MARGIN, WINDOW

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("CI", "") not in ("", "0", "false") or os.environ.get("STREAMRL_REQUIRE_ENGINE") == "1"
WHY = available()
pytestmark = [
    pytest.mark.multihost,
    pytest.mark.skipif(WHY is not None and not REQUIRED, reason=f"simulated hosts: {WHY}"),
]
HOSTS = ["h0", "h1", "h2", "h3"]
STEPS = 12


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The demo's model, data and warm-started policy (`streamrl demo --prepare-only`)."""
    out = tmp_path_factory.mktemp("demo-prepared")
    cmd = [sys.executable, "-m", "streamrl.cli", "demo", "--out", str(out), "--prepare-only"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def demo_overrides(out: Path, run_id: str, steps: int) -> list[str]:
    return [
        f"run.run_id={run_id}",
        f"run.output_dir={out}",
        f"data.train_path={out / 'data' / 'train.jsonl'}",
        f"data.val_path={out / 'data' / 'val.jsonl'}",
        f"policy.model_name={out / 'policy-init'}",
        f"grpo.max_num_steps={steps}",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "logger.plot=false",
        "refit.transport=collective",
        "trainer.nnodes=2",
        "trainer.rdzv_endpoint=h0:29400",
    ]


@pytest.fixture
def cluster_run(prepared, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(prepared, out)
    with SimCluster(HOSTS) as cluster:
        run = ClusterRun(cluster, ROOT / "deploy" / "configs" / "demo.yaml", out, [])
        yield run
        run.stop()


def start_demo(run: ClusterRun, run_id: str, steps: int, *extra: str) -> None:
    run.overrides = [*demo_overrides(run.out, run_id, steps), *extra]
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
