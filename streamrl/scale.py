"""``streamrl scale generator=N gym-gateway=M``: change how many generators and gateway workers a
run has, on the platform it runs on.

    targets (parse_targets) --> backend.scale(targets, timeout_s) --> ScaleResult(before, after)

Backends (`ScaleBackend`, chosen with ``--backend``):
  * ``local``: a running ``streamrl up`` on this machine (`streamrl.scale_local`); its supervisor
    starts or drains child processes.
  * ``compose``: ``docker compose up -d --no-recreate --scale ...`` on the project's services
    (`streamrl.scale_compose`), checked through the Docker Engine API.
  * ``k8s``: the ``scale`` subresource of the generator and gateway Deployments through the
    kubernetes client (`streamrl.scale_k8s`).
  * ``slurm``: the worker job steps of a running Slurm job (deploy/slurm/streamrl.sbatch;
    `streamrl.scale_slurm`): new steps started, removed ones drained, checked with ``squeue``.

Every backend waits until the new workers are ready (or the deadline passes) and reports the
counts before and after. Removing workers always drains them: a generator leaves routing before it
stops, a gateway finishes or releases its tasks (see the services' SIGTERM handling), so the
trainer's next refit simply no longer waits for them and no task is lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Service names as in docker-compose.yml and the Kubernetes Deployments.
SERVICES = ("generator", "gym-gateway")
_ALIASES = {
    "generator": "generator",
    "generators": "generator",
    "gym-gateway": "gym-gateway",
    "gym_gateway": "gym-gateway",
    "gateway": "gym-gateway",
    "gateways": "gym-gateway",
}


class ScaleError(RuntimeError):
    """Scaling could not be done or confirmed; the message says what to fix."""


@dataclass(frozen=True)
class ScaleResult:
    before: dict[str, int]
    after: dict[str, int]

    def describe(self) -> str:
        return ", ".join(
            f"{s}: {self.before.get(s, 0)} -> {self.after.get(s, 0)}"
            for s in SERVICES
            if s in self.before or s in self.after
        )


class ScaleBackend(Protocol):
    name: str

    def counts(self) -> dict[str, int]:
        """Ready workers per service now."""
        ...

    def scale(self, targets: dict[str, int], timeout_s: float) -> ScaleResult:
        """Apply ``targets`` and wait until they are met (new workers ready, removed ones gone)."""
        ...


def parse_targets(args: Sequence[str]) -> dict[str, int]:
    """``["generator=2", "gym-gateway=3"]`` -> ``{"generator": 2, "gym-gateway": 3}``."""
    if not args:
        raise ScaleError("nothing to scale: give SERVICE=COUNT, e.g. generator=2 gym-gateway=3")
    targets: dict[str, int] = {}
    for arg in args:
        name, sep, value = arg.partition("=")
        service = _ALIASES.get(name.strip().lower())
        if not sep or service is None:
            raise ScaleError(f"{arg!r}: expected SERVICE=COUNT with SERVICE one of {', '.join(SERVICES)}")
        try:
            count = int(value)
        except ValueError:
            raise ScaleError(f"{arg!r}: the count must be a whole number") from None
        if count < 1:
            raise ScaleError(f"{arg!r}: a training run needs at least one {service} (count >= 1)")
        if service in targets and targets[service] != count:
            raise ScaleError(f"{service} is given twice with different counts")
        targets[service] = count
    return targets


def make_backend(
    name: str,
    *,
    run_dir: Path | None = None,
    redis_url: str | None = None,
    compose_file: Path | str = "docker-compose.yml",
    project_name: str | None = None,
    compose_bin: str | None = None,
    namespace: str | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
    selector: str | None = None,
    deployments: dict[str, str] | None = None,
    job: str | None = None,
) -> ScaleBackend:
    """The backend ``name`` with its options (each backend ignores the others' options)."""
    if name == "local":
        from streamrl.scale_local import LocalBackend

        if run_dir is None:
            raise ScaleError("the local backend needs the run's output folder (--run-dir)")
        return LocalBackend(run_dir, redis_url=redis_url)
    if name == "compose":
        from streamrl.scale_compose import ComposeBackend

        return ComposeBackend(compose_file, project_name=project_name, compose_bin=compose_bin)
    if name == "k8s":
        from streamrl.scale_k8s import KubernetesBackend

        return KubernetesBackend(
            namespace=namespace,
            kubeconfig=kubeconfig,
            context=context,
            selector=selector,
            deployments=deployments or {},
        )
    if name == "slurm":
        from streamrl.scale_slurm import SlurmBackend

        return SlurmBackend(job=job, run_dir=run_dir, redis_url=redis_url)
    raise ScaleError(f"--backend must be local, compose, k8s or slurm, not {name!r}")
