"""Joining a run from any host, without a second host: the address a service advertises, the
trainer's torchrun arguments across nodes, and what is refused or fails within a deadline before
anything starts (a node count without a rendezvous, a layout the world does not divide, Redis or
a rendezvous out of reach), each naming the key or the address and this host."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.trainer.launch import launcher, preflight
from services.trainer.ranks import Ranks, lost_hosts
from shared.config import load
from shared.config_error import ConfigError
from shared.netaddr import ADVERTISE_ENV, Unreachable, advertise_address, host_port, reach, this_host
from shared.run_config import RunConfig
from shared.service import advertised_url

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "deploy" / "configs" / "demo.yaml"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_host_port_reads_urls_and_endpoints():
    assert host_port("redis://:pw@10.0.0.7:6390/0") == ("10.0.0.7", 6390)
    assert host_port("redis://node-3/0") == ("node-3", 6379)
    assert host_port("h0:29400", default_port=1) == ("h0", 29400)
    with pytest.raises(ValueError, match="names no host"):
        host_port("redis:///0")


def test_the_advertised_address_is_given_or_the_interface_that_reaches_redis(monkeypatch):
    monkeypatch.delenv(ADVERTISE_ENV, raising=False)
    assert advertise_address("redis://127.0.0.1:6379/0") == "127.0.0.1"  # a one-host run stays on loopback
    assert advertised_url("0.0.0.0", 8000, "redis://127.0.0.1:6379/0") == "http://127.0.0.1:8000"
    assert advertised_url("10.1.2.3", 8000, "redis://127.0.0.1:6379/0") == "http://10.1.2.3:8000"  # bound: as is
    monkeypatch.setenv(ADVERTISE_ENV, "10.9.8.7")
    assert advertised_url("0.0.0.0", 8000, "redis://127.0.0.1:6379/0") == "http://10.9.8.7:8000"
    assert advertised_url("::", 8000) == "http://10.9.8.7:8000"


def test_an_unreachable_address_fails_within_its_deadline_naming_it_and_this_host():
    port = closed_port()
    t0 = time.monotonic()
    with pytest.raises(Unreachable) as info:
        reach("127.0.0.1", port, what="the run's Redis", deadline_s=1.5)
    assert time.monotonic() - t0 < 30
    assert f"127.0.0.1:{port}" in str(info.value) and f"from host {this_host()}" in str(info.value)


def cfg(*overrides: str) -> RunConfig:
    return load(RunConfig, str(DEMO), list(overrides))


def test_torchrun_arguments_for_one_node_and_for_many():
    assert launcher(cfg("trainer.nproc_per_node=2"))[-1] == "--standalone"
    many = launcher(cfg("trainer.nnodes=4", "trainer.rdzv_endpoint=node-0:29400", "run.run_id=r7"))
    assert "--nnodes=4" in many and "--rdzv-backend=c10d" in many and "--rdzv-endpoint=node-0:29400" in many
    assert "--rdzv-id=r7" in many and "--standalone" not in many


def test_many_nodes_without_a_rendezvous_are_refused_by_key():
    with pytest.raises(ConfigError, match="trainer.rdzv_endpoint is required"):
        preflight(cfg("trainer.nnodes=2"), 2, launched=False)


def test_a_node_count_the_megatron_layout_does_not_divide_is_refused_before_any_rank_starts():
    layout = ["trainer.backend=megatron", "policy.megatron_cfg.tensor_model_parallel_size=4", "trainer.nnodes=3"]
    c = cfg(*layout, "trainer.rdzv_endpoint=192.0.2.1:29400")
    with pytest.raises(ConfigError, match="tensor_model_parallel_size is 4; it must divide the trainer's 3 ranks"):
        preflight(c, 3, launched=False)
    # as the trainer runs it: refused with exit code 2, torchrun never started
    cmd = [sys.executable, "-m", "services.trainer", "--config", str(DEMO), *layout, "trainer.rdzv_endpoint=h:1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "must divide the trainer's 3 ranks" in done.stderr and "torch.distributed.run" not in done.stderr


def test_an_unreachable_rendezvous_fails_naming_the_endpoint_and_this_host():
    port = closed_port()
    # 192.0.2.0/24 is reserved for documentation: never this host's, never routed
    c = cfg("trainer.nnodes=2", f"trainer.rdzv_endpoint=192.0.2.1:{port}", "trainer.rdzv_timeout_s=1")
    with pytest.raises(Unreachable, match=rf"rendezvous.*192\.0\.2\.1:{port} from host {this_host()}"):
        preflight(c, 2, launched=False)


def test_a_lost_rank_is_named_by_its_host():
    ranks = Ranks(rank=0, world_size=3, device=None, hosts=(("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")))  # type: ignore[arg-type]
    error = RuntimeError("Read error [10.0.0.3]:19100: Connection reset by peer")
    assert lost_hosts(ranks, error) == "lost host c (10.0.0.3: rank 2)"
    assert (
        lost_hosts(ranks, RuntimeError("timed out"))
        == "ranks on hosts 0: a (10.0.0.1), 1: b (10.0.0.2), 2: c (10.0.0.3)"
    )


def join(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "streamrl.cli", "join", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def test_a_role_that_cannot_reach_redis_fails_naming_the_address_and_this_host():
    port = closed_port()
    done = join("gym-gateway", str(DEMO), "--redis-url", f"redis://127.0.0.1:{port}/0", "--connect-timeout", "2")
    assert done.returncode == 1, done.stderr
    assert f"cannot reach the run's Redis (redis://127.0.0.1:{port}/0) at 127.0.0.1:{port}" in done.stderr
    assert f"from host {this_host()} within 2s" in done.stderr


def test_the_runs_redis_is_not_opened_to_the_network_without_a_password(tmp_path):
    done = join("redis", str(DEMO), f"run.output_dir={tmp_path}")
    assert done.returncode == 2
    assert "give --password-file, or set auth.allow_open_bind=true" in done.stderr
    done = join("nonsense", str(DEMO))
    assert done.returncode == 2 and "the role must be one of redis, trainer, generator, gym-gateway" in done.stderr
