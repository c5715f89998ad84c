"""Soak: a run long enough to show that memory and stream lengths stay flat.

All services run as processes the test started (one generator on the transformers engine, one
gateway worker, the trainer) on a small batch, with ``trainer.stream_retention_s: 0`` so that the
trainer trims acknowledged entries as soon as it can. While the run trains, the test samples once a
second the resident memory (RSS, from /proc) of every service process and the length of every
stream of the run, then asserts:

* the run finishes, every step trained N x G trajectories once, nothing dead-lettered;
* tasks and trajectories stay under a bound set by the batch, the lag and the checkpoint period
  (entries wait for their ack until the step that used them is checkpointed), far below what the
  run published; weights and weight_acks stay under their MAXLEN;
* each service's RSS over the last part of the run is within a small margin of what it was once
  warmed up (first steps done), i.e. it does not grow with the number of steps.

The default run (``SHORT_STEPS``) is part of the e2e tier; the long one (``STREAMRL_SOAK_STEPS``,
default 300) runs with ``make soak`` (STREAMRL_LONG_TESTS=1, ``-m soak``). Samples are written to
``soak.json`` in the run's folder.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared import keys as K
from tests.support.runs import FaultRun, assert_every_step_trained_once, demo_run, long_variant

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

PROMPTS, GENS, LAG, SAVE_PERIOD = 2, 2, 1, 5
ROWS = PROMPTS * GENS
SHORT_STEPS = 20
SERVICES = {"generator-0": "services.generator", "gateway-0": "services.gym_gateway", "trainer": "services.trainer"}
STREAMS = ("tasks", "trajectories", "weights", "weight_acks", "deadletter")
# Unacked trajectories span at most the checkpoint period plus the steps in flight; tasks are acked
# once their trajectory is published, so at most the issue window (lag + 1 targets) waits.
TRAJECTORIES_BOUND = ROWS * (SAVE_PERIOD + LAG + 2)
TASKS_BOUND = ROWS * (LAG + 2)
OVERRIDES = {
    "grpo.async_grpo.max_trajectory_age_steps": LAG,
    "gym_gateway.max_concurrent_rollouts": ROWS,
    "checkpointing.save_period": SAVE_PERIOD,
    "trainer.stream_retention_s": 0,
    "trainer.torch_threads": 1,
    "logger.tensorboard": False,
}


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process, from /proc/<pid>/status; None once it has exited (a zombie
    has no VmRSS line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


@dataclass
class Samples:
    times: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    rss: dict[str, list[int]] = field(default_factory=lambda: {wid: [] for wid in SERVICES})
    lengths: dict[str, list[int]] = field(default_factory=lambda: {s: [] for s in STREAMS})

    def take(self, run: FaultRun) -> None:
        with run.client() as r:
            lengths = {s: r.xlen(run.keys._k(s)) for s in STREAMS}
        sizes = {wid: rss_bytes(run.services[wid].proc.pid) for wid in SERVICES}
        rss = {wid: n for wid, n in sizes.items() if n is not None}
        if len(rss) < len(sizes):  # a service exited since the loop looked: the run is over, no sample
            return
        self.times.append(time.time())
        self.steps.append(run.trained_steps())
        for wid, n in rss.items():
            self.rss[wid].append(n)
        for s, n in lengths.items():
            self.lengths[s].append(n)

    def rss_between(self, wid: str, first_step: int, last_step: int) -> list[int]:
        return [m for m, s in zip(self.rss[wid], self.steps, strict=False) if first_step <= s <= last_step]


def soak(folder: Path, model_dir: Path, redis_url: str, steps: int) -> tuple[FaultRun, int, Samples]:
    run = demo_run(folder, model_dir, redis_url, f"soak-{os.getpid()}-{steps}", (steps, PROMPTS, GENS), **OVERRIDES)
    samples = Samples()
    try:
        for wid, module in SERVICES.items():
            run.start(module, wid)
        trainer = run.services["trainer"]
        deadline = time.monotonic() + 120 + 30 * steps
        while trainer.alive() and all(run.services[w].alive() for w in SERVICES):
            if time.monotonic() > deadline:
                pytest.fail(f"the soak run did not finish {steps} steps in time\n{run.logs()}")
            samples.take(run)
            time.sleep(1.0)
        rc = trainer.proc.wait(120)
        (folder / "soak.json").write_text(json.dumps(samples.__dict__))
    finally:
        run.stop_all()
    return run, rc, samples


def check_soak(run: FaultRun, rc: int, samples: Samples, steps: int, *, rss_margin: float) -> None:
    assert rc == 0, run.logs()
    assert_every_step_trained_once(run.records(), steps, ROWS)
    published = len(run.published.stop())
    assert published >= steps * ROWS
    lengths = samples.lengths
    assert max(lengths["deadletter"]) == 0
    assert max(lengths["trajectories"]) <= TRAJECTORIES_BOUND < published, (max(lengths["trajectories"]), published)
    assert max(lengths["tasks"]) <= TASKS_BOUND, max(lengths["tasks"])
    assert max(lengths["weights"]) <= min(steps + 1, K.WEIGHTS_MAXLEN + 100)
    assert max(lengths["weight_acks"]) <= min(steps + 1, K.WEIGHT_ACKS_MAXLEN + 100)
    # Memory: warmed up once a few steps are done (model, optimizer state, first batches); from
    # then on the peak must not climb with the number of steps.
    warm = max(3, steps // 4)
    for wid in SERVICES:
        settled = samples.rss_between(wid, warm, warm + max(2, steps // 4))
        late = samples.rss_between(wid, steps - max(2, steps // 4), steps)
        assert settled and late, (wid, samples.steps)
        growth = max(late) - statistics.median(settled)
        assert growth <= rss_margin * statistics.median(settled), (
            f"{wid} RSS grew by {growth / 2**20:.1f} MiB from step {warm} to the end "
            f"({statistics.median(settled) / 2**20:.0f} MiB once warm)"
        )


def test_short_soak_keeps_memory_and_streams_flat(tmp_path, tiny_model_dir, redis_url):
    run, rc, samples = soak(tmp_path, tiny_model_dir, redis_url, SHORT_STEPS)
    check_soak(run, rc, samples, SHORT_STEPS, rss_margin=0.05)


@long_variant
def test_long_soak_keeps_memory_and_streams_flat(tmp_path, tiny_model_dir, redis_url):
    steps = int(os.environ.get("STREAMRL_SOAK_STEPS", "300"))
    run, rc, samples = soak(tmp_path, tiny_model_dir, redis_url, steps)
    check_soak(run, rc, samples, steps, rss_margin=0.05)
