"""Which devices each process of a ``streamrl up`` job gets on this node.

On a multi-GPU node the trainer's ranks take the first ``trainer.nproc_per_node`` GPUs and the
generators are dealt the rest, each engine the ``vllm_cfg`` tensor x pipeline x data parallel
size of them, as its ``CUDA_VISIBLE_DEVICES`` (``generator.gpus`` names the generators' GPUs
explicitly instead; then the trainer's are left as the environment gives them). On a CPU node
with ``generator.cpu_cores_per_worker`` set, each generator is bound to its own cores
(``VLLM_CPU_OMP_THREADS_BIND``; vLLM's automatic binding puts every engine on the same cores).

A node with fewer GPUs than the trainer and one generator need is shared as it is (a warning
says so). A slot is held by a member for as long as its process lives, restarts included (a restarted
member keeps its environment); a new member takes the first free slot, and a scale-up beyond the
node's slots fails with what is held. Nothing is dealt when the node has neither.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.config_error import ConfigError
from shared.run_config import RunConfig
from streamrl.worker_pool import CannotStart

log = logging.getLogger(__name__)

GPU_ENV = "CUDA_VISIBLE_DEVICES"
CPU_ENV = "VLLM_CPU_OMP_THREADS_BIND"


class NoFreeDevices(CannotStart):
    """Every device slot of this node is held."""


@dataclass(frozen=True)
class DeviceLayout:
    env_var: str  # the variable each generator's slot is given as
    slots: tuple[str, ...]  # one value of env_var per generator that fits on this node
    trainer_env: dict[str, str] = field(default_factory=dict)

    def free_slot(self, held: Iterable[str], name: str) -> dict[str, str]:
        """The environment of the first slot not in ``held``."""
        taken = set(held)
        for slot in self.slots:
            if slot not in taken:
                return {self.env_var: slot}
        raise NoFreeDevices(
            f"{name} cannot start: all {len(self.slots)} device slot(s) of this node ({self.env_var}) are held "
            f"by running generators ({'; '.join(self.slots)})"
        )


def node_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """This process's GPUs: CUDA_VISIBLE_DEVICES when set, else every GPU nvidia-smi lists."""
    env = os.environ if environ is None else environ
    visible = env.get(GPU_ENV)
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (all of them where the platform cannot say)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return sorted(affinity(0)) if affinity is not None else list(range(os.cpu_count() or 1))


def plan_devices(cfg: RunConfig, gpus: list[str], cores: list[int]) -> DeviceLayout | None:
    """The layout for ``gpus`` (this node's) or, without any, ``cores`` (this process's affinity)."""
    g = cfg.generator
    per_engine = cfg.policy.generation.vllm_cfg.devices_per_engine()
    if g.gpus is not None:
        return DeviceLayout(GPU_ENV, _deal([d.strip() for d in g.gpus.split(",") if d.strip()], per_engine, "gpus"))
    if gpus:
        trainer_n = cfg.trainer.nproc_per_node
        if len(gpus) < trainer_n + per_engine:
            log.warning(
                "this node has %d GPU(s), fewer than the trainer's %d (trainer.nproc_per_node) and one generator's "
                "%d (policy.generation.vllm_cfg parallel sizes): every process sees all of them and they share "
                "(set generator.gpus to choose)",
                len(gpus),
                trainer_n,
                per_engine,
            )
            return None
        trainer_env = {GPU_ENV: ",".join(gpus[:trainer_n])}
        return DeviceLayout(GPU_ENV, _deal(gpus[trainer_n:], per_engine, "gpus"), trainer_env)
    n = g.cpu_cores_per_worker
    if n is None:
        return None
    if n % per_engine:
        raise ConfigError(
            f"generator.cpu_cores_per_worker ({n}) must be a multiple of the engine's ranks ({per_engine}: "
            "policy.generation.vllm_cfg parallel sizes)"
        )
    blocks = _deal([str(c) for c in sorted(cores)], n, "cpu_cores_per_worker")
    return DeviceLayout(CPU_ENV, tuple(_bind_spec(b.split(","), per_engine) for b in blocks))


def _deal(ids: list[str], per: int, key: str) -> tuple[str, ...]:
    if len(ids) < per:
        raise ConfigError(f"generator.{key}: {len(ids)} available, one generator needs {per}")
    return tuple(",".join(ids[i : i + per]) for i in range(0, len(ids) - per + 1, per))


def _bind_spec(cores: list[str], ranks: int) -> str:
    """vLLM's CPU binding: one core list per engine rank, ranks separated by '|'."""
    per = len(cores) // ranks
    return "|".join(",".join(cores[r * per : (r + 1) * per]) for r in range(ranks))
