"""The gateway's task worker: tasks stream in, trajectories out.

    XREADGROUP tasks (up to free slots) -> RUNNING rollout: a fresh session on the proxy, the
        task's environment (`envs.get_env`) handed a `SessionClient` on it, under the task's deadline
        -> failed for an infra reason and retries left? -> run again (fresh session, same task)
        -> trajectory XADD + task XACK, atomically, only while this worker owns the task
    pending tasks of a dead worker --XAUTOCLAIM after reclaim_idle_s--> run here
    env "external": the rollout first waits, outside its deadline, for an agent to claim it through
        the session API (`services.gym_gateway.external`); its entry is kept fresh meanwhile
    the run's stop key set -> `run` returns (the app then stops the service, draining first)
    traces (`shared.tracing`, when on): a rollout span, child of the task's context, holds the
        session's model calls and the trajectory.published span, whose context the trajectory carries
    drain (SIGTERM or the run's end): stop reading -> running rollouts finish within
        gym_gateway.drain_timeout_s -> the rest, and tasks read but not started (external ones no
        agent claimed included), are released to the group at once (re-added, old entry acked)

At most ``max_concurrent_rollouts`` rollouts run at once; no new task is read while the launch gate
is closed (`shared.pause.launch_gate_closed`) or all slots are busy, so backpressure stays in
the stream.

Failures are classified (`classify`). Infrastructure failures (``timeout``, ``transport``,
``no_generator``, ``sandbox``, ``env_error``, ``unknown_env``, and ``nan_generation_logprobs``: a
model call was answered with a generation logprob that is not a number, whatever the environment
made of the refused call, `services.gym_gateway.nonfinite_logprobs`) are retried here when
``env.failure_policy`` is ``retry`` (up to ``env.max_rollout_retries``, except ``unknown_env``),
then published as a zero-token ``failed`` placeholder carrying ``fallback_reason``: the trainer's
failure policy stops the run or backfills. Policy failures (``model_refused``: the model's request
was refused, e.g. its context is full; ``tool_call_<reason>``: the model wrote a tool call that
cannot be used and ``env.on_tool_call_error`` is ``end``, `services.gym_gateway.tool_call_errors`)
end the rollout as ``truncated`` with reward 0 and the turns so far. Counts per reason are kept
for metrics (`services.gym_gateway.metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import aiohttp
import msgspec

from services.gym_gateway.envs import UnknownEnvironment, get_env
from services.gym_gateway.envs.base import Environment, InfraError, ModelRequestError, Outcome, ToolCallFailed
from services.gym_gateway.external import EXTERNAL_ENV, ExternalSessions
from services.gym_gateway.nonfinite_logprobs import NAN_GENERATION_LOGPROBS
from services.gym_gateway.proxy import NoGenerator, Session, SessionProxy
from services.gym_gateway.session_client import SessionClient
from services.gym_gateway.tool_call_errors import failure_reason
from shared import keys as K
from shared import tracing
from shared.pause import launch_gate_closed
from shared.protocol import RolloutStatus, Task, Trajectory
from shared.sections.gateway import EnvSection
from shared.streams import Delivery, StreamClient
from shared.tasks import cancel_and_wait
from shared.wakeup import Wakeup

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0  # a drain's rollouts past its deadline: how long they get to stop


@dataclass(frozen=True)
class Failure:
    reason: str  # short label: metrics key and the head of fallback_reason
    message: str
    kind: Literal["infra", "policy"] = "infra"
    retryable: bool = True

    @property
    def fallback_reason(self) -> str:
        return f"{self.reason}: {self.message}" if self.message else self.reason


def classify(exc: BaseException) -> Failure:
    """Whose fault a rollout's exception is, and whether running it again can help."""
    if isinstance(exc, asyncio.TimeoutError):
        return Failure("timeout", "rollout deadline passed")
    if isinstance(exc, NoGenerator):
        return Failure("no_generator", str(exc))
    if isinstance(exc, UnknownEnvironment):
        return Failure("unknown_env", str(exc), retryable=False)
    if isinstance(exc, InfraError):
        return Failure(exc.reason, str(exc))
    if isinstance(exc, ModelRequestError):
        return Failure("model_refused", str(exc), kind="policy", retryable=False)
    if isinstance(exc, ToolCallFailed):
        return Failure(exc.reason, str(exc), kind="policy", retryable=False)
    return Failure("env_error", f"{type(exc).__name__}: {exc}")


def _tool_call_failure(session: Session) -> Failure:
    """``env.on_tool_call_error: end`` for an agent in another process, which went on past the
    bad tool calls its session recorded: the rollout ends as a policy failure all the same."""
    counts = session.tool_call_errors
    first = next(iter(counts))  # the first reason seen
    seen = ", ".join(f"{reason} x{n}" for reason, n in counts.items())
    return Failure(
        failure_reason(first),
        f"the model wrote tool calls that cannot be used ({seen})",
        kind="policy",
        retryable=False,
    )


def _nan_logprob_failure(session: Session) -> Failure:
    """A rollout whose session refused answers with NaN generation logprobs: its tokens cannot be
    trained, so it fails as an infrastructure failure (a rerun may get finite ones)."""
    n = session.nan_logprob_calls
    return Failure(NAN_GENERATION_LOGPROBS, f"{n} model call(s) answered generation logprobs that are not numbers")


def assemble(
    task: Task,
    session: Session,
    outcome: Outcome | None,
    failure: Failure | None,
    gateway_id: str,
    started_at: float,
    *,
    carry_mask_flag: bool = True,
    attempts: int = 1,
) -> Trajectory:
    """The trajectory record of a finished rollout. An infrastructure failure is a zero-token
    placeholder; a policy failure keeps its turns as a truncated, zero-reward rollout.
    ``carry_mask_flag`` (env.should_mask_flagged_samples) off leaves ``mask_sample`` out of the
    record altogether."""
    infra = failure is not None and failure.kind == "infra"
    turns = [] if infra else session.turns
    versions = [v for t in session.turns for v in t.versions()]  # of every token: the oldest bounds staleness
    status: RolloutStatus = "failed" if infra else "truncated"
    if failure is None:
        assert outcome is not None, "a rollout without a failure has an outcome"
        status = outcome.status
    return Trajectory(
        task_id=task.task_id,
        group_id=task.group_id,
        index_in_group=task.index_in_group,
        group_size=task.group_size,
        prompt_index=task.prompt_index,
        env=task.env,
        kind=task.kind,
        target_step=task.target_step,
        launch_version=min(versions) if versions else session.open_version,
        reward=0.0 if outcome is None else float(outcome.reward),
        status=status,
        fallback_reason=failure.fallback_reason if failure else None,
        failure_kind=failure.kind if failure else None,
        turns=turns,
        mask_sample=bool(outcome is not None and outcome.mask_sample) if carry_mask_flag else msgspec.UNSET,
        metrics={
            **(outcome.metrics if outcome else {}),
            "model_calls": float(session.calls),
            "prefix_breaks": float(session.prefix_breaks),
            "failovers": float(session.failovers),
            "attempts": float(attempts),
            **{f"tool_call_errors.{reason}": float(n) for reason, n in sorted(session.tool_call_errors.items())},
        },
        gateway_id=gateway_id,
        route_shape=None if infra else session.route_shape,
        started_at=started_at,
        finished_at=time.time(),
    )


class GatewayWorker:
    """Runs the tasks of one gateway worker (see the module docstring); built by the app's lifespan,
    which supervises `run` and calls `drain` at shutdown."""

    def __init__(
        self,
        streams: StreamClient,
        proxy: SessionProxy,
        http: aiohttp.ClientSession,
        *,
        env_cfg: EnvSection,
        session_base_url: str,
        max_concurrent: int,
        reclaim_idle_s: float,
        gateway_id: str,
    ) -> None:
        self.streams = streams
        self.proxy = proxy
        self.http = http
        self.env_cfg = env_cfg
        self.session_base_url = session_base_url.rstrip("/")
        self.max_concurrent = max_concurrent
        self.reclaim_idle_s = reclaim_idle_s
        self.gateway_id = gateway_id
        self.max_turns = env_cfg.max_turns
        self.carry_mask_flag = env_cfg.should_mask_flagged_samples
        self.end_on_tool_call_error = env_cfg.on_tool_call_error == "end"
        self.max_retries = env_cfg.max_rollout_retries if env_cfg.failure_policy == "retry" else 0
        self._envs: dict[str, Environment] = {}  # one instance per environment name, built on first use
        self.external = ExternalSessions()  # tasks of env "external", run by agents through the session API
        self.active: dict[str, asyncio.Task[None]] = {}
        self.deliveries: dict[str, Delivery[Task]] = {}  # task id -> the entry it came from (running)
        self.held: list[Delivery[Task]] = []  # read, not started yet (gate closed or no free slot)
        self.completed = 0
        self.failed: dict[str, int] = {}  # reason -> rollouts published as failed/truncated
        self.retried: dict[str, int] = {}  # reason -> attempts run again
        self.released = 0
        self.stopping = False
        self._slot_free = Wakeup()  # set when a rollout ends

    async def gate_closed(self) -> bool:
        return await launch_gate_closed(self.streams.redis, self.streams.keys)

    async def run(self) -> None:
        keys = self.streams.keys
        await self.streams.ensure_group(keys.tasks, K.GATEWAYS_GROUP)
        # Our own tasks from before a restart, then new ones. Tasks read while the gate closed
        # wait in ``held`` (still pending in the group) and launch only once it reopens.
        self.held = await self.streams.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=10_000, pending=True)
        next_reclaim = time.monotonic() + self.reclaim_idle_s / 4
        while not self.stopping:
            if await self.streams.redis.exists(keys.stop):
                log.info("run stopped; gateway %s leaves its loop", self.gateway_id)
                break
            free = self.max_concurrent - len(self.active)
            if free <= 0 or await self.gate_closed():
                self._slot_free.clear()
                await self._slot_free.wait(0.2)
                continue
            if self.held:
                for d in self.held[:free]:
                    self._launch(d)
                self.held = self.held[free:]
                continue
            if time.monotonic() > next_reclaim:
                next_reclaim = time.monotonic() + self.reclaim_idle_s / 4
                self.held = await self.streams.reclaim(
                    keys.tasks, K.GATEWAYS_GROUP, Task, min_idle_ms=int(self.reclaim_idle_s * 1000), count=free
                )
                continue
            got = await self.streams.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=free, block_ms=500)
            if self.stopping:  # read while a drain began: give them back rather than start them
                await self._release(got)
            else:
                self.held = got

    async def keep_external_tasks(self) -> None:
        """Keep the entries of the external tasks this worker holds from looking abandoned: one may
        wait for an agent longer than ``reclaim_idle_s``, and another worker must not take it over
        while this one is alive (a worker that dies stops touching, and its tasks are reclaimed)."""
        keys = self.streams.keys
        while True:
            await asyncio.sleep(self.reclaim_idle_s / 4)
            held = [d.entry_id for d in self.deliveries.values() if d.msg.env == EXTERNAL_ENV]
            await self.streams.touch(keys.tasks, K.GATEWAYS_GROUP, held)

    def _env(self, name: str) -> Environment:
        env = self._envs.get(name)
        if env is None:
            env = self._envs[name] = get_env(name, self.env_cfg)
        return env

    def _launch(self, d: Delivery[Task]) -> None:
        if d.msg.task_id in self.active:
            return
        task_id = d.msg.task_id
        t = asyncio.create_task(self._rollout(d), name=f"rollout-{task_id}")
        self.active[task_id] = t
        self.deliveries[task_id] = d
        t.add_done_callback(lambda _t: self._done(task_id))

    def _done(self, task_id: str) -> None:
        self.active.pop(task_id, None)
        self.deliveries.pop(task_id, None)
        self._slot_free.set()

    async def _rollout(self, d: Delivery[Task]) -> None:
        task = d.msg
        with tracing.active_span("rollout", tracing.context_of(task), tracing.task_attributes(task)) as span:
            traj = await self._run(task)
            tracing.set_attributes(span, tracing.trajectory_attributes(traj))
            await self._publish(d, traj)

    async def _run(self, task: Task) -> Trajectory:
        """The task's attempts (run again per ``env.failure_policy``), assembled into its trajectory."""
        started = time.time()
        attempt = 0
        while True:
            attempt += 1
            session, outcome, failure = await self._attempt(task)
            if failure is None or not failure.retryable or failure.kind != "infra" or attempt > self.max_retries:
                break
            self.retried[failure.reason] = self.retried.get(failure.reason, 0) + 1
            log.warning("rollout %s attempt %d failed (%s); retrying", task.task_id, attempt, failure.fallback_reason)
        if failure:
            self.failed[failure.reason] = self.failed.get(failure.reason, 0) + 1
            log.warning("rollout %s failed after %d attempt(s): %s", task.task_id, attempt, failure.fallback_reason)
        return assemble(
            task,
            session,
            outcome,
            failure,
            self.gateway_id,
            started,
            carry_mask_flag=self.carry_mask_flag,
            attempts=attempt,
        )

    async def _publish(self, d: Delivery[Task], traj: Trajectory) -> None:
        """Publish ``traj`` and ack its task at once, while this worker owns the task; a
        trajectory.published span whose context the trajectory carries to the trainer."""
        keys = self.streams.keys
        with tracing.span("trajectory.published", tracing.current(), {"streamrl.task_id": traj.task_id}) as span:
            tracing.stamp(traj, span)
            try:
                published = await self.streams.publish_and_ack(
                    keys.trajectories, traj, keys.tasks, K.GATEWAYS_GROUP, d.entry_id
                )
            except Exception as exc:
                # Not acked: the task stays pending and is reclaimed.
                log.error("could not publish trajectory %s: %s", traj.task_id, exc)
                tracing.set_attributes(span, {"streamrl.publish_error": f"{type(exc).__name__}: {exc}"})
                return
            if published is None:
                log.warning(
                    "rollout %s finished after its task was taken over by another worker; result dropped", traj.task_id
                )
                tracing.set_attributes(span, {"streamrl.publish_error": "the task was taken over by another worker"})
                return
        self.completed += 1

    async def _attempt(self, task: Task) -> tuple[Session, Outcome | None, Failure | None]:
        """One run of the task's environment in a fresh session (URL-safe id: task ids contain "/").
        An external task's session opens once an agent claimed it, and the agent plays the episode."""
        session_id = f"{task.group_id}.{task.index_in_group}.{uuid.uuid4().hex[:8]}"
        external = task.env == EXTERNAL_ENV
        session: Session | None = None
        outcome: Outcome | None = None
        failure: Failure | None = None
        try:
            if external:
                await self.external.wait_claim(task, session_id)
            session = await self.proxy.open(session_id, task.kind, task.sampling, env=task.env, trace=tracing.current())
            env = self.external if external else self._env(task.env)
            client = SessionClient(
                self.proxy,
                session_id,
                base_url=f"{self.session_base_url}/sessions/{session_id}/v1",
                http=self.http,
                timeout_s=task.deadline_s,
                sampling=task.sampling,
                end_on_tool_call_error=self.end_on_tool_call_error,
            )
            outcome = await asyncio.wait_for(
                env.rollout(task.instance, client, max_turns=self.max_turns), task.deadline_s
            )
            if self.end_on_tool_call_error and session.tool_call_errors:
                outcome, failure = None, _tool_call_failure(session)
        except asyncio.CancelledError:
            self.proxy.close(session_id)
            self.external.end(session_id, "the gateway worker stopped; the task goes back to the run")
            raise  # draining: the task is released by drain()
        except Exception as exc:
            failure = classify(exc)
            if failure.reason == "env_error":
                log.exception("rollout %s: environment error", task.task_id)
        self.proxy.close(session_id)
        if session is None:
            session = Session(session_id, task.kind, task.sampling, "", "", -1, env=task.env)
        if session.nan_logprob_calls:  # whatever the environment made of the refused call
            outcome, failure = None, _nan_logprob_failure(session)
        self.external.end(session_id, failure.fallback_reason if failure else "completed")
        return session, outcome, failure

    async def _release(self, deliveries: list[Delivery[Task]]) -> None:
        if not deliveries:
            return
        try:
            self.released += await self.streams.requeue(
                self.streams.keys.tasks,
                K.GATEWAYS_GROUP,
                deliveries,
                bump=lambda t: msgspec.structs.replace(t, attempt=t.attempt + 1),
            )
        except Exception as exc:  # Redis gone: they stay pending and are reclaimed later
            log.error("could not release %d tasks: %s; they stay pending for a reclaim", len(deliveries), exc)

    async def close_envs(self) -> None:
        """Stop what environments keep between rollouts (the OpenHands driver's warm runners)."""
        for env in self._envs.values():
            await env.aclose()

    async def drain(self, timeout_s: float) -> None:
        """Stop reading; let running rollouts finish within ``timeout_s``; release the rest, and
        tasks read but never started (external ones no agent claimed included), back to the group
        for another worker."""
        self.stopping = True
        held, self.held = self.held, []
        unclaimed = [self.deliveries[task_id] for task_id in self.external.close()]
        for d in unclaimed:  # waiting for an agent, not started: released at once with the held ones
            self.active[d.msg.task_id].cancel()
        await self._release(held + unclaimed)
        if not self.active:
            return
        log.info("draining %d running rollouts (up to %.0fs)", len(self.active), timeout_s)
        done, pending = await asyncio.wait(list(self.active.values()), timeout=timeout_s)
        unfinished = [self.deliveries[tid] for tid, t in list(self.active.items()) if t in pending]
        stuck = await cancel_and_wait(pending, timeout_s=STOP_TIMEOUT_S)
        for t in pending - stuck:
            if not t.cancelled():
                t.exception()  # retrieved: the rollout was stopped, its error does not matter
        if stuck:
            log.warning("drain: %d rollouts still running %.0fs after they were stopped", len(stuck), STOP_TIMEOUT_S)
        if unfinished:
            log.warning("drain: %d rollouts did not finish in %.0fs; releasing their tasks", len(unfinished), timeout_s)
            await self._release(unfinished)
