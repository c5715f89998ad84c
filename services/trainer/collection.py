"""Collection: how the control plane gets each step's data, and what it waits for.

    issue(step):            top up every target of the window [step, step + L] to N groups, in
                            flight or staged (nothing while a pause stops task issue)
    wait_for_batch(step):   sample N usable groups; stale ones are evicted (their prompts given
                            back to the scheduler, their ids kept for the step record, their
                            entries acked with the step's once a checkpoint covers it), and the
                            window is topped up while the step is short (after evictions, or an
                            issue a pause held back)
    lookahead_barrier(s0):  at start-up and resume, wait for complete batches of targets s0 and
                            s0 + 1 (when the lag allows it)
    hold_while_paused():    a user pause holds the run at a step boundary
    trained(step, sample, training):  the step's training, inside its trajectories' consumed spans

Traces (`services.trainer.tracing_spans`, while ``tracing.enabled``): every task issued opens its
trajectory's trace; a trajectory's trace ends in the step that trains it, or where it is evicted
(stale, or filtered by dynamic sampling) with the reason.

With dynamic sampling every wait also takes the groups the buffer filtered (rewards all tie): their
ids are in the ledger, their entries are acked with the step's once a checkpoint covers it, they
go to the next batch's ``SampleResult.filtered`` (the step record), and their prompts count as
used; the window's top-up issues new prompts in their place. A wait that is still short once the
groups judged since the previous step exceed ``grpo.dynamic_sampling_max_gen_batches`` generation
batches (``batch_multiplier x num_prompts_per_step`` groups each) fails the run loudly, as
NeMo-RL's does, instead of generating for ever on prompts that are all solved or all failed.

Every wait wakes when the intake stages a group (or after at most WAIT_S), raises the intake's
failure at once, and fails loudly after ``trainer.data_timeout_s`` without data, a deadline that
does not run while the run is paused by the user (gateways launch nothing then). Owned by the
control plane, which wires the scheduler, buffer and intake it shares with the rest of the trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.trainer import tracing_spans
from services.trainer.buffer import Group, ReplayBuffer, SampleResult
from services.trainer.intake import RunFailed, TrajectoryIntake
from services.trainer.scheduler import Scheduler
from services.trainer.step_record import dynamic_sampling_stats
from shared.pause import PauseControl
from shared.protocol import Task
from shared.records import DynamicSamplingStats
from shared.run_config import RunConfig
from shared.streams import StreamClient

log = logging.getLogger(__name__)

T = TypeVar("T")

WAIT_S = 1.0  # longest sleep of a waiting loop between checks


class DataDeadline:
    """``trainer.data_timeout_s`` for one wait, not counting time the run is held by a pause (user,
    infrastructure failures); ``on_hold`` is told whenever the wait becomes (True) or stops being
    (False) a hold."""

    def __init__(self, timeout_s: float, pause: PauseControl, on_hold: Callable[[bool], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.pause = pause
        self.on_hold = on_hold
        self.at = time.monotonic() + timeout_s
        self.held = False

    async def passed(self) -> bool:
        held = bool(await self.pause.holding())
        if held != self.held and self.on_hold is not None:
            self.on_hold(held)
        self.held = held
        if held:
            self.at = time.monotonic() + self.timeout_s
            return False
        return time.monotonic() > self.at


class Collector:
    def __init__(
        self,
        cfg: RunConfig,
        streams: StreamClient,
        scheduler: Scheduler,
        buffer: ReplayBuffer,
        intake: TrajectoryIntake,
        pause: PauseControl,
        *,
        hold_acks: Callable[[list[str]], None],
        tasks_issued: Callable[[list[Task]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.streams = streams
        self.scheduler = scheduler
        self.buffer = buffer
        self.intake = intake
        self.pause = pause
        self.hold_acks = hold_acks  # acknowledge these entries once a checkpoint covers this step
        self.tasks_issued = tasks_issued  # a hook called after every publish of training tasks
        self.evicted_ids: list[str] = []  # task ids evicted during the last wait_for_batch
        self.filtered: list[Group] = []  # groups dynamic sampling filtered since the last batch was taken

    async def hold_while_paused(self, on_pause: Callable[[], None]) -> None:
        """Return once no pause that holds the run (user, infrastructure failures) is active;
        ``on_pause`` is called first if one is."""
        paused = False
        while await self.pause.holding():
            if not paused:
                paused = True
                on_pause()
            await self.intake.wait(WAIT_S / 2)

    async def issue(self, step: int) -> None:
        if await self.pause.stops_task_issue():
            return
        g = self.cfg.grpo
        window = self.scheduler.window(step, g.max_num_steps)
        tasks = self.scheduler.plan(step, g.max_num_steps, {t: self.buffer.count_usable(t) for t in window})
        if not tasks:
            return
        try:
            with tracing_spans.issued(tasks):  # each task carries its trace's context
                await self.streams.publish_many(self.streams.keys.tasks, tasks)
        except Exception:
            self.scheduler.unissue(tasks)
            raise
        if self.tasks_issued is not None:
            self.tasks_issued(tasks)
        log.info(
            "issued %d tasks (%d groups) for targets %s",
            len(tasks),
            len(tasks) // g.num_generations_per_prompt,
            sorted({t.target_step for t in tasks}),
        )

    async def trained(self, step: int, sample: SampleResult, training: Awaitable[T]) -> T:
        """``training`` (the step's learner call on ``sample``) awaited inside the trajectory.consumed
        spans of the batch's trajectories (`services.trainer.tracing_spans`; nothing while tracing is off)."""
        with tracing_spans.consumed(step, sample):
            return await training

    async def wait_for_batch(self, step: int, on_hold: Callable[[bool], None] | None = None) -> SampleResult:
        """The step's batch once its groups are in. A pause that lands while it waits closes the
        launch gate, so the step may wait for rollouts that start only after the resume:
        ``on_hold`` is told whenever the wait becomes (True) or stops being (False) a hold."""
        n = self.cfg.grpo.num_prompts_per_step
        deadline = DataDeadline(self.cfg.trainer.data_timeout_s, self.pause, on_hold)
        self.evicted_ids = []
        while True:
            self.intake.raise_if_failed()
            self._take_filtered(step)
            sample = self.buffer.sample(step, n)
            if sample.evicted:
                await self._evicted(step, sample.evicted)
            if sample.groups:
                sample.filtered, self.filtered = self.filtered, []
                return sample
            self._check_refill_cap(f"step {step}", targets=1)
            # Short: top the window up (after evictions, or after a pause held back an issue; a
            # no-op when every group is staged or in flight, or while a pause stops task issue).
            # Never after a successful sample: the groups just taken no longer count for this
            # step, and re-issuing them would produce a full batch that arrives too late for any step.
            await self.issue(step)
            if await deadline.passed():
                raise RunFailed(f"step {step}: no {n} usable groups within {self._timeout_hint()}")
            await self.intake.wait(WAIT_S)

    async def _evicted(self, step: int, groups: list[Group]) -> None:
        # Acknowledged with the step's trained entries, once a checkpoint covers the step (whose
        # record lists these ids): a crash before it delivers them again, to be judged anew.
        self.hold_acks([e for g in groups for e in g.entry_ids])
        tracing_spans.evicted(step, groups, max_age=self.buffer.max_age)
        for g in groups:  # never trained on: the prompt is used again
            self.scheduler.source.give_back(g.prompt_index)
            self.evicted_ids += [t.task_id for t in g.rows.values()]

    def _take_filtered(self, step: int) -> None:
        groups = self.buffer.take_filtered()
        if not groups:
            return
        tracing_spans.evicted(step, groups, "filtered: the group's rewards all tie (grpo.use_dynamic_sampling)")
        # Acknowledged with the step's entries once a checkpoint covers it (the ledger in that
        # checkpoint holds their ids). No give_back: the prompt was used; the scheduler sees the
        # target short and issues a new prompt at its next top-up.
        self.hold_acks([e for g in groups for e in g.entry_ids])
        self.filtered += groups
        log.info(
            "dynamic sampling filtered %d groups whose rewards all tie (%d since the last batch)",
            len(groups),
            len(self.filtered),
        )

    def dynamic_sampling_stats(self, sample: SampleResult) -> DynamicSamplingStats | None:
        """The step record's dynamic-sampling figures for a batch this collector returned."""
        g = self.cfg.grpo
        if not g.use_dynamic_sampling:
            return None
        return dynamic_sampling_stats(
            sample.filtered,
            num_prompts=g.num_prompts_per_step,
            groups_per_batch=self.scheduler.groups_per_target,
            filtered_total=self.buffer.filtered_total,
        )

    def _check_refill_cap(self, what: str, *, targets: int) -> None:
        """Fail once the groups judged for ``targets`` short batches exceed the refill cap."""
        g = self.cfg.grpo
        if not g.use_dynamic_sampling:
            return
        per_batch = self.scheduler.groups_per_target
        allowed = targets * (g.dynamic_sampling_max_gen_batches * per_batch - g.num_prompts_per_step)
        if len(self.filtered) > allowed:
            raise RunFailed(
                f"{what}: dynamic sampling filtered {len(self.filtered)} groups whose rewards all tie and the "
                f"batch is still short of {g.num_prompts_per_step} groups with signal after "
                f"{g.dynamic_sampling_max_gen_batches} generation batches of {per_batch} groups "
                "(grpo.dynamic_sampling_max_gen_batches); the prompts are all solved or all failed by the policy: "
                "raise grpo.batch_multiplier or grpo.num_generations_per_prompt, or revisit the data"
            )

    async def lookahead_barrier(self, s0: int, on_hold: Callable[[bool], None] | None = None) -> None:
        """Wait for complete batches of targets s0 and s0+1 (when the lag allows s0+1), so the
        first steps are not served by a buffer that was filled only for s0; ``on_hold`` as for
        `wait_for_batch`."""
        g = self.cfg.grpo
        n, lag = g.num_prompts_per_step, g.async_grpo.max_trajectory_age_steps
        targets = [s0] + ([s0 + 1] if lag > 0 and s0 + 1 < g.max_num_steps else [])
        deadline = DataDeadline(self.cfg.trainer.data_timeout_s, self.pause, on_hold)
        while not all(self.buffer.count_usable(t) >= n for t in targets):
            self.intake.raise_if_failed()
            self._take_filtered(s0)
            self._check_refill_cap(f"start-up (targets {targets})", targets=len(targets))
            await self.issue(s0)  # what a pause held back goes out once it ends (a no-op otherwise)
            if await deadline.passed():
                raise RunFailed(f"start-up: no complete batches for targets {targets} within {self._timeout_hint()}")
            await self.intake.wait(WAIT_S)
        log.info("lookahead barrier passed: complete batches staged for targets %s", targets)

    def _timeout_hint(self) -> str:
        return (
            f"{self.cfg.trainer.data_timeout_s:.0f}s (trainer.data_timeout_s); staged "
            f"{self.buffer.depth_by_target()}, in flight {self.scheduler.in_flight_by_target()}"
        )
