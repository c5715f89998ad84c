"""A trainer of two ranks loses one: rank 1 is killed (SIGKILL) mid-run while a generator and a
gateway keep running. The whole trainer fails (torchrun stops rank 0 and exits non-zero, naming
rank 1) within ``trainer.collective_timeout_s``; started again with the same command, it resumes
from its last checkpoint, saved as shards by both ranks, and finishes with the ledger intact, as
the one-rank trainer does after a kill (tests/faults/test_trainer_kill.py).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.runs import assert_every_step_trained_once, assert_resumed_without_loss, demo_run

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

STEPS, PROMPTS, GENS, SAVE_PERIOD, TIMEOUT_S = 5, 2, 2, 2, 30
OVERRIDES = {
    "checkpointing.save_period": SAVE_PERIOD,
    "trainer.nproc_per_node": 2,
    "trainer.collective_timeout_s": TIMEOUT_S,
    "trainer.torch_threads": 1,
}
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "services.trainer"]


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the trainer process with ``RANK=rank`` that the launcher started."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


@pytest.fixture(scope="module")
def rank_killed_run(tmp_path_factory, tiny_model_dir, redis_url):
    tmp = tmp_path_factory.mktemp("rank-kill")
    run = demo_run(tmp, tiny_model_dir, redis_url, f"rank-kill-{os.getpid()}", (STEPS, PROMPTS, GENS), **OVERRIDES)
    try:
        trainer = run.start_services(trainer_launcher=TORCHRUN)
        run.wait_for_step("a step past the first checkpoint", SAVE_PERIOD)
        victim = rank_pid(trainer.proc.pid, 1)
        assert victim is not None, run.logs()
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        code = trainer.proc.wait(TIMEOUT_S + 60)
        failed = {"rc": code, "s": time.monotonic() - t0, "log": trainer.tail(20_000)}
        before = run.records()
        checkpoint = max(int(p.name.split("_")[1]) for p in (run.out / "checkpoints").glob("step_*"))
        assert run.restart("trainer").proc.wait(500) == 0, run.logs()
        after = run.records()
    finally:
        run.stop_all()
    return run, failed, before, after, checkpoint


def test_a_killed_rank_fails_the_whole_trainer_naming_it(rank_killed_run):
    _, failed, *_ = rank_killed_run
    assert failed["rc"] != 0
    # The requirement: within trainer.collective_timeout_s (TIMEOUT_S) of the kill; the margin is
    # for torchrun stopping the other rank on a loaded machine.
    assert failed["s"] < TIMEOUT_S + 60
    assert "rank      : 1 (local_rank: 1)" in failed["log"] and "Signal 9 (SIGKILL)" in failed["log"], failed["log"]


def test_the_restarted_trainer_resumes_its_sharded_checkpoint_without_loss(rank_killed_run):
    run, _, before, after, checkpoint = rank_killed_run
    shards = run.out / "checkpoints" / f"step_{STEPS:06d}" / "learner" / "shards"
    assert len(list(shards.glob("*.distcp"))) == 2
    assert f"step_{checkpoint:06d} at step {checkpoint}" in (run.folder / "trainer.log").read_text()
    assert_every_step_trained_once(after, STEPS, PROMPTS * GENS)
    assert_resumed_without_loss(before, after, checkpoint)
