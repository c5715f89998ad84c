"""``streamrl join ROLE CONFIG``: run one role of a run on this host, joining the others by the
run's Redis URL (and API token).

    redis        the run's Valkey on every interface, password from --password-file, its URL
                 (this host's address) written to --url-file; restarted on its append-only file
    trainer      the trainer's ranks of this node (torchrun; trainer.nnodes > 1: c10d rendezvous
                 at trainer.rdzv_endpoint); restarted after a crash: it resumes from its checkpoint
    generator    --count generators;  gym-gateway: --count gateway workers; each restarted if it dies

Every role first reaches Redis (within --connect-timeout: else it fails naming the address and
this host) and binds every interface, advertising this host's address (--advertise, else the
interface that reaches Redis; `shared.netaddr`): its registry entry holds everything a peer
needs. A service bound off loopback needs the API token (STREAMRL_API_TOKEN or
STREAMRL_API_TOKEN_FILE; `shared.auth`). The workers stop (draining) when the run ends (its stop
key) or at SIGTERM; the trainer's join ends with the trainer. ``streamrl up`` is the same pieces
on one host (`streamrl.supervisor`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import redis

from shared import keys as K
from shared.auth import redact_url
from shared.config import load
from shared.config_error import ConfigError
from shared.netaddr import ADVERTISE_ENV, Unreachable, advertise_address, host_port, reach, this_host
from shared.registry import default_worker_id
from shared.run_config import RunConfig
from streamrl.devices import node_gpus, plan_devices, usable_cores
from streamrl.redis_server import RedisServer, free_port
from streamrl.restarts import RestartBudget
from streamrl.supervisor import STOP_MARGIN_S, Child, JobFailed, _interrupt, wait_ready
from streamrl.worker_pool import WorkerPool

ROLES = ("redis", "trainer", "generator", "gym-gateway")
MODULES = {"trainer": "services.trainer", "generator": "services.generator", "gym-gateway": "services.gym_gateway"}
SECTIONS = {"trainer": "trainer", "generator": "generator", "gym-gateway": "gym_gateway"}


@dataclass
class JoinOptions:
    role: str
    config: Path
    overrides: list[str]
    redis_url: str | None = None
    advertise: str | None = None
    count: int = 1
    port: int = 6379
    url_file: Path | None = None
    password_file: Path | None = None
    connect_timeout_s: float = 60.0


class Joined:
    """One role on this host (see the module's docstring)."""

    def __init__(self, opts: JoinOptions) -> None:
        if opts.role not in ROLES:
            raise ConfigError(f"the role must be one of {', '.join(ROLES)}, not {opts.role!r}")
        if opts.count < 1:
            raise ConfigError(f"--count is {opts.count}; it must be >= 1")
        self.opts = opts
        self.config_path = str(opts.config.resolve())
        self.cfg = load(RunConfig, self.config_path, opts.overrides)
        if opts.role != "redis":
            self.cfg.check_service(SECTIONS[opts.role])  # type: ignore[arg-type]
        self.out = Path(self.cfg.run.output_dir)
        self.budget = RestartBudget.from_config(self.cfg.supervisor)
        self.host = this_host()

    # -- the run's Redis ---------------------------------------------------------------------------

    def _redis_url(self) -> str:
        url = self.opts.redis_url or os.environ.get("REDIS_URL") or self.cfg.redis.url
        if not url:
            raise ConfigError("no Redis URL: give --redis-url, set REDIS_URL, or set redis.url")
        return url

    def _check_redis(self, url: str) -> None:
        """Reach the run's Redis and authenticate, within --connect-timeout; else fail naming it."""
        try:
            host, port = host_port(url)
        except ValueError as exc:
            raise ConfigError(f"the Redis URL: {exc}") from None
        reach(host, port, what=f"the run's Redis ({redact_url(url)})", deadline_s=self.opts.connect_timeout_s)
        try:
            with redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10) as r:
                r.ping()
        except redis.RedisError as exc:
            raise Unreachable(f"the run's Redis at {redact_url(url)} refused host {self.host}: {exc}") from None

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
        if self.opts.role == "redis":
            return self._serve_redis()
        url = self._redis_url()
        self._check_redis(url)
        advertise = self.opts.advertise or advertise_address(url)
        section = SECTIONS[self.opts.role]
        self.env = {"REDIS_URL": url, ADVERTISE_ENV: advertise}
        self.overrides = [f"{section}.host=0.0.0.0", *self.opts.overrides]
        self.advertise = advertise
        print(f"{self.opts.role} on host {self.host}, reached at {advertise}, run {self.cfg.run.run_id}", flush=True)
        if self.opts.role == "trainer":
            return self._run_trainer()
        return self._run_workers(url)

    def _serve_redis(self) -> int:
        password = self.opts.password_file.read_text().strip() if self.opts.password_file else ""
        if not password and not self.cfg.auth.allow_open_bind:
            raise ConfigError(
                "the run's Redis listens on every interface: give --password-file, or set auth.allow_open_bind=true "
                "on a private network"
            )
        advertise = self.opts.advertise or advertise_address()
        server = RedisServer(
            self.out / "redis",
            port=self.opts.port,
            appendonly=True,
            appendfsync=self.cfg.redis.embedded_appendfsync,
            extra_args=["--requirepass", password] if password else [],
            tied_to_parent=True,
            bind="0.0.0.0",
            advertise=advertise,
        )
        server.start()
        auth = f":{password}@" if password else ""
        url = f"redis://{auth}{advertise}:{server.port}/0"
        if self.opts.url_file is not None:
            self.opts.url_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.opts.url_file.with_suffix(".part")
            tmp.touch(mode=0o600)
            tmp.write_text(url + "\n")
            tmp.replace(self.opts.url_file)
        print(f"redis on host {self.host}: {redact_url(url)}", flush=True)
        try:
            while True:
                assert server.proc is not None
                if server.proc.poll() is not None:
                    delay = self._grant(f"the run's Valkey died (code {server.proc.returncode})")
                    time.sleep(delay)
                    server.start()  # on its append-only file: nothing acknowledged is lost
                time.sleep(1.0)
        except KeyboardInterrupt:
            return 0
        finally:
            server.stop()

    def _grant(self, what: str) -> float:
        delay = self.budget.grant(time.monotonic())
        if delay is None:
            raise JobFailed(f"{what} on host {self.host} after {self.budget.spent()}: giving up")
        print(f"{what}; restarting it in {delay:.0f}s", file=sys.stderr, flush=True)
        return delay

    # -- the trainer -------------------------------------------------------------------------------

    def _child(self, name: str, port: int, extra: list[str]) -> Child:
        module = MODULES[self.opts.role]
        args = ["-m", module, "--config", self.config_path, "--port", str(port), *extra, *self.overrides]
        log = self.out / "logs" / f"{name}.log"
        return Child(name, args, log, port, env=dict(self.env), host=self.advertise)

    def _run_trainer(self) -> int:
        trainer = self._child(f"trainer-{self.host}", self.cfg.trainer.port, [])
        trainer.start()
        try:
            while True:
                while trainer.alive():
                    time.sleep(1.0)
                code = trainer.returncode
                if code == 0 or code == 2 or self._run_stopped() == "failed":
                    if code:
                        print(f"trainer exited with code {code}:\n{trainer.tail(40)}", file=sys.stderr)
                    return code or 0
                time.sleep(self._grant(f"trainer died (code {code})"))
                trainer.start()  # every node's trainer restarts: they meet again and resume
        except KeyboardInterrupt:
            trainer.stop(self.cfg.trainer.drain_timeout_s + STOP_MARGIN_S)
            return 130

    def _run_stopped(self) -> str | None:
        try:
            with redis.Redis.from_url(self.env["REDIS_URL"], socket_timeout=5) as r:
                stop = r.get(K.RunKeys(self.cfg.run.run_id).stop)
        except redis.RedisError:
            return None
        return None if stop is None else stop.decode()

    # -- generators and gateway workers ------------------------------------------------------------

    def _run_workers(self, url: str) -> int:
        role, cfg = self.opts.role, self.cfg
        section = getattr(cfg, SECTIONS[role])
        devices = None
        if role == "generator":  # this host's GPUs (or cores) dealt to its generators only
            trainer = msgspec.structs.replace(cfg.trainer, nproc_per_node=0)
            devices = plan_devices(msgspec.structs.replace(cfg, trainer=trainer), node_gpus(), usable_cores())
        prefix = default_worker_id(role).rsplit("-", 1)[0]  # ROLE-HOST: stable across restarts of this join

        def make(index: int) -> Child:
            port = section.port + index if section.port else free_port("0.0.0.0")
            child = self._child(f"{prefix}-{index}", port, ["--worker-id", f"{prefix}-{index}"])
            if devices is not None:
                held = [m.child.env[devices.env_var] for m in pool.members if devices.env_var in m.child.env]
                child.env.update(devices.free_slot(held, child.name))
            return child

        ready_s = (
            cfg.supervisor.generator_ready_timeout_s if role == "generator" else cfg.supervisor.gateway_ready_timeout_s
        )
        pool = WorkerPool(role, make, stop_timeout_s=section.drain_timeout_s + STOP_MARGIN_S, ready_timeout_s=ready_s)
        try:
            wait_ready(pool.start_initial(self.opts.count), timeout_s=ready_s)
            pool.mark_ready()
            print(f"{self.opts.count} {role} worker(s) ready on host {self.host}", flush=True)
            while (stopped := self._run_stopped()) is None:
                now = time.monotonic()
                for m in pool.crashed():
                    pool.restart_later(m, now + self._grant(f"{m.child.name} died (code {m.child.returncode})"))
                pool.tick(now)
                time.sleep(1.0)
            print(f"the run {stopped}: stopping the {role} workers of host {self.host}", flush=True)
            return 0
        except KeyboardInterrupt:
            return 130
        finally:  # one SIGTERM each (a second would cut a drain short), then a kill past the deadline
            deadline = time.monotonic() + section.drain_timeout_s + STOP_MARGIN_S
            for c in pool.children():
                c.terminate()
            for c in pool.children():
                while c.alive() and time.monotonic() < deadline:
                    time.sleep(0.2)
                c.kill()
