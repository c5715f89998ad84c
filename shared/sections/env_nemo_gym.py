"""The NeMo-Gym driver's section (``env.nemo_gym``), read by
`services.gym_gateway.envs.nemo_gym` (and by the trainer: ``backfill_failed_rollouts``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.sections.base import D, Section


class NemoGymSection(Section):
    """Driver for NeMo-Gym agents and resources servers (``env: nemo_gym`` rows)."""

    backfill_failed_rollouts: Annotated[
        bool, D("NeMo-RL name: a failed rollout becomes a zero-token placeholder (same as failure_policy: backfill)")
    ] = False
    agent_servers: Annotated[
        dict[str, str], D("agent server base URL by agent name (a row's agent_ref.name), e.g. http://127.0.0.1:16036")
    ] = msgspec.field(default_factory=dict)
    head_server_url: Annotated[
        str | None,
        D(
            "NeMo-Gym head server (e.g. http://127.0.0.1:11000): agents missing from agent_servers, and their "
            "resources servers, are found in its global config"
        ),
    ] = None
    default_agent: Annotated[str | None, D("agent for rows without agent_ref")] = None
    connect_timeout_s: Annotated[
        float, D("connecting to an agent, head or resources server; the rollout deadline bounds the whole /run")
    ] = 10.0
    infra_failure_kinds: Annotated[
        list[str],
        D(
            "verify failure_kind values that fail the rollout as an infrastructure error (retried or backfilled); "
            "other failure kinds are trained masked"
        ),
    ] = msgspec.field(default_factory=list)
