"""The gym gateway's sections: its server and deadlines (``gym_gateway``) and the environment
settings common to every driver (``env``), with each driver's own section from its module
(``env.nemo_gym``, ``env.openhands``, ``env.swe``).

Read by the gym gateway (`services.gym_gateway`) and its environments; the trainer reads the
environment of rows that name none (``env.name``), how failed, flagged and rewritten rollouts are
trained (`backfills_failures`, ``should_mask_flagged_samples``, ``on_prefix_break``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.sections.base import D, Section
from shared.sections.env_nemo_gym import NemoGymSection
from shared.sections.env_openhands import OpenHandsSection
from shared.sections.env_swe import SweSection


class GatewaySection(Section):
    host: Annotated[str, D("bind address of the session proxy")] = "127.0.0.1"
    port: Annotated[int, D("port of the first gateway worker; 0: any free port")] = 8200
    num_workers: Annotated[int, D("gateway processes started by `streamrl up`")] = 1
    max_concurrent_rollouts: Annotated[int, D("rollouts one worker runs at once")] = 64
    rollout_timeout_s: Annotated[float, D("deadline of one rollout")] = 600.0
    reclaim_idle_s: Annotated[float, D("take over tasks a dead worker left pending this long")] = 900.0
    request_timeout_s: Annotated[float, D("deadline of one model call through the proxy")] = 300.0
    max_failovers: Annotated[int, D("other generators a session's call may move to when its generator is gone")] = 2
    generator_wait_s: Annotated[
        float, D("how long a new session waits for a serving generator before its rollout fails as infra")
    ] = 30.0
    drain_timeout_s: Annotated[
        float, D("at SIGTERM or the run's end, deadline for running rollouts to finish; the rest go back to the group")
    ] = 30.0
    release_margin_s: Annotated[
        float,
        D(
            "time past drain_timeout_s to release the rollouts still running to the group before the server "
            "shuts down anyway"
        ),
    ] = 5.0


class EnvSection(Section):
    name: Annotated[str, D("environment used for tasks whose row names none")] = "tool_calc"
    failure_policy: Annotated[
        Literal["fail_fast", "retry", "backfill"],
        D(
            "rollout failed for an infrastructure reason (sandbox, timeout, transport, generator gone): stop the "
            "run; retry it up to max_rollout_retries times, then stop; or train a zero-token placeholder"
        ),
    ] = "fail_fast"
    max_rollout_retries: Annotated[
        int, D("extra attempts of an infrastructure-failed rollout (failure_policy: retry)")
    ] = 2
    on_prefix_break: Annotated[
        Literal["mask", "new_sample"],
        D(
            "a rollout whose agent rewrote its token history: keep it out of the loss (baselines only), or train "
            "the turns from the break on as a new sample with the rollout's advantage"
        ),
    ] = "mask"
    on_tool_call_error: Annotated[
        Literal["observe", "end"],
        D(
            "a tool call the model wrote that cannot be used (not valid JSON, no name, bad arguments, an unclosed "
            "tag, an unknown tool): the agent gets an error observation and goes on, or the rollout ends as the "
            "policy failure tool_call_<reason> (truncated, reward 0, turns kept). Counted per reason either way"
        ),
    ] = "observe"
    max_turns: Annotated[int, D("cap on model calls per rollout")] = 8
    should_mask_flagged_samples: Annotated[
        bool,
        D(
            "rollouts the environment flags (mask_sample) are kept out of the loss but count in baselines; "
            "false: the flag is not carried at all"
        ),
    ] = True
    nemo_gym: NemoGymSection = msgspec.field(default_factory=NemoGymSection)
    openhands: OpenHandsSection = msgspec.field(default_factory=OpenHandsSection)
    swe: SweSection = msgspec.field(default_factory=SweSection)


def backfills_failures(env: EnvSection) -> bool:
    """Whether an infrastructure-failed rollout is trained on as a zero-token placeholder:
    ``env.failure_policy: backfill``, or NeMo-RL's ``env.nemo_gym.backfill_failed_rollouts``."""
    return env.failure_policy == "backfill" or env.nemo_gym.backfill_failed_rollouts
