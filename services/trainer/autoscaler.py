"""The autoscaler in the trainer's control plane (``autoscale.enabled``): it feeds the policy
(`services.trainer.autoscale`) and carries out its decisions through the scaling backend that
``streamrl scale`` uses (local, compose, k8s, slurm: `streamrl.scale`).

    start:       build the backend (refused naming ``autoscale.backend`` when it cannot be had)
                 -> sample every SAMPLE_S: the tasks group's lag, gateway slots busy, requests
                    waiting in the generators' engines (registry heartbeats)
    after_step:  the step's record + the samples' means + the fleet's degraded generators
                 -> policy.decide -> (none in flight) one task: hold while the trainer refits or
                    validates -> backend.scale in a thread, new workers ready or the deadline
                    -> an `AutoscaleRecord` per decision (why, from what, to what, outcome)

A request in flight makes later steps' decisions wait: the policy is asked again once it answered.
Workers it adds join at the next weight version, ones it removes drain (`streamrl.scale`), so no
request needs the trainer to stop; none is sent during a refit or a validation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from services.trainer.autoscale import AutoscalePolicy, Decision, Signals
from shared import keys as K
from shared.config_error import ConfigError
from shared.fleet_health import fleet_health
from shared.records import AutoscaleRecord, StepRecord
from shared.registry import live_workers
from shared.run_config import RunConfig

if TYPE_CHECKING:
    from streamrl.scale import ScaleBackend

log = logging.getLogger(__name__)

SAMPLE_S = 1.0
SERVICE = {"generator": "generator", "gym_gateway": "gym-gateway"}  # role (config key) -> `streamrl scale` name
HOLD_POLL_S = 0.2


@dataclass
class Sample:
    tasks_lag: float
    gateway_utilization: float
    generator_queue: float


def build_backend(cfg: RunConfig) -> ScaleBackend:
    """The configured backend, or a ConfigError naming ``autoscale.backend`` and what is missing."""
    from streamrl.scale import ScaleError, make_backend

    a = cfg.autoscale
    try:
        return make_backend(
            a.backend,
            run_dir=Path(a.run_dir or cfg.run.output_dir),
            redis_url=cfg.redis.url,
            compose_file=a.compose_file,
            project_name=a.compose_project,
            namespace=a.k8s_namespace,
            selector=a.k8s_selector,
            job=a.slurm_job,
        )
    except (ScaleError, ImportError, OSError) as exc:
        raise ConfigError(f"autoscale.backend: {a.backend} cannot scale this run: {exc}") from exc


class Autoscaler:
    def __init__(
        self,
        cfg: RunConfig,
        redis: aioredis.Redis,
        keys: K.RunKeys,
        *,
        write_record: Callable[[AutoscaleRecord], None],
        busy: Callable[[], bool],
        backend: ScaleBackend | None = None,
    ) -> None:
        self.cfg = cfg.autoscale
        self.run_cfg = cfg
        self.redis = redis
        self.keys = keys
        self.write_record = write_record
        self.busy = busy
        self.backend = backend
        self.policy = AutoscalePolicy(self.cfg)
        self.slots_per_gateway = cfg.gym_gateway.max_concurrent_rollouts
        self.samples: list[Sample] = []
        self.records: list[AutoscaleRecord] = []
        self._sampler: asyncio.Task[None] | None = None
        self._applying: asyncio.Task[None] | None = None

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        redis: aioredis.Redis,
        keys: K.RunKeys,
        *,
        write_record: Callable[[AutoscaleRecord], None],
        busy: Callable[[], bool],
    ) -> Autoscaler | None:
        if not cfg.autoscale.enabled:
            return None
        return cls(cfg, redis, keys, write_record=write_record, busy=busy)

    def start(self) -> None:
        """Build the backend (a ConfigError when it cannot be had) and start sampling."""
        if self.backend is None:
            self.backend = build_backend(self.run_cfg)
        self._sampler = asyncio.create_task(self._sample_loop(), name="autoscale-sampler")
        log.info(
            "autoscaling through the %s backend: generators %d..%d, gateway workers %d..%d",
            self.backend.name,
            self.cfg.generator.min,
            self.cfg.generator.max,
            self.cfg.gym_gateway.min,
            self.cfg.gym_gateway.max,
        )

    async def aclose(self) -> None:
        for task in (self._sampler, self._applying):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # ---- signals --------------------------------------------------------------------------------

    async def _sample_loop(self) -> None:
        while True:
            try:
                self.samples.append(await self.sample())
            except Exception as exc:  # Redis away for a moment: the step's mean has one sample less
                log.warning("autoscaler: cannot sample the run's queues: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(SAMPLE_S)

    async def sample(self) -> Sample:
        lag = 0.0
        for group in await self.redis.xinfo_groups(self.keys.tasks):
            name = group.get("name", b"")
            if (name.decode() if isinstance(name, bytes) else name) == K.GATEWAYS_GROUP:
                lag = float(group.get("lag") or 0)
        gateways = await live_workers(self.redis, self.keys, "gym_gateway")
        generators = await live_workers(self.redis, self.keys, "generator")
        slots = self.slots_per_gateway * len(gateways)
        return Sample(
            tasks_lag=lag,
            gateway_utilization=sum(g.in_flight for g in gateways) / slots if slots else 0.0,
            generator_queue=sum(g.stats.get("waiting", 0.0) for g in generators) / len(generators)
            if generators
            else 0.0,
        )

    async def signals(self, record: StepRecord, counts: dict[str, int]) -> Signals:
        samples, self.samples = self.samples, []
        if not samples:
            samples = [await self.sample()]
        health = await fleet_health(self.redis, self.keys)
        timing = record.timing
        return Signals(
            step=record.step,
            wait_fraction=timing.wait_data_s / timing.step_s if timing.step_s > 0 else 0.0,
            counts=counts,
            tasks_lag=sum(s.tasks_lag for s in samples) / len(samples),
            gateway_utilization=sum(s.gateway_utilization for s in samples) / len(samples),
            generator_queue=sum(s.generator_queue for s in samples) / len(samples),
            staleness_mean=record.staleness.mean,
            degraded_generators=sum(h.state == "degraded" for h in health.values()),
            gateway_slots=self.slots_per_gateway,
        )

    # ---- decisions ------------------------------------------------------------------------------

    def after_step(self, record: StepRecord) -> None:
        """Called once per step, after its record and validations; never blocks the loop."""
        if self._applying is not None and not self._applying.done():
            log.debug("autoscaler: step %d: a request is still in flight", record.step)
            return
        self._applying = asyncio.create_task(self._decide_and_apply(record), name=f"autoscale-{record.step}")

    async def _decide_and_apply(self, record: StepRecord) -> None:
        assert self.backend is not None
        backend = self.backend
        try:
            ready = await asyncio.to_thread(backend.counts)
        except Exception as exc:
            log.warning("autoscaler: step %d: cannot read the worker counts: %s", record.step, exc)
            return
        counts = {role: ready.get(service, 0) for role, service in SERVICE.items()}
        signals = await self.signals(record, counts)
        decisions = self.policy.decide(signals)
        for decision in decisions:
            await self._apply(record.step, decision)

    async def _apply(self, step: int, d: Decision) -> None:
        assert self.backend is not None
        while self.busy():  # never during a refit or a validation
            await asyncio.sleep(HOLD_POLL_S)
        decided = time.time()
        log.info("autoscaler: step %d: %s %d -> %d: %s", step, d.role, d.before, d.after, d.reason)
        error: str | None = None
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self.backend.scale, {SERVICE[d.role]: d.after}, self.cfg.request_timeout_s)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error("autoscaler: %s %d -> %d failed: %s", d.role, d.before, d.after, error)
        record = AutoscaleRecord(
            step=step + 1,  # steps done: it follows step ``step``
            time=decided,
            role=d.role,
            before=d.before,
            after=d.after,
            reason=d.reason,
            signals=d.basis.as_dict(),
            outcome="failed" if error else "done",
            backend=self.backend.name,
            apply_s=round(time.perf_counter() - t0, 3),
            error=error,
        )
        self.records.append(record)
        self.write_record(record)
