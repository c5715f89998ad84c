"""Lossless resume: the trainer is killed (SIGKILL, mid-step) while a generator and a gateway keep
running, then restarted with the same command. It resumes from its last checkpoint, re-reads its
unacknowledged trajectories, and finishes the run. Started once more after that, it finds the
final checkpoint and exits at once instead of waiting for data no one will produce.

The per-step ledger (``consumed_ids`` of the last record of each step in metrics.jsonl) proves the
guarantees: every step trained exactly N x G trajectories, no trajectory id was trained twice,
steps before the checkpoint were not redone, and every trajectory the killed trainer had trained
after its checkpoint was either trained again after the restart or evicted, by id (for example
because a later weight version of the abandoned run produced it); none was skipped silently.
Services run as separate processes, as in a deployment (`python -m services.<name>`), with the
transformers engine on the tiny model.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.support.runs import assert_every_step_trained_once, assert_resumed_without_loss, demo_run

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

STEPS, PROMPTS, GENS, SAVE_PERIOD = 6, 2, 2, 2
SAVING = {"checkpointing.save_period": SAVE_PERIOD}


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, tiny_model_dir, redis_url):
    tmp = tmp_path_factory.mktemp("resume")
    run = demo_run(tmp, tiny_model_dir, redis_url, f"resume-{os.getpid()}", (STEPS, PROMPTS, GENS), **SAVING)
    try:
        trainer = run.start_services()
        # Kill it mid-step, once it has trained one step past its first checkpoint (the step after
        # that one is running: waiting for data, training or refitting).
        run.wait_for_step("a step past the first checkpoint", SAVE_PERIOD)
        trainer.kill9()
        before = run.records()
        checkpoint = max(int(p.name.split("_")[1]) for p in (run.out / "checkpoints").glob("step_*"))
        assert run.restart("trainer").proc.wait(500) == 0, run.logs()
        after = run.records()
        # Once more, after the run finished: it resumes at the final checkpoint and stops.
        t0 = time.monotonic()
        again = run.restart("trainer").proc.wait(600)
        rerun = {"rc": again, "s": time.monotonic() - t0, "records": run.records()}
    finally:
        run.stop_all()
    return run, before, after, checkpoint, rerun


def out_name(step: int) -> str:
    return f"step_{step:06d}"


def test_the_resumed_run_trains_every_step_once(resumed_run):
    run, _, after, checkpoint, _ = resumed_run
    assert f"{out_name(checkpoint)} at step {checkpoint}" in (run.folder / "trainer.log").read_text()
    assert_every_step_trained_once(after, STEPS, PROMPTS * GENS)


def test_checkpointed_steps_are_kept_and_later_ones_are_retrained_or_evicted_by_id(resumed_run):
    _, before, after, checkpoint, _ = resumed_run
    assert_resumed_without_loss(before, after, checkpoint)


def test_a_restart_after_the_final_checkpoint_exits_without_training_again(resumed_run):
    run, _, after, _, rerun = resumed_run
    assert rerun["rc"] == 0, run.logs()
    # The requirement: it stops instead of waiting for data; trainer.data_timeout_s (an hour) would
    # end that wait, and ten minutes covers the trainer's start on a loaded machine.
    assert rerun["s"] < 600
    assert [r for r in rerun["records"] if r.get("kind") == "train"] == [r for r in after if r.get("kind") == "train"]
    assert f"at step {STEPS}" in (run.folder / "trainer.log").read_text()
