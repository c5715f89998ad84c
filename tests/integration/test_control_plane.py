"""The trainer's control plane running its real loop (real Valkey, the torch learner on the tiny
model) against a generator and a gateway played through Redis as they speak the protocol: the
generator heartbeats and confirms every weight version; the gateway reads tasks (not while the
launch gate is closed) and answers each with a one-turn trajectory.

What a user of pause, resume and validation relies on, whatever the machine's speed:
* a pause before the first task holds the run (nothing is issued) without failing it;
* a pause at a step boundary holds the issue of the next step's tasks too, and a lag-0 run
  continues after the resume instead of stalling;
* time spent paused does not count against trainer.data_timeout_s;
* the last boundary holds too: a validation requested there runs before the run ends, and once it
  has ended a request is refused;
* a run that fails reports why, sets the stop key, and drops queued validations with the reason;
* a run stopped between checkpoints leaves the trajectories it trained since the last one
  unacknowledged, so a restart trains them again.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from services.gym_gateway.worker import Failure
from services.trainer.backends.base import NonFiniteGradient
from services.trainer.batch import StepBatch
from services.trainer.checkpoint import latest_checkpoint
from services.trainer.control_plane import ControlPlane
from services.trainer.intake import RunFailed
from services.trainer.learner import Learner
from services.trainer.refit import RefitError
from shared import keys as K
from shared.pause import PauseReason
from shared.records import LearnerMetrics, MeanMaxMin, TrainerState, ValidationRecord, read_records, step_records
from shared.tasks import cancel_and_wait
from tests.support.gradients import mlp_weight, poison_gradient
from tests.support.peers import Peers
from tests.support.trainer import control_plane, play, run_to_end, serving_app, stop_plane, trainer_config

pytestmark = pytest.mark.integration


class PausingLearner:
    """The real learner; when it finishes training step ``pause_after``, the user pauses the run
    (the pause is in Redis before the control plane reaches the step's boundary)."""

    def __init__(self, inner: Learner, control: ControlPlane, pause_after: int) -> None:
        self.inner, self.control, self.pause_after = inner, control, pause_after
        self.trained = 0

    async def start(self) -> None:
        await self.inner.start()

    async def train(self, batch: StepBatch) -> LearnerMetrics:
        metrics = await self.inner.train(batch)
        if self.trained == self.pause_after:
            await self.control.pause.pause(PauseReason.USER)
        self.trained += 1
        return metrics

    def export_weights(self, out_dir):
        self.inner.export_weights(out_dir)

    async def save(self, path):
        await self.inner.save(path)

    async def load(self, path):
        await self.inner.load(path)

    async def wait_saved(self):
        await self.inner.wait_saved()

    async def watch(self):
        await self.inner.watch()

    async def close(self):
        await self.inner.close()


# trainer.data_timeout_s of the tests that wait it out: the played peers, on this test's event loop,
# deliver a step's data well within it even when a loaded machine stalls the loop for seconds.
DATA_TIMEOUT_S = 5.0


async def _until(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _start(cfg, redis_url: str, *, pause_after: int | None = None):
    control = control_plane(cfg)
    if pause_after is not None:
        control.learner = control.checkpointer.learner = PausingLearner(control.learner, control, pause_after)
    return control, *await play(control, redis_url)


async def _stop(control: ControlPlane, peers: Peers, peer_task: asyncio.Task, run: asyncio.Task) -> None:
    await stop_plane(control, peers.redis, run, peer_task)


def _config(
    tmp_path,
    redis_url,
    tiny_model_dir,
    prefix: str,
    *,
    steps: int,
    lag: int,
    data_timeout_s: float,
    max_gen_kl_error: float | None = None,  # the played generator's logprobs are made up
):
    return trainer_config(
        tmp_path,
        redis_url,
        tiny_model_dir,
        prefix,
        grpo={"max_num_steps": steps, "async_grpo": {"max_trajectory_age_steps": lag}},
        trainer={"data_timeout_s": data_timeout_s, "refit_timeout_s": 60.0, "startup_timeout_s": 60.0},
        refit={"max_gen_kl_error": max_gen_kl_error},
        logger={"plot": False, "tensorboard": False},
    )


async def test_a_refit_that_delivered_other_weights_fails_the_run_naming_the_version(
    tiny_model_dir, redis_url, tmp_path
):
    """The played generator's logprobs are not the model's: to the trainer, a generator serving
    other weights than it published (garbage with no error anywhere, NeMo-RL #2895). The first step
    trained on rows of v0 checks them against refit.max_gen_kl_error (on by default) and the run
    fails, saying which version."""
    cfg = _config(
        tmp_path, redis_url, tiny_model_dir, "cp-fid", steps=3, lag=1, data_timeout_s=60.0, max_gen_kl_error=0.05
    )
    control, peers, peer_task, run = await _start(cfg, redis_url)
    try:
        with pytest.raises(
            RefitError, match=r"on the rows weight version 0 generated .* exceeds refit.max_gen_kl_error 0.05"
        ):
            await run_to_end(run, 120)
        assert control.state == TrainerState.FAILED and control.step == 0
    finally:
        await _stop(control, peers, peer_task, run)


async def test_a_nan_gradient_fails_the_run_naming_step_and_parameter_and_the_last_checkpoint_stays(
    tiny_model_dir, redis_url, tmp_path
):
    """policy.on_nonfinite_grad: fail (the default), a checkpoint after every step, a NaN in one
    parameter's gradient at step 1: the run fails saying the step and the parameter, and step 0's
    checkpoint is the latest (a restart resumes from the weights before the NaN)."""
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "cp-nan", steps=3, lag=0, data_timeout_s=60.0)
    cfg.checkpointing.save_period = 1
    control, peers, peer_task, run = await _start(cfg, redis_url)
    backend = control.learner.backend
    name = mlp_weight(backend)
    poison_gradient(backend, name, at_update=1)  # one update a step: step 1's
    try:
        said = rf"^step 1: gradient norm nan in update 1 of 1 of this step: .* on rank 0 in {re.escape(name)}$"
        with pytest.raises(NonFiniteGradient, match=said):
            await run_to_end(run, 120)
        assert control.state == TrainerState.FAILED and "step 1" in control.error and name in control.error
        ckpt_dir = control.checkpointer.ckpt_dir
        latest = latest_checkpoint(ckpt_dir)
        assert latest is not None and [p.name for p in ckpt_dir.glob("step_*")] == [latest.name]
        assert json.loads((latest / "meta.json").read_text())["step"] == 1  # the next step to run: step 0 done
        status = json.loads((ckpt_dir / "latest_checkpoint_status.json").read_text())
        assert status["step"] == 1 and status["path"] == str(latest) and status["run_finished"] is False
    finally:
        await _stop(control, peers, peer_task, run)


async def test_a_pause_before_the_first_task_holds_the_run_and_paused_time_is_not_a_data_timeout(
    tiny_model_dir, redis_url, tmp_path
):
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "cp-start", steps=1, lag=1, data_timeout_s=DATA_TIMEOUT_S)
    control = control_plane(cfg)
    epoch = await control.pause.pause(PauseReason.USER)  # paused before the trainer even started
    peers, peer_task, run = await play(control, redis_url)
    try:
        await _until(lambda: control.state == TrainerState.PAUSED, "the run held after its initial refit")
        assert control.weight_version == 0  # v0 was published and confirmed first
        await asyncio.sleep(1.5 * cfg.trainer.data_timeout_s)  # paused well past the data deadline
        assert not run.done() and control.state == TrainerState.PAUSED
        assert await control.redis.xlen(control.keys.tasks) == 0  # nothing issued while paused
        assert await control.pause.resume(PauseReason.USER, epoch)
        await run_to_end(run, 120)
        assert control.state == TrainerState.FINISHED and control.step == 1
    finally:
        await _stop(control, peers, peer_task, run)


async def test_a_run_whose_rollouts_mostly_fail_pauses_naming_the_failures_and_resumes_on_request(
    tiny_model_dir, redis_url, tmp_path
):
    """env.failure_policy: backfill, grpo.max_infra_failure_fraction 0.5: 3 of step 0's 4 rollouts
    fail for infrastructure reasons. The run pauses before training step 0 (reason
    infra_failures, gateways launch nothing), /status names the classes and counts, and POST
    /resume (`streamrl resume`) trains the held step and goes on with a new window."""
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "cp-infra", steps=2, lag=0, data_timeout_s=60.0)
    cfg.env.failure_policy = "backfill"
    cfg.grpo.max_infra_failure_fraction, cfg.grpo.infra_failure_window_steps = 0.5, 2
    control = control_plane(cfg)
    peers, peer_task, run = await play(control, redis_url)

    def failure(task):
        if task.target_step != 0 or (task.prompt_index % 2 and task.index_in_group == 0):
            return None
        return Failure("sandbox", "container gone") if task.prompt_index % 2 else Failure("transport", "reset")

    peers.gateway.failure = failure
    app = serving_app(cfg, control)
    try:
        await _until(lambda: control.state == TrainerState.PAUSED, "the run paused for its failures")
        status = await control.status()
        assert "infra_failures" in status.pause and control.step == 0
        assert status.pause_detail.startswith(
            "3 of 4 rollouts of step 0 failed for an infrastructure reason (transport: 2, sandbox: 1): 75.0% is over "
            "grpo.max_infra_failure_fraction 0.5"
        )
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trainer") as client:
            answer = (await client.post("/resume")).json()
        assert answer["resumed"] is True
        await run_to_end(run, 120)
        assert control.state == TrainerState.FINISHED and control.step == 2
        records = step_records(read_records(control.metrics.path))
        assert [r.batch.infra_failure_fraction for r in records] == [0.75, 0.0]
        assert [r.batch.infra_failure_fraction_window for r in records] == [0.75, 0.0]  # a new window after resume
        assert records[0].batch.num_placeholders == 3
        status = json.loads((control.checkpointer.ckpt_dir / "latest_checkpoint_status.json").read_text())
        assert status["step"] == 2 and status["run_finished"] is True  # the last step's checkpoint
    finally:
        await _stop(control, peers, peer_task, run)


async def test_a_pause_that_lands_while_a_step_waits_for_its_batch_says_paused_until_the_resume(
    tiny_model_dir, redis_url, tmp_path
):
    """The step's rollouts cannot finish yet when a user pause lands: the launch gate is closed, so
    the wait is a hold, and the state says "paused" (not "collecting") until the resume."""
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "cp-midwait", steps=1, lag=0, data_timeout_s=60.0)
    control = control_plane(cfg)
    peers, peer_task, run = await play(control, redis_url)
    peers.gateway.finish = lambda task: False  # rollouts in flight, none done
    try:
        await _until(lambda: control.state == TrainerState.COLLECTING, "the step waiting for its batch")
        epoch = await control.pause.pause(PauseReason.USER)
        await _until(lambda: control.state == TrainerState.PAUSED, "the waiting step to say it is held")
        peers.gateway.finish = lambda task: True
        assert await control.pause.resume(PauseReason.USER, epoch)
        await run_to_end(run, 120)
        assert control.state == TrainerState.FINISHED and control.step == 1
    finally:
        await _stop(control, peers, peer_task, run)


async def test_a_pause_that_lands_after_the_hold_holds_back_the_issue_until_the_resume(
    tiny_model_dir, redis_url, tmp_path
):
    """A user pause can land after the boundary's hold and before the issue (e.g. during the
    start-up validation): the issue is held back, and once the pause ends the tasks go out."""
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "cp-late", steps=1, lag=1, data_timeout_s=60.0)
    control = control_plane(cfg)
    issue, paused = control.collector.issue, {}

    async def pause_first(step: int) -> None:
        if not paused:
            paused["epoch"] = await control.pause.pause(PauseReason.USER)
        await issue(step)

    control.collector.issue = pause_first
    peers, peer_task, run = await play(control, redis_url)
    try:
        await _until(lambda: "epoch" in paused, "the pause before the first issue")
        await asyncio.sleep(1.0)
        assert await control.redis.xlen(control.keys.tasks) == 0  # held back
        assert await control.pause.resume(PauseReason.USER, paused["epoch"])
        await run_to_end(run, 120)
        assert control.state == TrainerState.FINISHED and control.step == 1
    finally:
        await _stop(control, peers, peer_task, run)


async def test_a_pause_at_a_boundary_holds_the_next_issue_and_a_lag_0_run_continues_after_resume(
    tiny_model_dir, redis_url, tmp_path
):
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "cp-lag0", steps=2, lag=0, data_timeout_s=DATA_TIMEOUT_S)
    control, peers, peer_task, run = await _start(cfg, redis_url, pause_after=0)
    try:
        await _until(lambda: control.state == TrainerState.PAUSED, "the run held at the boundary after step 0")
        assert control.step == 1
        await asyncio.sleep(1.5 * cfg.trainer.data_timeout_s)  # paused well past the data deadline
        tasks = await control.redis.xrange(control.keys.tasks)
        assert len(tasks) == 4 and not run.done()  # step 1's tasks wait for the resume; the run waits too
        peers.gateway.finish = lambda task: task.target_step != 1  # step 1's rollouts take their time
        assert (await control.pause.reasons()).keys() == {"user"}
        await control.pause.resume(PauseReason.USER, (await control.pause.reasons())["user"])
        await _until(lambda: control.state == TrainerState.COLLECTING, "step 1 waiting for its data")
        epoch = await control.pause.pause(PauseReason.USER)  # paused while the step collects
        await asyncio.sleep(1.5 * cfg.trainer.data_timeout_s)
        assert not run.done(), "time spent paused counted against trainer.data_timeout_s"
        peers.gateway.finish = lambda task: True
        await control.pause.resume(PauseReason.USER, epoch)
        await run_to_end(run, 120)
        assert control.step == 2 and control.state == TrainerState.FINISHED
        records = step_records(read_records(control.log_dir / "metrics.jsonl"))
        assert [r.step for r in records] == [0, 1] and all(len(r.consumed_ids) == 4 for r in records)
        for r in records:  # the loop's records carry NeMo-RL's names too, agreeing with streamrl's
            nemo = r.nemo_rl
            assert nemo is not None and 0 < r.timing.batch_s < r.timing.train_s and r.timing.checkpoint_s >= 0
            assert (nemo.timing.total_step_time, nemo.timing.exposed_generation) == (
                r.timing.step_s,
                r.timing.wait_data_s,
            )
            assert nemo.timing.weight_sync == r.refit.total_s and nemo.train.avg_trajectory_age == r.staleness.mean
            assert nemo.timing.policy_training == pytest.approx(r.timing.train_s - r.timing.batch_s)
            one_turn = MeanMaxMin(mean=1.0, max=1.0, min=1.0)  # the played gateway's rollouts: 1 turn, 2 tokens
            assert nemo.train.turns_per_sample == one_turn and nemo.train.gen_tokens_per_sample.mean == 2.0
            assert nemo.train.num_valid_samples == 4 and nemo.train.total_num_tokens == 4 * 5
            assert nemo.train.natural_termination_rate == 1.0 and nemo.train.truncation_rate == 0.0
            assert nemo.performance.tokens_per_sec == pytest.approx(20 / r.timing.step_s)
    finally:
        await _stop(control, peers, peer_task, run)


async def test_the_last_boundary_holds_and_a_validation_requested_there_runs_before_the_end(
    tiny_model_dir, redis_url, tmp_path
):
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "cp-end", steps=1, lag=1, data_timeout_s=60.0)
    control, peers, peer_task, run = await _start(cfg, redis_url, pause_after=0)
    app = serving_app(cfg, control)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trainer") as client:
            await _until(lambda: control.state == TrainerState.PAUSED, "the run held at its last boundary")
            assert control.step == cfg.grpo.max_num_steps and not run.done()
            status = (await client.get("/status")).json()
            assert status["state"] == "paused" and status["last"]["step"] == 0 and "consumed_ids" not in status["last"]
            vid = (await client.post("/validate")).json()["validation_id"]
            assert (await client.post("/resume")).json()["resumed"] is True
            await run_to_end(run, 120)
            done = (await client.get(f"/validations/{vid}")).json()
            assert done["status"] == "done" and done["result"]["step"] == 1 and done["result"]["num_samples"] == 2
            refused = await client.post("/validate")
            assert refused.status_code == 409 and "the run has finished" in refused.text
        vals = [r for r in read_records(control.log_dir / "metrics.jsonl") if isinstance(r, ValidationRecord)]
        assert [v.validation_id for v in vals] == [vid]
        assert await control.redis.get(control.keys.stop) == b"finished"
    finally:
        await _stop(control, peers, peer_task, run)


async def test_a_run_without_data_fails_loudly_and_drops_queued_validations(tiny_model_dir, redis_url, tmp_path):
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "cp-fail", steps=2, lag=0, data_timeout_s=DATA_TIMEOUT_S)
    control, peers, peer_task, run = await _start(cfg, redis_url)
    peers.gateway.finish = lambda task: task.target_step == 0  # step 1's data never comes
    try:
        # Collecting for step 1: the boundary after step 0 (and its validations) has passed, so a
        # request now waits for a boundary that never comes.
        await _until(lambda: control.step == 1 and control.state == TrainerState.COLLECTING, "step 1 waiting for data")
        queued = control.validation.request(control.step)
        with pytest.raises(RunFailed, match=r"step 1: no 2 usable groups within 5s \(trainer.data_timeout_s\)"):
            await run_to_end(run, 60)
        assert control.state == TrainerState.FAILED and "trainer.data_timeout_s" in (control.error or "")
        assert await control.redis.get(control.keys.stop) == b"failed"
        dropped = control.validation.statuses[queued.validation_id]
        assert dropped.status == "dropped" and dropped.error and dropped.error.startswith("the run failed: RunFailed")
    finally:
        await _stop(control, peers, peer_task, run)


async def test_a_stopped_run_leaves_what_no_checkpoint_covers_unacknowledged(tiny_model_dir, redis_url, tmp_path):
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "cp-stop", steps=3, lag=0, data_timeout_s=60.0)
    cfg.checkpointing.save_period = 2  # step 1 is not checkpointed
    control, peers, peer_task, run = await _start(cfg, redis_url, pause_after=0)
    try:
        await _until(lambda: control.state == TrainerState.PAUSED, "the run held after step 0")
        held = list(control.checkpointer.unacked)
        assert len(held) == 4 and not any(control.checkpointer.ckpt_dir.glob("step_*"))
        # SIGTERM's path (services.trainer.app.stop_run): the trainer stops at once.
        assert not await cancel_and_wait([run], timeout_s=30.0, grace_s=10.0)
        pending = await control.redis.xpending_range(control.keys.trajectories, K.TRAINER_GROUP, "-", "+", 100)
        assert sorted(p["message_id"].decode() for p in pending) == sorted(held)  # delivered again on restart
    finally:
        await _stop(control, peers, peer_task, run)
