"""Dynamic sampling (``grpo.use_dynamic_sampling``) in the trainer's control plane, on real Valkey
with the torch learner on the tiny model; the gateway and generator are played through Redis
(`Peers` of test_control_plane), scoring some prompts the same for every rollout.

What a user relies on:
* a group whose rewards all tie is filtered: never trained, its ids in the step record's
  ``filtered_ids`` and in the ledger, its entries acknowledged with the step's, its prompt used
  (not handed back) and a new prompt issued in its place;
* every step still trains ``num_prompts_per_step`` groups, all with signal, and every issued group
  is trained, filtered, evicted (its prompt handed back) or still pending: none is lost;
* a run whose prompts all tie fails loudly at the refill cap, naming the key;
* across a checkpoint and a resume no id is trained or counted twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from services.trainer.checkpoint import ControlState, latest_checkpoint
from services.trainer.control_plane import ControlPlane
from services.trainer.intake import RunFailed
from shared import keys as K
from shared.protocol import Task, decode, make_turn
from shared.records import StepRecord, read_records, step_records
from shared.run_config import RunConfig
from tests.support.messages import make_trajectory
from tests.support.trainer import control_plane, play, run_to_end, stop_plane, trainer_config

pytestmark = pytest.mark.integration

G = 2
TIES = {1: 1.0, 2: 0.0, 4: 1.0}  # prompt index -> the reward of every rollout of it (no signal)


def _reward(task: Task) -> float:
    return TIES.get(task.prompt_index, float(task.index_in_group % 2))


def _config(tmp_path: Path, redis_url: str, model_dir: Path, prefix: str, **grpo: object) -> RunConfig:
    data = tmp_path / "dapo.jsonl"
    data.write_text(
        "".join(json.dumps({"env": "crossing", "instance": {"light": "red", "i": i}}) + "\n" for i in range(8))
    )
    return trainer_config(
        tmp_path,
        redis_url,
        model_dir,
        prefix,
        data={"train_path": str(data), "shuffle": False},
        grpo={"use_dynamic_sampling": True, "async_grpo": {"max_trajectory_age_steps": 1}, **grpo},
        trainer={"data_timeout_s": 60.0, "refit_timeout_s": 60.0, "startup_timeout_s": 60.0},
        checkpointing={"save_period": 1},
        refit={"max_gen_kl_error": None},  # the played generator's logprobs are made up
        logger={"plot": False, "tensorboard": False},
    )


async def _run(cfg: RunConfig, redis_url: str, reward=_reward) -> tuple[ControlPlane, BaseException | None]:
    """Run the control plane's loop to its end; the plane (closed) and what the run raised."""
    control = control_plane(cfg)
    peers, peer_task, run = await play(control, redis_url)
    peers.gateway.reward = reward
    try:
        await run_to_end(run, 180)
        error = None
    except AssertionError:  # it did not end
        raise
    except Exception as exc:  # the run's own failure
        error = exc
    finally:
        await stop_plane(control, peers.redis, run, peer_task)
    return control, error


async def _issued(control: ControlPlane) -> dict[str, int]:
    """Every training group issued in the run: group id -> prompt index."""
    out: dict[str, int] = {}
    for _, fields in await control.redis.xrange(control.keys.tasks):
        task = decode(fields[K.ENTRY_FIELD], Task)
        out[task.group_id] = task.prompt_index
    return out


def _groups(ids: list[str]) -> set[str]:
    return {i.rsplit("/", 1)[0] for i in ids}


def _records(control: ControlPlane) -> list[StepRecord]:
    return step_records(read_records(control.log_dir / "metrics.jsonl"))


def _still_held(control: ControlPlane) -> set[str]:
    """Groups the trainer still holds at the end: staged, incomplete, filtered and not yet taken,
    or in flight."""
    buf, sched = control.buffer, control.scheduler
    staged = {g.group_id for gs in buf._staged.values() for g in gs}
    filtered = {g.group_id for g in buf._filtered}
    return staged | set(buf._pending) | filtered | {gid for gs in sched.in_flight.values() for gid in gs}


async def test_tied_groups_are_filtered_and_replaced_and_every_issued_prompt_is_accounted_for(
    tiny_model_dir, redis_url, tmp_path
):
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "ds-run", max_num_steps=3, batch_multiplier=1.5)
    control, error = await _run(cfg, redis_url)
    assert error is None and control.step == 3
    issued, records = await _issued(control), _records(control)
    assert [r.step for r in records] == [0, 1, 2]
    for r in records:  # full-size steps, every group with signal
        assert len(r.consumed_ids) == cfg.grpo.num_prompts_per_step * G
        assert not {issued[g] for g in _groups(r.consumed_ids)} & TIES.keys()
        assert r.dynamic_sampling is not None
        assert r.dynamic_sampling.num_filtered_groups * G == len(r.filtered_ids)
    # prompts 1 and 2 were among the first target's three groups (batch_multiplier 1.5): filtered
    # before step 0 could fill, and listed in its record
    first = records[0]
    assert {1, 2} <= {issued[g] for g in _groups(first.filtered_ids)}
    assert first.dynamic_sampling is not None and first.dynamic_sampling.num_gen_batches >= 2
    trained = _groups([i for r in records for i in r.consumed_ids])
    filtered = _groups([i for r in records for i in r.filtered_ids])
    evicted = _groups([i for r in records for i in r.evicted_ids])
    held = _still_held(control)
    assert {issued[g] for g in filtered} <= TIES.keys()
    assert all(control.buffer.consumed(f"{g}/{i}") for g in filtered for i in range(G))  # in the ledger
    # none lost: every issued group is trained, filtered, evicted (prompt handed back) or pending
    parts = [trained, filtered, evicted, held]
    assert set(issued) == set().union(*parts)
    assert sum(map(len, parts)) == len(set().union(*parts))  # and only one of them
    assert records[-1].dynamic_sampling is not None
    assert records[-1].dynamic_sampling.filtered_total >= len(filtered)


async def test_a_filtered_group_is_acked_with_its_step_and_its_prompt_is_not_handed_back(
    tiny_model_dir, redis_url, tmp_path
):
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "ds-wait", max_num_steps=2)
    rt = control_plane(cfg)
    await rt.open()
    try:
        turn = make_turn(
            prompt_ids=[1, 2], context_len=0, generated_ids=[3], generated_logprobs=[-0.5], weight_version=0
        )
        for n, (gid, rewards) in enumerate((("tie", [1.0, 1.0]), ("a", [0.0, 1.0]), ("b", [1.0, 0.0]))):
            for i, reward in enumerate(rewards):
                t = make_trajectory(f"{gid}/{i}", [turn], group_size=G, prompt_index=n, env="crossing", reward=reward)
                rt.buffer.add(t, f"{n + 1}-{i}")
        sample = await rt.collector.wait_for_batch(0)
        assert sorted(g.group_id for g in sample.groups) == ["a", "b"]
        assert [g.group_id for g in sample.filtered] == ["tie"] and rt.collector.filtered == []
        assert rt.checkpointer.unacked == ["1-0", "1-1"]  # acked once a checkpoint covers the step
        assert rt.buffer.consumed("tie/0") and rt.buffer.consumed("tie/1")
        assert rt.scheduler.source.state().returned == []  # the prompt was used, not handed back
    finally:
        await rt.aclose()


async def test_a_run_whose_prompts_all_tie_fails_at_the_refill_cap_naming_the_key(tiny_model_dir, redis_url, tmp_path):
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "ds-cap", max_num_steps=2, dynamic_sampling_max_gen_batches=2)
    control, error = await _run(cfg, redis_url, reward=lambda task: 1.0)
    assert isinstance(error, RunFailed) and "grpo.dynamic_sampling_max_gen_batches" in str(error)
    assert control.step == 0 and _records(control) == []
    assert await control.redis.get(control.keys.stop) == b"failed"


async def test_filtered_ids_survive_a_checkpoint_and_resume_exactly_once(tiny_model_dir, redis_url, tmp_path):
    cfg = _config(tmp_path, redis_url, tiny_model_dir, "ds-resume", max_num_steps=2)
    first, error = await _run(cfg, redis_url)
    assert error is None and first.step == 2
    before = _records(first)
    filtered_before = {i for r in before for i in r.filtered_ids}
    assert filtered_before  # prompts 1 and 2 tie
    ckpt = latest_checkpoint(first.checkpointer.ckpt_dir)
    assert ckpt is not None and ckpt.name == "step_000002"
    ledger = set(msgspec.json.decode((ckpt / "control.json").read_bytes(), type=ControlState).consumed_ids)
    assert filtered_before <= ledger  # the checkpoint keeps them as consumed-and-filtered

    cfg.grpo.max_num_steps = 4
    second, error = await _run(cfg, redis_url)
    assert error is None and second.step == 4
    records = _records(second)
    assert [r.step for r in records] == [0, 1, 2, 3]
    after = records[len(before) :]
    assert all(len(r.consumed_ids) == cfg.grpo.num_prompts_per_step * G for r in after)
    assert not {i for r in after for i in r.consumed_ids + r.filtered_ids} & filtered_before
    every = [i for r in records for i in r.consumed_ids + r.filtered_ids]
    assert len(every) == len(set(every))  # no id trained or counted twice in the run
