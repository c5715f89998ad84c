"""Bad stream entries on every consumer: dead-lettered with the reason, counted, and the consumer
goes on with the next good entry.

The same kinds of bad entry go to each consumer, through its real read path on a real Valkey:
malformed bytes, a truncated message, an entry over the stream's size limit
(`shared.keys.MAX_ENTRY_BYTES`, lowered here so the test stays small), another schema version, the
wrong message type, and an entry without the message field.

    gateway worker   <- tasks         (consumer group)   then runs the next good task
    trainer consumer <- trajectories  (consumer group)   then stages the next good trajectories
    generator        <- weights       (broadcast)        then loads the next good version
    trainer refit    <- weight_acks   (broadcast)        then confirms the version
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.trainer.refit import WeightPublisher
from services.trainer.weight_transport import FilesystemTransport
from shared import keys as K
from shared.pause import PauseControl
from shared.protocol import (
    DeadLetter,
    SamplingParams,
    Task,
    Trajectory,
    WeightAck,
    WeightAnnouncement,
    decode,
    encode,
    make_turn,
)
from shared.streams import StreamClient, connect
from shared.weights_format import checksum_dir, dir_num_bytes
from tests.support.messages import make_task, make_trajectory
from tests.support.refit import played, save_dummy

pytestmark = pytest.mark.integration

SMALL_LIMIT = 4096  # bytes: the size limit of the stream under test


def bad_entries(good, other) -> list[tuple[dict, str]]:
    """(entry fields, expected reason) for each kind of bad entry, built from a good message of
    the stream and a message of another type."""
    raw = encode(good)
    big = msgspec.structs.replace(good, **{_text_field(good): "x" * (SMALL_LIMIT + 1)})
    return [
        ({K.ENTRY_FIELD: b"\xc1 not msgpack"}, "undecodable entry"),
        ({K.ENTRY_FIELD: raw[: len(raw) // 2]}, "truncated"),
        ({K.ENTRY_FIELD: encode(big)}, f"exceeds the {SMALL_LIMIT}-byte limit"),
        ({K.ENTRY_FIELD: encode(msgspec.structs.replace(good, v=2))}, "schema version 2"),
        ({K.ENTRY_FIELD: encode(other)}, "expected a"),
        ({b"other": b"x"}, "no 'm' field"),
    ]


def _text_field(msg) -> str:
    return {"task": "env", "trajectory": "env", "weights": "path", "weight_ack": "error"}[msg.__struct_config__.tag]


async def _inject(redis, stream: str, entries: list[tuple[dict, str]]) -> list[str]:
    return [(await redis.xadd(stream, fields)).decode() for fields, _ in entries]


async def _letters(redis, keys: K.RunKeys) -> list[DeadLetter]:
    return [decode(f[K.ENTRY_FIELD], DeadLetter) for _, f in await redis.xrange(keys.deadletter)]


def _assert_dead_lettered(letters: list[DeadLetter], stream: str, ids: list[str], entries) -> None:
    mine = [letter for letter in letters if letter.source == stream]
    assert [letter.entry_id for letter in mine] == ids
    for letter, (fields, reason) in zip(mine, entries, strict=False):
        assert reason in letter.reason, (reason, letter.reason)
        assert letter.payload == fields.get(K.ENTRY_FIELD, b"")[: K.DEADLETTER_PAYLOAD_MAX_BYTES]


def _dead_letter_counts(metrics_text: str) -> dict[str, float]:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "streamrl_stream_deadlettered":
            return {s.labels["stream"]: s.value for s in family.samples if s.name.endswith("_total")}
    raise AssertionError("no streamrl_stream_deadlettered_total in /metrics")


def _task(i: int, env: str = "crossing", group_size: int = 1) -> Task:
    return make_task(
        f"g{i}",
        group_size=group_size,
        prompt_index=i,
        env=env,
        instance={"light": "red"},
        sampling=SamplingParams(max_tokens=8),
    )


def _trajectory(group: str, index: int) -> Trajectory:
    turn = make_turn(prompt_ids=[1, 2], context_len=0, generated_ids=[3], generated_logprobs=[-0.5], weight_version=0)
    return make_trajectory(f"{group}/{index}", [turn], env="crossing", reward=float(index))


async def test_gateway_dead_letters_bad_tasks_and_runs_the_next(gateway_stack, monkeypatch):
    monkeypatch.setitem(K.MAX_ENTRY_BYTES, "tasks", SMALL_LIMIT)
    async with gateway_stack() as stack:
        redis, keys = stack.streams.redis, stack.streams.keys
        entries = bad_entries(_task(0), _trajectory("g", 0))
        ids = await _inject(redis, keys.tasks, entries)
        await stack.streams.publish(keys.tasks, _task(1))
        got = []
        for _ in range(600):
            got += await stack.streams.read_group(
                keys.trajectories, K.TRAINER_GROUP, Trajectory, count=10, block_ms=100
            )
            if got:
                break
        assert [t.msg.task_id for t in got] == ["g1/0"]  # the worker went on to the good task
        _assert_dead_lettered(await _letters(redis, keys), keys.tasks, ids, entries)
        assert (await redis.xpending(keys.tasks, K.GATEWAYS_GROUP))["pending"] == 0  # bad ones acked
        async with httpx.AsyncClient(base_url=stack.url) as client:
            metrics = (await client.get("/metrics")).text
        assert _dead_letter_counts(metrics) == {"tasks": float(len(entries))}


async def test_trainer_dead_letters_bad_trajectories_and_keeps_consuming(
    tiny_model_dir, redis_url, tmp_path, monkeypatch
):
    from tests.support.trainer import control_plane, serving_app, trainer_config

    monkeypatch.setitem(K.MAX_ENTRY_BYTES, "trajectories", SMALL_LIMIT)
    cfg = trainer_config(tmp_path, redis_url, tiny_model_dir, "dl", grpo={"num_prompts_per_step": 1})
    rt = control_plane(cfg)
    await rt.open()
    rt.intake.start()  # the trainer's background trajectory intake
    try:
        keys = rt.keys
        await rt.streams.publish(keys.trajectories, _trajectory("r1-g0", 0))
        entries = bad_entries(_trajectory("r1-g0", 1), _task(0))
        ids = await _inject(rt.redis, keys.trajectories, entries)
        await rt.streams.publish(keys.trajectories, _trajectory("r1-g0", 1))
        for _ in range(200):
            if rt.buffer.count_usable(0):
                break
            await asyncio.sleep(0.05)
        assert rt.buffer.count_usable(0) == 1 and rt.intake.received_total == 2  # the group completed
        assert rt.intake.error is None  # bad entries were dead-lettered; the intake lives on
        _assert_dead_lettered(await _letters(rt.redis, keys), keys.trajectories, ids, entries)
        app = serving_app(cfg, rt)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trainer") as client:
            metrics = (await client.get("/metrics")).text
        assert _dead_letter_counts(metrics) == {"trajectories": float(len(entries))}
    finally:
        await rt.intake.stop()
        await rt.aclose()


async def test_generator_dead_letters_bad_announcements_and_loads_the_next(
    hf_generator, tiny_model_dir, redis_url, monkeypatch
):
    monkeypatch.setitem(K.MAX_ENTRY_BYTES, "weights", SMALL_LIMIT)
    run_id = f"dl-gen-{uuid.uuid4().hex[:8]}"
    keys = K.RunKeys(run_id)
    redis = connect(redis_url)
    streams = StreamClient(redis, keys, "test-trainer")
    good = WeightAnnouncement(
        version=1,
        path=str(tiny_model_dir),
        checksum=checksum_dir(tiny_model_dir),
        num_bytes=dir_num_bytes(tiny_model_dir),
    )
    entries = bad_entries(good, WeightAck(worker_id="x", version=1, ok=True))
    try:
        # the newest entry is bad when the generator starts: it serves its initial weights
        first = await _inject(redis, keys.weights, entries[:1])
        async with hf_generator(run_id=run_id) as gen:
            assert gen.runtime.weight_version == -1
            ids = await _inject(redis, keys.weights, entries[1:])
            await streams.publish(keys.weights, good)
            for _ in range(400):
                if gen.runtime.weight_version == 1:
                    break
                await asyncio.sleep(0.05)
            assert gen.runtime.weight_version == 1 and (await gen.client.get("/ready")).status_code == 200
            metrics = (await gen.client.get("/metrics")).text
        _assert_dead_lettered(await _letters(redis, keys), keys.weights, first + ids, entries)
        assert _dead_letter_counts(metrics) == {"weights": float(len(entries))}
    finally:
        await redis.aclose()


async def test_refit_dead_letters_bad_acks_and_confirms_the_version(redis_url, tmp_path, monkeypatch):
    monkeypatch.setitem(K.MAX_ENTRY_BYTES, "weight_acks", SMALL_LIMIT)
    redis = connect(redis_url)
    keys = K.RunKeys(f"dl-refit-{uuid.uuid4().hex[:6]}")
    trainer = StreamClient(redis, keys, "trainer")
    transport = FilesystemTransport(tmp_path / "weights", save_dummy)
    publisher = WeightPublisher(trainer, PauseControl(redis, keys), transport, timeout_s=10, in_flight_updates=False)
    good = WeightAck(worker_id="gen-a", version=3, ok=True, cache_reset=True)
    entries = bad_entries(good, _task(0))
    await played(trainer, "gen-a").beat()

    async def generator() -> list[str]:
        """Play the generator: on the announcement, bad acks first, then the real one."""
        while await redis.xlen(keys.weights) == 0:
            await asyncio.sleep(0.02)
        ids = await _inject(redis, keys.weight_acks, entries)
        await redis.xadd(keys.weight_acks, {K.ENTRY_FIELD: encode(good)})
        return ids

    try:
        answered = asyncio.create_task(generator())
        report = await publisher.refit(3)
        assert report.generators == ["gen-a"]
        _assert_dead_lettered(await _letters(redis, keys), keys.weight_acks, await answered, entries)
        assert trainer.deadlettered_by_stream == {"weight_acks": len(entries)}
    finally:
        await redis.aclose()
