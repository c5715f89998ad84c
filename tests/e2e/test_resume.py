"""Lossless resume: the trainer is killed (SIGKILL, mid-run) while a generator and a gateway keep
running, then restarted with the same command. It resumes from its last checkpoint, re-reads its
unacknowledged trajectories, and finishes the run.

The per-step ledger (``consumed_ids`` of the last record of each step in metrics.jsonl) proves the
guarantees: every step trained exactly N x G trajectories, no trajectory id was trained twice,
steps before the checkpoint were not redone, and every trajectory the killed trainer had trained
after its checkpoint was either trained again after the restart or evicted, by id (for example
because a later weight version of the abandoned run produced it); none was skipped silently.
Services run as separate processes, as in a deployment (`python -m services.<name>`), with the
transformers engine on the tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from streamrl.redis_server import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, GENS, SAVE_PERIOD = 6, 2, 2, 2


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the last line while the trainer is still writing it
            break
    return records


def _start(module: str, config: Path, port: int, worker_id: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, "--config", str(config), "--port", str(port), "--worker-id", worker_id],
        cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, tiny_model_dir, redis_url):
    tmp = tmp_path_factory.mktemp("resume")
    data = tmp / "data"
    for name, n in (("train", 100), ("val", 4)):
        subprocess.run([sys.executable, "-m", "streamrl.cli", "data", "make", "crossing", str(data / f"{name}.jsonl"),
                        "--n", str(n)], check=True, cwd=ROOT)
    out = tmp / "run"
    tree = yaml.safe_load((ROOT / "deploy/configs/demo.yaml").read_text())
    tree["run"].update(run_id=f"resume-{os.getpid()}", output_dir=str(out))
    tree["redis"] = {"url": redis_url}
    tree["data"].update(train_path=str(data / "train.jsonl"), val_path=str(data / "val.jsonl"))
    tree["policy"]["model_name"] = str(tiny_model_dir)
    tree["policy"]["generation"].update(backend="transformers", max_new_tokens=8)
    tree["grpo"].update(max_num_steps=STEPS, num_prompts_per_step=PROMPTS, num_generations_per_prompt=GENS,
                        val_at_start=False, val_at_end=False)
    tree["checkpointing"] = {"save_period": SAVE_PERIOD}
    tree["generator"]["port"] = free_port()
    tree["gym_gateway"]["port"] = free_port()
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(tree))
    logs = {name: tmp / f"{name}.log" for name in ("generator", "gateway", "trainer")}
    generator = _start("services.generator", config, tree["generator"]["port"], "generator-0", logs["generator"])
    gateway = _start("services.gym_gateway", config, tree["gym_gateway"]["port"], "gateway-0", logs["gateway"])
    trainer_port = free_port()
    try:
        trainer = _start("services.trainer", config, trainer_port, "trainer", logs["trainer"])
        # Kill it mid-step, once it has trained one step past its first checkpoint (the step after
        # that one is running: waiting for data, training or refitting).
        deadline = time.monotonic() + 400
        while not any(r.get("kind") == "train" and r["step"] >= SAVE_PERIOD for r in _records(out)):
            assert trainer.poll() is None, logs["trainer"].read_text()[-3000:]
            assert time.monotonic() < deadline, logs["trainer"].read_text()[-3000:]
            time.sleep(0.02)
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(10)
        before = _records(out)
        checkpoint = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
        trainer = _start("services.trainer", config, trainer_port, "trainer", logs["trainer"])
        assert trainer.wait(500) == 0, logs["trainer"].read_text()[-4000:]
    finally:
        for proc in (locals().get("trainer"), gateway, generator):
            if proc is not None:
                _stop(proc)
    return before, _records(out), logs, checkpoint


def out_name(step: int) -> str:
    return f"step_{step:06d}"


def _ledger(records: list[dict]) -> dict[int, list[str]]:
    """step -> consumed ids of the last record of that step."""
    ledger: dict[int, list[str]] = {}
    for r in records:
        if r.get("kind") == "train":
            ledger[r["step"]] = r["consumed_ids"]
    return ledger


def test_the_resumed_run_trains_every_step_once(resumed_run):
    before, after, logs, checkpoint = resumed_run
    assert f"{out_name(checkpoint)} at step {checkpoint}" in logs["trainer"].read_text()
    ledger = _ledger(after)
    assert sorted(ledger) == list(range(STEPS))
    assert all(len(ids) == PROMPTS * GENS for ids in ledger.values())
    all_ids = [i for ids in ledger.values() for i in ids]
    assert len(all_ids) == len(set(all_ids))  # no trajectory trained twice


def test_checkpointed_steps_are_kept_and_later_ones_are_retrained_or_evicted_by_id(resumed_run):
    before, after, _, checkpoint = resumed_run
    first, final = _ledger(before), _ledger(after)
    for step in range(checkpoint):  # durable: recorded once, unchanged
        assert sum(r.get("kind") == "train" and r["step"] == step for r in after) == 1
        assert final[step] == first[step]
    lost = {i for step, ids in first.items() if step >= checkpoint for i in ids}
    assert lost, "the kill should have landed after at least one step past the checkpoint"
    resumed_records = after[len(before):]
    retrained = {i for ids in final.values() for i in ids}
    evicted = {i for r in resumed_records if r.get("kind") == "train" for i in r.get("evicted_ids", [])}
    assert lost <= retrained | evicted, sorted(lost - retrained - evicted)
