"""``streamrl up``: run a whole job on one machine as child processes.

    embedded Valkey (unless REDIS_URL/redis.url) -> generator(s) -> wait /ready -> gateway(s)
    -> trainer -> progress display and scale requests until the trainer exits -> stop everything
    (by pid)

Each child gets the same config file and overrides (so they agree on the run), its own port and
a stable worker id, and logs to ``<output_dir>/logs/<name>.log``. A child that dies while the
trainer runs is restarted with the same name, port and worker id (`streamrl.restarts`: at most
``supervisor.max_restarts`` per service within ``supervisor.restart_window_s``, after a doubling
backoff); so is the trainer (it resumes from its newest checkpoint; not when it marked the run
failed) and the embedded Valkey (on its append-only file). A service that keeps dying fails the
job loudly with its log tail; a child that dies during start-up fails it at once. Ctrl-C (or SIGTERM, SIGHUP: a
closed terminal) stops the trainer first (it drains), then the workers, then Redis; a second one
kills them at once. Every child gets SIGTERM from the kernel if the supervisor dies, however it
dies (`streamrl.child_guard`), so none trains on as an orphan. ``run.json`` in the output folder
(`shared.protocol.RunFile`) records the URLs and pids for ``streamrl status``/``pause``/
``resume``/``validate``/``scale`` (rewritten when workers change).

Generators and gateway workers live in one `WorkerPool` per service; ``streamrl scale`` changes
their size while the job runs, through the `ScaleChannel` the supervisor reads every second
(`streamrl.worker_pool`): new workers start on new ports, removed ones (newest first) get SIGTERM,
drain, and are killed only past their stop limit. Each generator gets its own GPUs (or CPU cores)
of the node, and the trainer its own GPUs (`streamrl.devices`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import redis

from shared import keys as K
from shared.admin_api import Readiness
from shared.auth import redact_url
from shared.config import load
from shared.config_error import ConfigError
from shared.protocol import RunChild, RunFile, write_run_file
from shared.run_config import SERVICES, RunConfig
from streamrl.child_guard import guarded
from streamrl.devices import node_gpus, plan_devices, usable_cores
from streamrl.progress import Progress
from streamrl.redis_server import RedisServer, free_port
from streamrl.restarts import RestartBudget
from streamrl.worker_pool import ScaleChannel, WorkerPool

ROOT = Path(__file__).resolve().parents[1]
# A worker gets this long past its own drain limit (generator.drain_timeout_s,
# gym_gateway.drain_timeout_s) to close its clients and exit before it is killed.
STOP_MARGIN_S = 30.0


class JobFailed(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    args: list[str]
    log_path: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # the address it is reached at (`streamrl join`: this host's advertised one)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            guarded([sys.executable, *self.args]),  # SIGTERM if the supervisor dies, however it dies
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        fh.close()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once the process is seen to have exited; None before that or before start()."""
        return None if self.proc is None else self.proc.returncode

    def _running(self) -> subprocess.Popen[bytes] | None:
        """The process while it runs; None before start() and once it exited."""
        return self.proc if self.proc is not None and self.proc.poll() is None else None

    def alive(self) -> bool:
        return self._running() is not None

    def terminate(self) -> None:
        """SIGTERM without waiting: the service drains and exits on its own."""
        if (proc := self._running()) is not None:
            proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if (proc := self._running()) is not None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: engine subprocesses too
            proc.wait()

    def stop(self, timeout_s: float) -> None:
        proc = self._running()
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: engine subprocesses too
            proc.wait()

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _port(configured: int, offset: int) -> int:
    return free_port() if configured == 0 else configured + offset


class Supervisor:
    def __init__(self, config_path: str, overrides: list[str], *, progress: bool = True) -> None:
        self.config_path = str(Path(config_path).resolve())
        self.overrides = list(overrides)
        self.cfg = load(RunConfig, config_path, overrides)  # fail on a bad config before starting anything
        for service in SERVICES:  # what each of the job's services requires (the trainer: its datasets)
            self.cfg.check_service(service)
        self.out = Path(self.cfg.run.output_dir)
        self.logs = self.out / "logs"
        self.trainer: Child | None = None
        self.redis: RedisServer | None = None
        self.show_progress = progress
        cfg = self.cfg
        self.pools = {
            "generator": WorkerPool(
                "generator",
                self._generator,
                stop_timeout_s=cfg.generator.drain_timeout_s + STOP_MARGIN_S,
                ready_timeout_s=cfg.supervisor.generator_ready_timeout_s,
            ),
            "gym-gateway": WorkerPool(
                "gym-gateway",
                self._gateway,
                stop_timeout_s=cfg.gym_gateway.drain_timeout_s + STOP_MARGIN_S,
                ready_timeout_s=cfg.supervisor.gateway_ready_timeout_s,
            ),
        }
        # Fails on a layout that cannot fit before anything starts.
        self.devices = plan_devices(cfg, node_gpus(), usable_cores())
        if self.devices is not None and len(self.devices.slots) < cfg.generator.num_workers:
            raise ConfigError(
                f"generator.num_workers is {cfg.generator.num_workers} but this node has device slots for "
                f"{len(self.devices.slots)} ({self.devices.env_var}: {'; '.join(self.devices.slots)})"
            )
        a = cfg.autoscale
        if (
            a.enabled
            and a.backend == "local"
            and self.devices is not None
            and len(self.devices.slots) < a.generator.max
        ):
            raise ConfigError(
                f"autoscale.generator.max is {a.generator.max} but this node has device slots for "
                f"{len(self.devices.slots)} generators: `streamrl up` cannot scale that far (lower it)"
            )
        self.channel: ScaleChannel | None = None
        self.budgets: dict[str, RestartBudget] = {}  # per service: how many restarts are left
        self.restarts: dict[str, int] = {}  # per service: restarts so far (reported at the end)

    @property
    def children(self) -> list[Child]:
        """Every child, in start order (generators, gateways, trainer), stopping ones included."""
        workers = [c for pool in self.pools.values() for c in pool.children()]
        return workers + ([self.trainer] if self.trainer else [])

    def _child(self, name: str, module: str, port: int, extra: list[str]) -> Child:
        args = ["-m", module, "--config", self.config_path, "--port", str(port), *extra, *self.overrides]
        return Child(name, args, self.logs / f"{name}.log", port, env={"REDIS_URL": self.redis_url})

    def _generator(self, index: int) -> Child:
        # Members added by `streamrl scale` take any free port, never one a configured range may hold.
        port = _port(self.cfg.generator.port, index) if index < self.cfg.generator.num_workers else free_port()
        child = self._child(f"generator-{index}", "services.generator", port, ["--worker-id", f"generator-{index}"])
        if self.devices is not None:  # the first device slot no live generator holds
            var = self.devices.env_var
            held = [m.child.env[var] for m in self.pools["generator"].members if var in m.child.env]
            child.env.update(self.devices.free_slot(held, child.name))
        return child

    def _gateway(self, index: int) -> Child:
        port = _port(self.cfg.gym_gateway.port, index) if index < self.cfg.gym_gateway.num_workers else free_port()
        return self._child(f"gateway-{index}", "services.gym_gateway", port, ["--worker-id", f"gateway-{index}"])

    def run(self) -> int:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        # SIGTERM and SIGHUP stop the job as Ctrl-C does; SIGINT is set too, since a process started
        # in the background of a non-interactive shell inherits it ignored and Python then installs
        # no handler of its own.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
        try:
            self._start_redis()
            wait_ready(
                self.pools["generator"].start_initial(cfg.generator.num_workers),
                timeout_s=cfg.supervisor.generator_ready_timeout_s,
            )
            self.pools["generator"].mark_ready()
            gateways = self.pools["gym-gateway"].start_initial(cfg.gym_gateway.num_workers)
            # trainer.nproc_per_node > 1: the trainer starts its ranks under torchrun itself
            self.trainer = trainer = self._child("trainer", "services.trainer", _port(cfg.trainer.port, 0), [])
            trainer.env.update(self.devices.trainer_env if self.devices is not None else {})
            # Before the trainer starts: its autoscaler (autoscale.backend local) finds the run by
            # run.json and scales through this channel.
            self.channel = ScaleChannel(redis.Redis.from_url(self.redis_url), K.RunKeys(cfg.run.run_id), self.pools)
            self._write_run_file(trainer)
            trainer.start()
            self._write_run_file(trainer)  # with its pid
            wait_ready(gateways, timeout_s=cfg.supervisor.gateway_ready_timeout_s)  # while the trainer loads its policy
            self.pools["gym-gateway"].mark_ready()
            self._write_run_file(trainer)
            return self._watch(trainer)
        except KeyboardInterrupt:
            print("\ninterrupted: stopping the job", file=sys.stderr)
            return 130
        finally:
            self.shutdown()

    def _start_redis(self) -> None:
        url = os.environ.get("REDIS_URL") or self.cfg.redis.url
        if url:
            self.redis_url = url
            return
        self.redis = RedisServer(
            self.out / "redis",
            appendonly=True,  # a Valkey that died restarts on its append-only file: no entry lost
            appendfsync=self.cfg.redis.embedded_appendfsync,
            tied_to_parent=True,
        )
        self.redis.start()
        self.redis_url = self.redis.url

    def _write_run_file(self, trainer: Child) -> None:
        run = RunFile(
            run_id=self.cfg.run.run_id,
            trainer_url=trainer.url,
            redis_url=redact_url(self.redis_url),  # no password on disk: `streamrl status` then needs REDIS_URL
            children={c.name: RunChild(pid=c.pid, url=c.url, log=str(c.log_path)) for c in self.children},
            restarts=dict(self.restarts),
        )
        write_run_file(self.out, run)

    def _watch(self, trainer: Child) -> int:
        """Until the trainer exits for good: scale ticks, the progress display, and restarts of
        whatever died (`_heal`). A trainer that exits 0 ends the job; one that exits otherwise is
        restarted (it resumes from its newest checkpoint) unless the run failed (its stop key says
        so: restarting would fail again) or its restart budget is spent."""
        progress = Progress(trainer.url, self.cfg, enabled=self.show_progress)
        with progress:
            while True:
                while trainer.alive():
                    self._heal()
                    self._scale_tick(trainer)
                    progress.update()
                    time.sleep(1.0)
                code = trainer.returncode
                assert code is not None  # alive() polled it until it exited
                if code == 0 or self._run_failed():
                    break
                delay = self._grant("trainer", f"trainer died (code {code})", trainer)
                print(
                    f"trainer died (code {code}); restarting it in {delay:.0f}s (it resumes from its newest "
                    "checkpoint)",
                    file=sys.stderr,
                )
                self._sleep_healing(delay, trainer)
                trainer.start()
                self._write_run_file(trainer)
            progress.update(final=True)
        if self.restarts:
            print("restarts: " + ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())), file=sys.stderr)
        if code != 0:
            print(f"trainer exited with code {code}; last log lines:\n{trainer.tail(40)}", file=sys.stderr)
        return code

    def _heal(self) -> None:
        """Restart the embedded Valkey (on its append-only file) and any worker that died, each
        within its service's restart budget."""
        now = time.monotonic()
        if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is not None:
            code = self.redis.proc.returncode
            delay = self._grant("redis", f"the embedded Valkey died (code {code})", None)
            print(f"embedded Valkey died (code {code}); restarting it in {delay:.0f}s on its AOF", file=sys.stderr)
            time.sleep(delay)
            self.redis.start()
        for name, pool in self.pools.items():
            for m in pool.crashed():
                code = m.child.returncode
                delay = self._grant(name, f"{m.child.name} died (code {code})", m.child)
                print(f"{m.child.name} died (code {code}); restarting it in {delay:.0f}s", file=sys.stderr)
                pool.restart_later(m, now + delay)

    def _grant(self, service: str, what: str, child: Child | None) -> float:
        budget = self.budgets.setdefault(service, RestartBudget.from_config(self.cfg.supervisor))
        delay = budget.grant(time.monotonic())
        if delay is None:
            tail = f":\n{child.tail()}" if child is not None else ""
            raise JobFailed(f"{what} after {budget.spent()}: giving up{tail}")
        self.restarts[service] = self.restarts.get(service, 0) + 1
        if self.trainer is not None:
            self._write_run_file(self.trainer)  # the counts, for `streamrl status`
        return delay

    def _sleep_healing(self, seconds: float, trainer: Child) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._heal()
            self._scale_tick(trainer)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _run_failed(self) -> bool:
        """The trainer marked the run failed (not a crash): its stop key says "failed"."""
        try:
            with redis.Redis.from_url(self.redis_url, socket_timeout=5) as r:
                stop: bytes | None = r.get(K.RunKeys(self.cfg.run.run_id).stop)
                return stop == b"failed"
        except redis.RedisError:
            return False

    def _scale_tick(self, trainer: Child) -> None:
        assert self.channel is not None  # set before _watch starts
        try:
            changed = self.channel.tick()
        except redis.RedisError as exc:  # Redis briefly away: the next turn retries
            print(f"scale channel: {exc}", file=sys.stderr)
            return
        if changed:
            self._write_run_file(trainer)

    def shutdown(self) -> None:
        """Stop the trainer (it drains), then the workers, then Redis; a second Ctrl-C (or SIGTERM,
        SIGHUP) meanwhile kills every child at once."""
        others = [c for c in self.children if c is not self.trainer]
        try:
            for c in ([self.trainer] if self.trainer else []) + list(reversed(others)):
                c.stop(timeout_s=40.0)
        except KeyboardInterrupt:
            print("\nstopping at once: killing every child", file=sys.stderr)
            for c in self.children:
                c.kill()
        if self.channel is not None:
            self.channel.redis.close()
        if self.redis is not None:
            self.redis.stop()


def wait_ready(children: list[Child], timeout_s: float) -> None:
    """Until every child answers /ready with 200; JobFailed when one exits, reports it has failed,
    or is not ready within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for c in list(pending):
            if not c.alive():
                raise JobFailed(f"{c.name} exited during start-up (code {c.returncode}):\n{c.tail()}")
            try:
                answer = httpx.get(f"{c.url}/ready", timeout=2.0)
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                pending.remove(c)
            elif _failed(c, answer):  # e.g. a generator whose first weights cannot load: no use waiting
                raise JobFailed(f"{c.name} failed during start-up: {answer.text}\n{c.tail()}")
        if time.monotonic() > deadline:
            raise JobFailed(f"{', '.join(c.name for c in pending)} not ready within {timeout_s:.0f}s")
        time.sleep(0.5)


def _failed(child: Child, answer: httpx.Response) -> bool:
    """A /ready answer (`Readiness`) from a service that reports it has failed (``"state":
    "failed"``); JobFailed when the answer is no readiness report at all."""
    try:
        body = msgspec.json.decode(answer.content, type=Readiness)
    except msgspec.DecodeError as exc:
        raise JobFailed(
            f"{child.name} answered /ready ({answer.status_code}) with something that is not a readiness "
            f"report ({exc}): {answer.text[:200]!r}"
        ) from None
    return body.state == "failed"
