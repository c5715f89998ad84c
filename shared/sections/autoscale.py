"""The autoscaler's section (``autoscale``): which backend sizes the run, the bounds of each role,
and the policy's thresholds. Off by default.

Read by the trainer (`services.trainer.autoscale`, the policy; `services.trainer.autoscaler`, which
asks the backend) and by ``streamrl up``, which refuses bounds its own backend cannot hold (more
generators than the node has device slots for). `check_autoscale` holds the checks every service
runs (`shared.run_config.RunConfig.check`): bounds that cannot hold are refused naming the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from shared.config_error import ConfigError
from shared.sections.base import D, Section

if TYPE_CHECKING:
    from shared.run_config import RunConfig

AutoscaleBackend = Literal["local", "compose", "k8s", "slurm"]


class RoleBounds(Section):
    min: Annotated[int, D("fewest workers of this role the autoscaler keeps")] = 1
    max: Annotated[int, D("most workers of this role the autoscaler asks for")] = 4


class AutoscaleSection(Section):
    enabled: Annotated[bool, D("size the run's generators and gateway workers from what the trainer waits for")] = False
    backend: Annotated[
        AutoscaleBackend, D("the `streamrl scale` backend it asks: local (streamrl up), compose, k8s or slurm")
    ] = "local"
    generator: Annotated[RoleBounds, D("bounds of the generator count")] = msgspec.field(default_factory=RoleBounds)
    gym_gateway: Annotated[RoleBounds, D("bounds of the gateway worker count")] = msgspec.field(
        default_factory=RoleBounds
    )
    scale_up_wait_fraction: Annotated[
        float, D("steps that waited for data more than this fraction of their time, on average, are starved")
    ] = 0.05
    scale_down_wait_fraction: Annotated[
        float, D("a step that waited less than this fraction of its time counts toward a scale-down")
    ] = 0.02
    up_after_steps: Annotated[int, D("steps whose mean wait decides a scale-up")] = 2
    down_after_steps: Annotated[
        int, D("steps that must each wait under scale_down_wait_fraction before a scale-down")
    ] = 6
    cooldown_steps: Annotated[int, D("steps after a change of a role before that role changes again")] = 2
    max_gateway_utilization: Annotated[
        float, D("a scale-down of gateways keeps the busy fraction of the remaining slots below this")
    ] = 0.75
    starved_memory_steps: Annotated[
        int, D("a count that starved the trainer within this many steps is not scaled down to again")
    ] = 50
    request_timeout_s: Annotated[float, D("deadline of one request to the backend (new workers ready)")] = 900.0
    run_dir: Annotated[str | None, D("local backend: the `streamrl up` run folder (default run.output_dir)")] = None
    compose_file: Annotated[str, D("compose backend: the compose file")] = "docker-compose.yml"
    compose_project: Annotated[str | None, D("compose backend: the project name")] = None
    k8s_namespace: Annotated[str | None, D("k8s backend: the namespace (default: the pod's own)")] = None
    k8s_selector: Annotated[str | None, D("k8s backend: label selector of the run's workloads")] = None
    slurm_job: Annotated[str | None, D("slurm backend: the job id (default SLURM_JOB_ID)")] = None


ROLES = ("generator", "gym_gateway")  # config keys; `streamrl.scale` names them generator, gym-gateway


def check_autoscale(cfg: RunConfig) -> None:
    """Bounds that cannot hold, refused naming the key (also when autoscaling is off: a config that
    turns it on later should not then fail on a number written long before)."""
    a = cfg.autoscale
    counts = {"generator": cfg.generator.num_workers, "gym_gateway": cfg.gym_gateway.num_workers}
    for role in ROLES:
        b: RoleBounds = getattr(a, role)
        if b.min < 1:
            raise ConfigError(f"autoscale.{role}.min must be >= 1 (a run needs at least one {role}), not {b.min}")
        if b.min > b.max:
            raise ConfigError(f"autoscale.{role}.min ({b.min}) is above autoscale.{role}.max ({b.max})")
        if a.enabled and not b.min <= counts[role] <= b.max:
            raise ConfigError(
                f"{role}.num_workers ({counts[role]}) is outside autoscale.{role}.min..max ({b.min}..{b.max}): "
                "a run starts within its bounds"
            )
    if not 0.0 <= a.scale_down_wait_fraction < a.scale_up_wait_fraction < 1.0:
        raise ConfigError(
            "autoscale.scale_down_wait_fraction must be >= 0 and below autoscale.scale_up_wait_fraction, itself "
            f"below 1 (got {a.scale_down_wait_fraction} and {a.scale_up_wait_fraction})"
        )
    for key in ("up_after_steps", "down_after_steps"):
        if getattr(a, key) < 1:
            raise ConfigError(f"autoscale.{key} must be >= 1")
    if a.cooldown_steps < 0 or a.starved_memory_steps < 0:
        raise ConfigError("autoscale.cooldown_steps and autoscale.starved_memory_steps must be >= 0")
    if not 0.0 < a.max_gateway_utilization <= 1.0:
        raise ConfigError("autoscale.max_gateway_utilization must be in (0, 1]")
    if a.request_timeout_s <= 0:
        raise ConfigError("autoscale.request_timeout_s must be > 0")
