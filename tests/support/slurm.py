"""A real Slurm cluster over simulated hosts (`streamrl.bench.hosts`), for tests/slurm.

    munged (its own key and socket, on h0) --- slurmctld (h0) --- slurmd -N hN (one per host, in
    hN's namespace: it believes it is node hN, and every job step it starts runs on that host)

`SlurmCluster` writes a slurm.conf of its own under a temporary folder (state, spool, logs and pid
files there too, per node where a node needs its own), starts the daemons, waits until ``sinfo``
shows every node idle, and stops them by pid (the namespaces with the `SimCluster`). The clients
(sbatch, srun, squeue, scontrol, scancel) run inside a host's namespace with SLURM_CONF pointing
at the written config: `SlurmCluster.env` and `SlurmCluster.run`.

What this takes on a machine without systemd and cgroups inside the namespaces (``ip netns exec``
mounts a fresh /sys): no cgroup plugin in use (proctrack/linuxproc, task/none, no accounting) and
cgroup.conf naming cgroup/v1, whose set-up at slurmd's start touches no file system (autodetect
fails: no cgroup file system is mounted there); ``SlurmdParameters=config_overrides``, so nodes
may declare more CPUs than the machine has; one munged serves every host (its socket is a path on
the shared file system), named by ``AuthInfo=socket=``. Step I/O works across namespaces: srun
listens on the submitting host's address and each slurmd connects back to it.

Needs root (network namespaces, and slurmd runs job steps as their user) and Debian's slurm-wlm
and munge (scripts/setup_slurm.sh). `unavailable` says why not, else None.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.bench.hosts import SimCluster, available

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
CPUS_PER_NODE = 4  # declared, not real: config_overrides lets the steps of a job share 2 cores
PARTITION = "sim"


def unavailable() -> str | None:
    """None when a Slurm cluster can be brought up here; otherwise why not."""
    why = available()
    if why is not None:
        return why
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (bash scripts/setup_slurm.sh, as root)"
    return None


@dataclass
class Step:
    """One job step as ``squeue -s`` lists it."""

    step_id: str  # JOBID.STEP
    name: str
    nodes: str


@dataclass
class SlurmCluster:
    hosts: SimCluster
    folder: Path
    controller: str = "h0"
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    bringup_s: float = 0.0

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client needs on any host (besides the host's namespace)."""
        return {"SLURM_CONF": str(self.conf)}

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- bring-up ----------------------------------------------------------------------------------

    def write_config(self) -> None:
        f = self.folder
        for d in ("state", *(f"spool/{n}" for n in self.hosts.hosts)):
            (f / d).mkdir(parents=True, exist_ok=True)
        ctl = self.hosts[self.controller]
        nodes = [
            f"NodeName={h.name} NodeAddr={h.address} CPUs={CPUS_PER_NODE} RealMemory=4000 State=UNKNOWN"
            for h in self.hosts.hosts.values()
        ]
        conf = [
            "ClusterName=streamrl-sim",
            f"SlurmctldHost={ctl.name}({ctl.address})",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={f / 'munge.socket'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool'}/%n",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={f / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'slurmd-%n.log'}",
            "SlurmdParameters=config_overrides",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "InactiveLimit=0",
            "KillWait=60",  # a job's steps get SIGTERM, and this long to drain, before SIGKILL
            "MailProg=/bin/true",
            *nodes,
            f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
        ]
        self.conf.write_text("\n".join(conf) + "\n")
        (f / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        key = f / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)

    def start(self, timeout_s: float = 60.0) -> None:
        t0 = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.write_config()
        f, ctl = self.folder, self.hosts[self.controller]
        munged = [
            "munged",
            "--foreground",
            "--force",
            f"--socket={f / 'munge.socket'}",
            f"--key-file={f / 'munge.key'}",
            f"--pid-file={f / 'munged.pid'}",
            f"--log-file={f / 'munged.log'}",
            f"--seed-file={f / 'munged.seed'}",
        ]
        self.procs["munged"] = ctl.popen(munged, log=f / "munged.out")
        self._wait(lambda: (f / "munge.socket").exists(), "munged's socket", 20.0)
        self.procs["slurmctld"] = ctl.popen(["slurmctld", "-D", "-i"], env=self.env, log=f / "slurmctld.out")
        for h in self.hosts.hosts.values():
            self.procs[f"slurmd-{h.name}"] = h.popen(
                ["slurmd", "-D", "-N", h.name], env=self.env, log=f / f"slurmd-{h.name}.out"
            )
        self._wait(self._all_idle, "every node idle in sinfo", timeout_s)
        self.bringup_s = time.monotonic() - t0

    def _wait(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [name for name, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {timeout_s:.0f}s"
                raise RuntimeError(f"slurm cluster: {what}: {why}\n{self.logs()}")
            time.sleep(0.2)

    def _all_idle(self) -> bool:
        out = self.run(self.controller, ["sinfo", "-h", "-N", "-o", "%N %t"], timeout_s=20).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return set(states) == set(self.hosts.hosts) and all(s == "idle" for s in states.values())

    # -- clients -----------------------------------------------------------------------------------

    def run(
        self, host: str, argv: Sequence[str], timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client (or anything else) on ``host``, with this cluster's config (and ``env``)."""
        return self.hosts[host].run(argv, timeout_s=timeout_s, env={**os.environ, **self.env, **(env or {})})

    def check(self, host: str, argv: Sequence[str], timeout_s: float = 60.0, env: dict[str, str] | None = None) -> str:
        done = self.run(host, argv, timeout_s, env)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} on {host}: {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, host: str, argv: Sequence[str], env: dict[str, str] | None = None) -> str:
        """``sbatch --parsable ARGV`` on ``host`` (the job gets this environment, and ``env``); the
        job id."""
        return self.check(host, ["sbatch", "--parsable", *argv], env=env).strip().split(";")[0]

    def steps(self, job: str) -> list[Step]:
        """The job's steps that run now (the batch step included)."""
        out = self.check(self.controller, ["squeue", "-h", "-s", "-j", job, "-o", "%i|%j|%N"])
        return [Step(*line.split("|")) for line in out.splitlines() if line.strip()]

    def job_state(self, job: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED, ...) while slurmctld remembers it."""
        out = self.check(self.controller, ["scontrol", "show", "job", "-o", job])
        fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        return fields.get("JobState", "UNKNOWN")

    def job_field(self, job: str, name: str) -> str:
        out = self.check(self.controller, ["scontrol", "show", "job", "-o", job])
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv).get(name, "")

    def logs(self, n: int = 30) -> str:
        parts = []
        for log in sorted(self.folder.glob("*.log")) + sorted(self.folder.glob("*.out")):
            lines = log.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"== {log.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- tear-down ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, then stop the slurmds, slurmctld and munged by pid (SIGTERM, then
        SIGKILL past 20 s). The hosts' other processes go with the `SimCluster`."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.run(self.controller, ["scancel", "--full", f"--partition={PARTITION}"], timeout_s=20)
            except subprocess.TimeoutExpired:
                pass
        order = sorted(n for n in self.procs if n.startswith("slurmd-")) + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
