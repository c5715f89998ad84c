"""A run laid over simulated hosts (`streamrl.bench.hosts`), each role started with ``streamrl
join`` on its host as a user would: the multi-host tests and the multi-host benchmark.

    h0: streamrl join redis (password file) + streamrl join trainer   (the rendezvous's node)
    h1: streamrl join trainer                                         (trainer.nnodes=2)
    h2: streamrl join generator         h3: streamrl join gym-gateway

Every process gets the run's API token (services bind every interface) and the Redis URL the
redis role wrote; logs go to ``OUT/hosts/HOST-ROLE.log``. `link_bytes` reads each host's interface
counters, the bytes its link carried.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.bench.hosts import Host, SimCluster

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ClusterRun:
    cluster: SimCluster
    config: Path
    out: Path  # the run's output folder (run.output_dir): every host sees it
    overrides: list[str]
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: dict[tuple[str, str], subprocess.Popen[bytes]] = field(default_factory=dict)
    redis_url: str = ""

    @property
    def env(self) -> dict[str, str]:
        env = {"STREAMRL_API_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        return {**env, "REDIS_URL": self.redis_url} if self.redis_url else env

    def log(self, host: str, role: str) -> Path:
        return self.out / "hosts" / f"{host}-{role}.log"

    def join(self, host: str, role: str, *extra: str) -> subprocess.Popen[bytes]:
        """``streamrl join ROLE`` on ``host`` (replacing an earlier one of the same role there); ``extra``
        options and overrides come last (an override there wins)."""
        cmd = [sys.executable, "-m", "streamrl.cli", "join", role, str(self.config), *self.overrides, *extra]
        proc = self.cluster[host].popen(cmd, env=self.env, log=self.log(host, role), cwd=ROOT)
        self.procs[(host, role)] = proc
        return proc

    def start_redis(self, host: str, timeout_s: float = 60.0) -> str:
        secret = self.out / "redis-password"
        secret.parent.mkdir(parents=True, exist_ok=True)
        secret.write_text(secrets.token_hex(16) + "\n")
        secret.chmod(0o600)
        url_file = self.out / "redis-url"
        url_file.unlink(missing_ok=True)
        self.join(host, "redis", "--password-file", str(secret), "--url-file", str(url_file))
        deadline = time.monotonic() + timeout_s
        while not url_file.is_file():
            proc = self.procs[(host, "redis")]
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run's Redis did not start on {host}:\n{self.tail(host, 'redis')}")
            time.sleep(0.2)
        self.redis_url = url_file.read_text().strip()
        return self.redis_url

    def tail(self, host: str, role: str, n: int = 40) -> str:
        try:
            return "\n".join(self.log(host, role).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def logs(self) -> str:
        return "\n".join(f"== {h} {r}\n{self.tail(h, r)}" for h, r in self.procs)

    def wait(self, host: str, role: str, timeout_s: float) -> int:
        return self.procs[(host, role)].wait(timeout_s)

    def stop(self) -> None:
        """SIGTERM every role still running (they drain), then kill what is left."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 60
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()


def demo_overrides(out: Path, run_id: str, steps: int) -> list[str]:
    """The demo's config (deploy/configs/demo.yaml) on the model, data and warm start prepared in
    ``out`` (`streamrl demo --prepare-only`), shortened to ``steps`` steps without validations or
    plots."""
    return [
        f"run.run_id={run_id}",
        f"data.train_path={out / 'data' / 'train.jsonl'}",
        f"data.val_path={out / 'data' / 'val.jsonl'}",
        f"policy.model_name={out / 'policy-init'}",
        f"grpo.max_num_steps={steps}",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "logger.plot=false",
    ]


def link_bytes(host: Host) -> tuple[int, int]:
    """(received, sent) bytes of ``host``'s link so far."""
    out = host.run(["cat", "/sys/class/net/eth0/statistics/rx_bytes", "/sys/class/net/eth0/statistics/tx_bytes"])
    rx, tx = (int(v) for v in out.stdout.split())
    return rx, tx
