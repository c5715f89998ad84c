"""``GET /status``: the trainer's state as `shared.records.TrainerStatus`, read from its control
plane (state, step, buffer, groups in flight, pauses and why the trainer took one, the last step
record without its ledger, the last validation, live workers with each generator's health). Served by
`services.trainer.routes`; read by `streamrl status` and the live display of `streamrl up`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from shared.fleet_health import fleet_health
from shared.records import TrainerStatus, WorkerSummary
from shared.registry import live_workers

if TYPE_CHECKING:
    from services.trainer.control_plane import ControlPlane


async def trainer_status(control: ControlPlane) -> TrainerStatus:
    gens = await live_workers(control.redis, control.keys)
    generators = [w for w in gens if w.kind == "generator"]
    health = await fleet_health(control.redis, control.keys, heartbeats=generators, record=False)  # a GET: no writes
    return TrainerStatus(
        run_id=control.cfg.run.run_id,
        state=control.state,
        error=control.error,
        step=control.step,
        max_num_steps=control.cfg.grpo.max_num_steps,
        weight_version=control.weight_version,
        buffer_depth={str(k): v for k, v in control.buffer.depth_by_target().items()},
        pending_groups=control.buffer.pending_groups(),
        in_flight_groups={str(k): v for k, v in control.scheduler.in_flight_by_target().items()},
        evicted_total=control.buffer.evicted_total,
        cancelled_rollouts_total=control.intake.cancelled_total,
        early_stopped=control.early_stopped,
        pause=await control.pause.reasons(),
        pause_detail=control.infra.detail,
        last=control.last_record.without_ledger() if control.last_record else None,
        last_validation=control.validation.last,
        workers=[
            WorkerSummary(
                id=w.worker_id,
                kind=w.kind,
                state=w.state,
                weight_version=w.weight_version,
                in_flight=w.in_flight,
                health=h.state if (h := health.get(w.worker_id)) else None,
                health_reason=h.reason if h else None,
            )
            for w in gens
        ],
        uptime_s=time.time() - control.started_at,
    )
