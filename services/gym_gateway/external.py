"""External agents: any harness runs the tasks of environment ``external`` through the session API.

A user with an agent framework of their own (a loop over an OpenAI client, a company harness) writes
no driver. The trainer issues tasks whose ``env`` is ``external``; a gateway worker reads them like
any task, and each one waits for an agent to claim it:

    worker: read Task(env="external") -> wait_claim (waiting: NOT under the task's deadline)
    agent:  POST /sessions                  -> claim: the next waiting task of this worker
    worker: open the session on the proxy   -> rollout: the grant goes to the agent, the deadline starts
    agent:  <base_url>/chat/completions ... (any OpenAI client; the session proxy records every turn)
    agent:  POST /sessions/<id>/complete    -> complete: the outcome goes to the worker
    worker: assemble, publish + ack (atomic, only while it owns the task) -> end

The worker's rollout machinery stays the same as for every environment, so are its guarantees:
the task's deadline bounds the session from the claim on (past it the rollout fails as ``timeout``
and ``env.failure_policy`` decides: ``retry`` offers the task again in a fresh session), a trajectory
is published once, and its turns are the proxy's token-exact record. The claim waits outside the
deadline because agents may be fewer than the tasks a worker holds: a task is not failed for
waiting its turn. While waiting, the worker keeps the task's stream entry from being reclaimed
(`services.gym_gateway.worker.GatewayWorker.keep_external_tasks`); at drain the tasks no agent
claimed go back to the run at once (`close`).

A complete is taken once: a second one, or one after the session ended (deadline, drain), is
refused with a 409 naming why, and its answer comes only once the worker holds the outcome, so a
200 means the rollout ends with it (the checks every session gets still apply: NaN logprobs,
``env.on_tool_call_error: end``). The routes are `services.gym_gateway.external_routes`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec

from services.gym_gateway.envs.base import Outcome
from services.gym_gateway.proxy import unknown_session
from services.gym_gateway.session_client import SessionClient
from shared.http import HTTPError
from shared.protocol import SamplingParams, Task, TaskKind

EXTERNAL_ENV = "external"
MAX_REMEMBERED_ENDED = 4096  # ended sessions kept, so a late or second complete gets 409, not 404
T = TypeVar("T")


class SessionGrant(msgspec.Struct, kw_only=True):
    """The answer to ``POST /sessions``: one task for the agent, and where to run it."""

    session_id: str
    base_url: str  # the session's OpenAI base URL: give it to any OpenAI client
    complete_url: str  # POST the outcome here: ``{"reward": ...}``
    task_id: str
    group_id: str
    index_in_group: int
    kind: TaskKind
    instance: dict[str, Any]  # the task's row: what the agent is asked to do
    sampling: SamplingParams  # applied to every call (temperature, top_p when absent; max_tokens capped)
    max_turns: int  # env.max_turns, for agents that cap their own loop
    deadline_s: float  # seconds left to complete the session
    deadline_at: float  # the same deadline as a unix time


class CompleteRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /sessions/<id>/complete``: the rollout's outcome, as the agent scored it."""

    # JSON numbers decode finite (msgspec refuses an out-of-range one, naming the field), so the
    # trajectory can carry whatever is accepted here.
    reward: float
    mask_sample: bool = False  # "do not train on this rollout" (kept in its group's baseline)
    metrics: dict[str, float] = msgspec.field(default_factory=dict)

    def outcome(self) -> Outcome:
        status: Literal["ok", "env_flagged"] = "env_flagged" if self.mask_sample else "ok"
        return Outcome(reward=self.reward, status=status, metrics=dict(self.metrics), mask_sample=self.mask_sample)


class Completed(msgspec.Struct, kw_only=True):
    """The answer to a complete: the outcome is taken, and what the session recorded."""

    session_id: str
    task_id: str
    model_calls: int
    prefix_breaks: int


def _future() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


def _resolve(fut: asyncio.Future[T], value: T) -> None:
    if not fut.done():  # a caller that went away (cancelled) gets nothing
        fut.set_result(value)


@dataclass(eq=False)
class _External:
    """One attempt of an external task: waiting -> claimed -> serving, then ended (`end`)."""

    task: Task
    session_id: str
    state: Literal["waiting", "claimed", "serving"] = "waiting"
    claimed: asyncio.Future[None] = field(default_factory=_future)  # set by a claim
    granted: asyncio.Future[SessionGrant] = field(default_factory=_future)  # the claiming agent's answer
    completed: asyncio.Future[Outcome] = field(default_factory=_future)  # set by the complete
    settled: asyncio.Future[Completed] = field(default_factory=_future)  # the complete's answer


class ExternalSessions:
    """One gateway worker's external tasks and their sessions (see the module docstring). Built by
    the worker, which calls `wait_claim`, `rollout`, `end` and `close`; the routes call `claim`
    and `complete`. Everything runs on the worker's event loop: each step is atomic."""

    def __init__(self) -> None:
        self.sessions: dict[str, _External] = {}  # session id -> attempt, in the order tasks arrived
        self.ended: OrderedDict[str, str] = OrderedDict()  # session id -> why it ended
        self.closed = False

    @property
    def waiting(self) -> int:
        """External tasks waiting for an agent."""
        return sum(s.state == "waiting" for s in self.sessions.values())

    def holds(self, session_id: str) -> bool:
        """Whether the session is (or was) one of this worker's."""
        return session_id in self.sessions or session_id in self.ended

    async def wait_claim(self, task: Task, session_id: str) -> None:
        """Offer ``task`` to agents as session ``session_id``; return once one claimed it."""
        s = _External(task, session_id)
        self.sessions[session_id] = s
        await s.claimed

    async def claim(self) -> SessionGrant | None:
        """The oldest waiting task, once the worker opened its session; None when none waits.
        A 503 when the session could not open (e.g. no serving generator): the task fails as
        infrastructure and the failure policy decides."""
        if self.closed:
            return None
        # (one whose wait was just cancelled, by a drain, is no longer offered)
        s = next((s for s in self.sessions.values() if s.state == "waiting" and not s.claimed.done()), None)
        if s is None:
            return None
        s.state = "claimed"
        s.claimed.set_result(None)
        return await s.granted

    async def rollout(self, instance: dict[str, Any], llm: SessionClient, *, max_turns: int) -> Outcome:
        """The episode of a claimed task, in an environment's place (the worker's deadline bounds
        it): hand the open session to the agent that claimed it and wait for its complete."""
        s = self.sessions[llm.session_id]
        s.state = "serving"
        task = s.task
        _resolve(
            s.granted,
            SessionGrant(
                session_id=s.session_id,
                base_url=llm.base_url,
                complete_url=f"{llm.base_url.removesuffix('/v1')}/complete",
                task_id=task.task_id,
                group_id=task.group_id,
                index_in_group=task.index_in_group,
                kind=task.kind,
                instance=instance,
                sampling=task.sampling,
                max_turns=max_turns,
                deadline_s=llm.timeout_s,
                deadline_at=time.time() + llm.timeout_s,
            ),
        )
        outcome = await s.completed
        recorded = llm.proxy.session(llm.session_id)
        _resolve(
            s.settled,
            Completed(
                session_id=s.session_id,
                task_id=task.task_id,
                model_calls=recorded.calls,
                prefix_breaks=recorded.prefix_breaks,
            ),
        )
        return outcome

    async def complete(self, session_id: str, outcome: Outcome) -> Completed:
        """Hand ``outcome`` to the session's rollout; answered once the worker holds it."""
        s = self.sessions.get(session_id)
        if s is None or s.state != "serving":
            if session_id in self.ended:
                raise HTTPError(
                    409,
                    f"session {session_id!r} has ended ({self.ended[session_id]}); its rollout takes no other outcome",
                    param="session_id",
                )
            raise unknown_session(session_id)
        if s.completed.done():
            why = "its rollout has ended" if s.completed.cancelled() else "already completed"
            raise HTTPError(409, f"session {session_id!r}: {why}", param="session_id")
        s.completed.set_result(outcome)
        return await s.settled

    def end(self, session_id: str, why: str) -> None:
        """The attempt is over (``why``: "completed" or the failure): a claim or complete still
        waiting on it is answered with the reason, and later completes get a 409."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            return
        if s.state == "claimed" and not s.granted.done():
            s.granted.set_exception(HTTPError(503, f"the session of task {s.task.task_id} could not start: {why}"))
        taken = s.completed.done() and not s.completed.cancelled()  # a complete waits on its answer
        if taken and not s.settled.done():  # the outcome came as the rollout ended: it was not used
            s.settled.set_exception(HTTPError(409, f"session {session_id!r} ended first ({why})", param="session_id"))
        self.ended[session_id] = why
        while len(self.ended) > MAX_REMEMBERED_ENDED:
            self.ended.popitem(last=False)

    def close(self) -> list[str]:
        """Hand out no more tasks (the worker drains): the ids of the tasks no agent claimed."""
        self.closed = True
        return [s.task.task_id for s in self.sessions.values() if s.state == "waiting"]
