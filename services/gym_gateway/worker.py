"""The gateway's task worker: tasks stream in, trajectories out.

    XREADGROUP tasks (up to free slots) -> RUNNING rollout (session + environment, deadline)
        -> trajectory XADD -> task XACK                         (ack only after publishing)
    pending tasks of a dead worker --XAUTOCLAIM after reclaim_idle_s--> run here

At most ``max_concurrent_rollouts`` rollouts run at once; no new task is read while the launch gate
is closed (a pause reason in LAUNCH_GATE_REASONS) or all slots are busy, so backpressure stays in
the stream. Failures are classified: ``timeout`` (deadline), ``transport`` (model unreachable),
``model_refused`` (4xx from the model), ``env_error`` (the environment raised), ``unknown_env``;
each becomes a ``failed`` trajectory with its reason, and the trainer's failure policy decides.
On shutdown the worker stops reading, lets running rollouts finish within the drain limit and
leaves the rest pending for another worker to reclaim; nothing is acked that was not published.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import aiohttp
import msgspec

from shared import keys as K
from shared.protocol import Task, Trajectory
from shared.streams import Delivery, StreamClient
from services.gym_gateway.envs import UnknownEnvironment, get_env
from services.gym_gateway.envs.base import ChatClient, ModelRequestError, Outcome, TransportError
from services.gym_gateway.proxy import NoGenerator, Session, SessionProxy

log = logging.getLogger(__name__)


def assemble(task: Task, session: Session, outcome: Outcome | None, failure: str | None, gateway_id: str,
             started_at: float, *, carry_mask_flag: bool = True) -> Trajectory:
    """The trajectory record of a finished rollout. ``carry_mask_flag`` (env.should_mask_flagged_samples)
    off leaves ``mask_sample`` out of the record altogether."""
    versions = [t.weight_version for t in session.turns]
    return Trajectory(
        task_id=task.task_id, group_id=task.group_id, index_in_group=task.index_in_group,
        group_size=task.group_size, prompt_index=task.prompt_index, env=task.env, kind=task.kind,
        target_step=task.target_step, launch_version=min(versions) if versions else session.open_version,
        reward=0.0 if outcome is None else float(outcome.reward),
        status="failed" if failure else outcome.status, fallback_reason=failure,
        turns=session.turns,
        mask_sample=bool(outcome is not None and outcome.mask_sample) if carry_mask_flag else msgspec.UNSET,
        metrics={**(outcome.metrics if outcome else {}), "model_calls": float(session.calls),
                 "prefix_breaks": float(session.prefix_breaks)},
        gateway_id=gateway_id, started_at=started_at, finished_at=time.time(),
    )


class GatewayWorker:
    def __init__(self, streams: StreamClient, proxy: SessionProxy, http: aiohttp.ClientSession, *, session_base_url: str,
                 max_concurrent: int, reclaim_idle_s: float, max_turns: int, gateway_id: str,
                 carry_mask_flag: bool = True, env_cfg=None) -> None:
        self.streams = streams
        self.proxy = proxy
        self.http = http
        self.session_base_url = session_base_url.rstrip("/")
        self.max_concurrent = max_concurrent
        self.reclaim_idle_s = reclaim_idle_s
        self.max_turns = max_turns
        self.gateway_id = gateway_id
        self.carry_mask_flag = carry_mask_flag
        self.env_cfg = env_cfg
        self._envs: dict = {}  # one instance per environment name, built on first use
        self.active: dict[str, asyncio.Task] = {}
        self.completed = 0
        self.failed: dict[str, int] = {}
        self.stopping = False
        self._slot_free = asyncio.Event()

    async def gate_closed(self) -> bool:
        reasons = await self.streams.redis.hkeys(self.streams.keys.pause)
        return any(r.decode() in K.LAUNCH_GATE_REASONS for r in reasons)

    async def run(self) -> None:
        keys = self.streams.keys
        await self.streams.ensure_group(keys.tasks, K.GATEWAYS_GROUP)
        # Our own tasks from before a restart, then new ones. Tasks read while the gate closed
        # wait in ``held`` (still pending in the group) and launch only once it reopens.
        held = await self.streams.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=10_000, pending=True)
        next_reclaim = time.monotonic() + self.reclaim_idle_s / 4
        while not self.stopping:
            if await self.streams.redis.exists(keys.stop):
                log.info("run stopped; gateway %s leaves its loop", self.gateway_id)
                break
            free = self.max_concurrent - len(self.active)
            if free <= 0 or await self.gate_closed():
                self._slot_free.clear()
                try:
                    await asyncio.wait_for(self._slot_free.wait(), 0.2)
                except asyncio.TimeoutError:
                    pass
                continue
            if held:
                for d in held[:free]:
                    self._launch(d)
                held = held[free:]
                continue
            if time.monotonic() > next_reclaim:
                next_reclaim = time.monotonic() + self.reclaim_idle_s / 4
                held = await self.streams.reclaim(keys.tasks, K.GATEWAYS_GROUP, Task,
                                                  min_idle_ms=int(self.reclaim_idle_s * 1000), count=free)
                continue
            held = await self.streams.read_group(keys.tasks, K.GATEWAYS_GROUP, Task, count=free, block_ms=500)

    def _env(self, name: str):
        env = self._envs.get(name)
        if env is None:
            env = self._envs[name] = get_env(name, self.env_cfg)
        return env

    def _launch(self, d: Delivery[Task]) -> None:
        if d.msg.task_id in self.active:
            return
        t = asyncio.create_task(self._rollout(d), name=f"rollout-{d.msg.task_id}")
        self.active[d.msg.task_id] = t
        t.add_done_callback(lambda _t, tid=d.msg.task_id: self._done(tid))

    def _done(self, task_id: str) -> None:
        self.active.pop(task_id, None)
        self._slot_free.set()

    async def _rollout(self, d: Delivery[Task]) -> None:
        task = d.msg
        started = time.time()
        outcome: Outcome | None = None
        failure: str | None = None
        session = None
        # One session per attempt, URL-safe (task ids contain "/"); a reclaimed task gets a new one.
        session_id = f"{task.group_id}.{task.index_in_group}.{uuid.uuid4().hex[:8]}"
        try:
            session = await self.proxy.open(session_id, task.kind, task.sampling)
            env = self._env(task.env)
            client = ChatClient(f"{self.session_base_url}/sessions/{session_id}/v1", self.http,
                                timeout_s=task.deadline_s, sampling=task.sampling, session_id=session_id)
            outcome = await asyncio.wait_for(env.rollout(task.instance, client, max_turns=self.max_turns), task.deadline_s)
        except asyncio.TimeoutError:
            failure = "timeout"
        except NoGenerator as exc:
            failure = f"no_generator: {exc}"
        except UnknownEnvironment as exc:
            failure = f"unknown_env: {exc}"
        except TransportError as exc:
            failure = f"transport: {exc}"
        except ModelRequestError as exc:
            failure = f"model_refused: {exc}"
        except asyncio.CancelledError:
            self.proxy.close(session_id)
            raise  # shutting down: leave the task pending for a reclaim
        except Exception as exc:  # an environment bug or sandbox error: still an infra failure
            log.exception("rollout %s: environment error", task.task_id)
            failure = f"env_error: {type(exc).__name__}: {exc}"
        if session is None:
            session = Session(session_id, task.kind, task.sampling, "", "", -1)
        self.proxy.close(session_id)
        if failure:
            reason = failure.split(":")[0]
            self.failed[reason] = self.failed.get(reason, 0) + 1
            log.warning("rollout %s failed: %s", task.task_id, failure)
        traj = assemble(task, session, outcome, failure, self.gateway_id, started, carry_mask_flag=self.carry_mask_flag)
        try:
            await self.streams.publish(self.streams.keys.trajectories, traj)
            await self.streams.ack(self.streams.keys.tasks, K.GATEWAYS_GROUP, [d.entry_id])
        except Exception as exc:
            # Not acked: the task stays pending and is reclaimed; the trainer drops a duplicate.
            log.error("could not publish trajectory %s: %s", task.task_id, exc)
            return
        self.completed += 1

    async def drain(self, timeout_s: float) -> None:
        self.stopping = True
        if not self.active:
            return
        log.info("draining %d running rollouts (up to %.0fs)", len(self.active), timeout_s)
        done, pending = await asyncio.wait(list(self.active.values()), timeout=timeout_s)
        for t in pending:
            t.cancel()
        if pending:
            log.warning("%d rollouts left pending for reclaim", len(pending))
        await asyncio.gather(*pending, return_exceptions=True)
