"""The run-wide sections: the run's name and folder (``run``), Redis (``redis``), control-plane
auth (``auth``) and how ``streamrl up`` heals a job (``supervisor``).

Every service reads ``run``, ``redis`` and ``auth`` (`shared.service_cli`, each service's app);
``supervisor`` is read by ``streamrl up`` (`streamrl.supervisor`, `streamrl.restarts`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from shared.sections.base import D, Section


class RunSection(Section):
    run_id: Annotated[str, D("name of the run; all Redis keys live under streamrl:{run_id}:")] = "default"
    output_dir: Annotated[str, D("folder for metrics, weights, checkpoints and logs")] = "runs/default"
    seed: Annotated[int, D("seed for data order, sampling and initialisation")] = 42


class RedisSection(Section):
    url: Annotated[str | None, D("Redis 7+/Valkey URL (env REDIS_URL); null: `streamrl up` embeds Valkey")] = None
    embedded_appendfsync: Annotated[
        Literal["always", "everysec"],
        D(
            "the embedded Valkey keeps an append-only file and is restarted on it if it dies; always: nothing "
            "acknowledged is lost on a kill -9 (slower writes), everysec: up to a second of writes may be"
        ),
    ] = "everysec"


class SupervisorSection(Section):
    """How `streamrl up` heals a job on one machine."""

    max_restarts: Annotated[
        int,
        D(
            "restarts of one service (a generator or gateway worker, the trainer, the embedded Valkey) within "
            "restart_window_s before the job fails; 0: the first crash fails it"
        ),
    ] = 3
    restart_window_s: Annotated[float, D("window in which max_restarts counts")] = 600.0
    restart_backoff_s: Annotated[
        float, D("delay before the first restart in the window, doubled for each further one (at most 60 s)")
    ] = 1.0
    generator_ready_timeout_s: Annotated[
        float,
        D(
            "how long a generator `streamrl up` starts (or restarts, or scales out) may take to answer /ready "
            "(its engine loads the model) before the job fails"
        ),
    ] = 600.0
    gateway_ready_timeout_s: Annotated[
        float,
        D(
            "how long a gym gateway worker `streamrl up` starts (or restarts, or scales out) may take to answer "
            "/ready before the job fails"
        ),
    ] = 120.0


class AuthSection(Section):
    """Control-plane auth. The token itself comes only from env STREAMRL_API_TOKEN or STREAMRL_API_TOKEN_FILE."""

    allow_open_bind: Annotated[
        bool, D("let a service without an API token bind a non-loopback address (private networks only)")
    ] = False
    protect_agent_routes: Annotated[
        bool,
        D(
            "require the API token on the generator's /v1/* and the gateway's session routes "
            "(/sessions/*, /ng-rollout/*) too "
            "(agents send it as api_key)"
        ),
    ] = False
