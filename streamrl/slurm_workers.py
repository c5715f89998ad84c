"""The generators and gym-gateway workers of a Slurm run, each its own job step, scaled while the
job runs (deploy/slurm/streamrl.sbatch starts this on the job's first node).

    python -m streamrl.slurm_workers --generators G --gateways W --nodes h2,h3 CONFIG [key=value ...]

    worker = one job step:  srun --jobid=J --overlap --nodes=1 --ntasks=1 --nodelist=NODE
                                 --job-name=streamrl-SERVICE-I [SRUN OPTIONS] PYTHON -m streamrl.cli
                                 join SERVICE CONFIG --count 1 SECTION.port=PORT [key=value ...]
    add:    a new step on the worker node with the fewest workers that runs none of this service
            (`place`); ready when http://NODE:PORT/ready answers 200
    drain:  ``scancel --signal=TERM J.STEP``: the worker's join gets SIGTERM and drains its worker
            (a generator leaves routing first, a gateway finishes or releases its tasks); the step
            ends when it has; past the service's stop limit the step is killed

One `WorkerPool` per service and the `ScaleChannel` of ``streamrl up`` (`streamrl.worker_pool`):
``streamrl scale --backend slurm`` (`streamrl.scale_slurm`) sets the wanted counts under the run's
``scale:request`` key in Redis and reads the answer under ``scale:status``, as the local backend
does; this process writes ``slurm.json`` in the run's output folder (job id, run id, the steps) so
that the backend finds the run and confirms the steps with ``squeue``.

Signalling the srun itself would not drain: srun answers SIGTERM by killing its step. A node runs
at most one worker of each service: a join's worker id and port are per host (ROLE-HOST-0 and the
section's port), so two steps of one service on one node would collide. A step that dies is
started again on its node within ``supervisor.max_restarts``. The process ends when the run does
(its stop key) or at SIGTERM (the batch script, once the trainer's step has ended), draining every
step first.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import redis

from shared import keys as K
from shared.auth import redact_url
from shared.config import load
from shared.config_error import ConfigError
from shared.netaddr import ADVERTISE_ENV
from shared.run_config import RunConfig
from streamrl.child_guard import guarded
from streamrl.restarts import RestartBudget
from streamrl.supervisor import ROOT, STOP_MARGIN_S, Child, JobFailed, _interrupt, wait_ready
from streamrl.worker_pool import CannotStart, ScaleChannel, WorkerPool

log = logging.getLogger(__name__)

SLURM_FILE = "slurm.json"
SECTIONS = {"generator": "generator", "gym-gateway": "gym_gateway"}
STEP_PREFIX = "streamrl-"


class StepInfo(msgspec.Struct, frozen=True):
    service: str
    node: str
    port: int


class SlurmRunFile(msgspec.Struct, frozen=True):
    """``slurm.json`` in the run's output folder: what ``streamrl scale --backend slurm`` needs."""

    job_id: str
    run_id: str
    redis_url: str  # without its password
    redis_url_file: str | None  # the file that holds it with the password (the job owner's only)
    steps: dict[str, StepInfo]  # step name -> where it runs


def write_slurm_file(out: Path, run: SlurmRunFile) -> None:
    path = out / SLURM_FILE
    tmp = path.with_suffix(".part")
    tmp.write_bytes(msgspec.json.encode(run))
    tmp.replace(path)


def read_slurm_file(out: Path) -> SlurmRunFile:
    return msgspec.json.decode((out / SLURM_FILE).read_bytes(), type=SlurmRunFile)


def step_name(service: str, index: int) -> str:
    return f"{STEP_PREFIX}{service}-{index}"


def step_service(name: str) -> str | None:
    """The service of a worker step's name (``streamrl-gym-gateway-3`` -> ``gym-gateway``); None
    for any other step."""
    if not name.startswith(STEP_PREFIX):
        return None
    service, _, index = name[len(STEP_PREFIX) :].rpartition("-")
    return service if service in SECTIONS and index.isdigit() else None


def parse_steps(squeue_out: str) -> dict[str, str]:
    """``squeue -h -s -o '%i %j'`` output -> {step name: JOBID.STEP}."""
    steps: dict[str, str] = {}
    for line in squeue_out.splitlines():
        parts = line.split()
        if len(parts) == 2:
            steps[parts[1]] = parts[0]
    return steps


def job_steps(job_id: str) -> dict[str, str]:
    """The job's steps that run now: {step name: JOBID.STEP}."""
    done = subprocess.run(
        ["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        raise RuntimeError(f"squeue -s -j {job_id}: {done.stderr.strip()}")
    return parse_steps(done.stdout)


def place(service: str, nodes: Sequence[str], live: dict[str, list[str]]) -> str:
    """The node for a new ``service`` worker: of ``nodes``, those running no ``service`` worker
    (``live``: service -> the nodes of its workers, stopping ones included), the one with the
    fewest workers of any service, the earliest listed on a tie; CannotStart when none is left."""
    taken = set(live.get(service, []))
    free = [n for n in nodes if n not in taken]
    if not free:
        raise CannotStart(
            f"every worker node ({', '.join(nodes)}) runs a {service} already (one per node: its worker id and "
            "port are per host); give the job more nodes, or more of them to the workers"
        )
    load = {n: sum(ns.count(n) for ns in live.values()) for n in free}
    return min(free, key=lambda n: (load[n], nodes.index(n)))


@dataclass
class StepChild(Child):
    """A worker as a job step: `Child` whose process is the step's srun on the job's first node."""

    job_id: str = ""
    node: str = ""
    srun_args: list[str] = field(default_factory=list)
    signalled: bool = False  # SIGTERM sent since the last start

    @property
    def url(self) -> str:  # the worker's node, not this one
        return f"http://{self.node}:{self.port}"

    def argv(self) -> list[str]:
        return [
            "srun",
            f"--jobid={self.job_id}",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={self.node}",
            f"--job-name={self.name}",
            *self.srun_args,
            sys.executable,
            *self.args,
        ]

    def start(self) -> None:
        self.signalled = False
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        env.pop(ADVERTISE_ENV, None)  # every node's join finds its own address
        with open(self.log_path, "ab") as fh:
            self.proc = subprocess.Popen(
                guarded(self.argv()),  # the srun gets SIGTERM (its step is killed) if this process dies
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def step_id(self) -> str | None:
        try:
            return job_steps(self.job_id).get(self.name)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            log.warning("%s: cannot list the job's steps: %s", self.name, exc)
            return None

    def _scancel(self, sig: str) -> bool:
        """``scancel --signal=SIG`` to this step; False when the step is not (yet) listed. Slurm
        22.05's scancel exits 225 ("Invalid job id specified") after delivering a signal to a
        step, so its exit code is not the test: the step ending is (`WorkerPool` waits for it)."""
        step = self.step_id()
        if step is None:
            return False
        done = subprocess.run(["scancel", f"--signal={sig}", step], capture_output=True, text=True, timeout=30)
        log.debug("scancel --signal=%s %s: %s %s", sig, step, done.returncode, done.stderr.strip())
        return True

    def terminate(self) -> None:
        """SIGTERM to the worker (not to the srun), once: it drains, then its step ends (a second
        SIGTERM would cut its drain short)."""
        if self._running() is None or self.signalled:
            return
        self.signalled = True
        if not self._scancel("TERM") and (proc := self._running()) is not None:
            proc.send_signal(signal.SIGTERM)  # no step yet: nothing started that could drain

    def kill(self) -> None:
        if (proc := self._running()) is not None:
            self._scancel("KILL")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self, timeout_s: float) -> None:
        proc = self._running()
        if proc is None:
            return
        self.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Layout:
    """Where and how the worker steps run."""

    job_id: str
    nodes: list[str]
    counts: dict[str, int]
    srun_args: dict[str, list[str]] = field(default_factory=dict)
    redis_url_file: Path | None = None

    def check(self) -> None:
        """ConfigError when the start-up counts cannot be placed (one worker of a service per node)."""
        too_many = [f"{n} {s}" for s, n in self.counts.items() if n > len(self.nodes)]
        if not self.nodes or too_many:
            raise ConfigError(
                f"{', '.join(too_many) or 'workers'} on {len(self.nodes)} worker node(s) "
                f"({', '.join(self.nodes)}): a node runs at most one worker of each service"
            )


class SlurmWorkers:
    def __init__(self, config: str, overrides: list[str], layout: Layout) -> None:
        layout.check()
        self.config_path = str(Path(config).resolve())
        self.overrides = list(overrides)
        self.cfg = cfg = load(RunConfig, self.config_path, overrides)
        for service in SECTIONS.values():
            cfg.check_service(service)  # type: ignore[arg-type]
        self.layout = layout
        self.out = Path(cfg.run.output_dir)
        self.redis_url = os.environ.get("REDIS_URL") or cfg.redis.url or ""
        if not self.redis_url:
            raise ConfigError("no Redis URL: set REDIS_URL (the batch script does) or redis.url")
        ready = {
            "generator": cfg.supervisor.generator_ready_timeout_s,
            "gym-gateway": cfg.supervisor.gateway_ready_timeout_s,
        }
        drain = {"generator": cfg.generator.drain_timeout_s, "gym-gateway": cfg.gym_gateway.drain_timeout_s}
        self.ready_s = ready
        self.pools = {
            s: WorkerPool(
                s,
                functools.partial(self._make, s),
                stop_timeout_s=drain[s] + STOP_MARGIN_S,
                ready_timeout_s=ready[s],
            )
            for s in SECTIONS
        }
        self.budgets = {s: RestartBudget.from_config(cfg.supervisor) for s in SECTIONS}

    def _port(self, service: str) -> int:
        port: int = getattr(self.cfg, SECTIONS[service]).port
        return port or {"generator": 8100, "gym-gateway": 8200}[service]  # one per node: a fixed port is free

    def _live(self) -> dict[str, list[str]]:
        return {s: [m.child.node for m in p.members if isinstance(m.child, StepChild)] for s, p in self.pools.items()}

    def _make(self, service: str, index: int) -> StepChild:
        node = place(service, self.layout.nodes, self._live())
        port = self._port(service)
        name = step_name(service, index)
        join = ["-m", "streamrl.cli", "join", service, self.config_path, "--count", "1"]
        args = [*join, *self.overrides, f"{SECTIONS[service]}.port={port}"]
        return StepChild(
            name,
            args,
            self.out / "logs" / "steps" / f"{name}.log",
            port,
            env={"REDIS_URL": self.redis_url},
            job_id=self.layout.job_id,
            node=node,
            srun_args=list(self.layout.srun_args.get(service, [])),
        )

    def _write(self) -> None:
        steps = {
            m.child.name: StepInfo(service, m.child.node, m.child.port)
            for service, pool in self.pools.items()
            for m in pool.members
            if isinstance(m.child, StepChild) and m.child.alive()
        }
        url_file = self.layout.redis_url_file
        run = SlurmRunFile(
            self.layout.job_id,
            self.cfg.run.run_id,
            redact_url(self.redis_url),
            str(url_file.resolve()) if url_file else None,
            steps,
        )
        write_slurm_file(self.out, run)

    def _stopped(self, client: redis.Redis) -> bool:
        try:
            return bool(client.exists(K.RunKeys(self.cfg.run.run_id).stop))
        except redis.RedisError:
            return False

    def _heal(self) -> None:
        now = time.monotonic()
        for service, pool in self.pools.items():
            for m in pool.crashed():
                delay = self.budgets[service].grant(now)
                what = f"{m.child.name} on {getattr(m.child, 'node', '?')} died (code {m.child.returncode})"
                if delay is None:
                    raise JobFailed(f"{what} after {self.budgets[service].spent()}: giving up:\n{m.child.tail()}")
                print(f"{what}; starting its step again in {delay:.0f}s", file=sys.stderr, flush=True)
                pool.restart_later(m, now + delay)

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
        self.out.mkdir(parents=True, exist_ok=True)
        client = redis.Redis.from_url(self.redis_url, socket_timeout=10)
        try:
            started = {s: self.pools[s].start_initial(self.layout.counts[s]) for s in SECTIONS}
            self._write()
            for s in SECTIONS:
                wait_ready(started[s], timeout_s=self.ready_s[s])
                self.pools[s].mark_ready()
            channel = ScaleChannel(client, K.RunKeys(self.cfg.run.run_id), self.pools)
            print(f"worker steps ready: {self.describe()}", flush=True)
            while not self._stopped(client):
                self._heal()
                try:
                    changed = channel.tick()
                except redis.RedisError as exc:  # Redis briefly away: the next turn retries
                    print(f"scale channel: {exc}", file=sys.stderr, flush=True)
                    changed = False
                if changed:
                    self._write()
                    print(f"worker steps: {self.describe()}", flush=True)
                time.sleep(1.0)
            print("the run ended: draining the worker steps", flush=True)
            return 0
        except KeyboardInterrupt:
            print("stopping: draining the worker steps", flush=True)
            return 0
        finally:
            self.shutdown()
            client.close()

    def describe(self) -> str:
        return "; ".join(
            f"{s}: " + ", ".join(f"{m.child.name}@{getattr(m.child, 'node', '?')} {m.state}" for m in p.members)
            for s, p in self.pools.items()
        )

    def shutdown(self) -> None:
        """Drain every step; a SIGTERM meanwhile (the batch script's, or the job's end) does not cut
        it short (SIGINT does)."""
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        children = [(c, p.stop_timeout_s) for p in self.pools.values() for c in p.children()]
        for c, _ in children:
            c.terminate()
        for c, timeout_s in children:
            c.stop(timeout_s)
        self._write()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streamrl.slurm_workers", description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value, as given to every role")
    parser.add_argument("--generators", type=int, default=1)
    parser.add_argument("--gateways", type=int, default=1)
    parser.add_argument("--nodes", default="", help="the worker nodes, comma-separated (Slurm node names)")
    parser.add_argument("--job", default=os.environ.get("SLURM_JOB_ID"), help="the job (default SLURM_JOB_ID)")
    parser.add_argument("--generator-srun", default="", help="more srun options for each generator step")
    parser.add_argument("--gateway-srun", default="", help="more srun options for each gym-gateway step")
    parser.add_argument("--redis-url-file", type=Path, help="the file holding the run's Redis URL")
    parser.add_argument("--print-output-dir", action="store_true", help="only print the run's output folder")
    args = parser.parse_intermixed_args(argv)
    if args.print_output_dir:
        try:
            print(Path(load(RunConfig, args.config, args.overrides).run.output_dir).resolve())
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per /ready probe otherwise
    if not args.nodes:
        parser.error("--nodes is required")
    if not args.job:
        parser.error("no job: run inside a Slurm job, or give --job")
    if args.generators < 1 or args.gateways < 1:
        parser.error("a run needs at least one generator and one gym-gateway worker")
    layout = Layout(
        job_id=str(args.job),
        nodes=[n for n in args.nodes.split(",") if n],
        counts={"generator": args.generators, "gym-gateway": args.gateways},
        srun_args={"generator": shlex.split(args.generator_srun), "gym-gateway": shlex.split(args.gateway_srun)},
        redis_url_file=args.redis_url_file,
    )
    try:
        return SlurmWorkers(args.config, args.overrides, layout).run()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except (JobFailed, CannotStart) as exc:
        print(f"worker steps failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
