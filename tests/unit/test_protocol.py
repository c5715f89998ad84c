"""Wire protocol: round trips, packed arrays, version and validation rejection."""

import msgspec
import numpy as np
import pytest

from shared.protocol import (
    SCHEMA_VERSION,
    Heartbeat,
    ProtocolError,
    SamplingParams,
    Task,
    Trajectory,
    WeightAnnouncement,
    decode,
    encode,
    make_turn,
)
from tests.support.messages import make_task

pytestmark = pytest.mark.unit


def _traj(**kw) -> Trajectory:
    base = dict(
        task_id="g1/0",
        group_id="g1",
        index_in_group=0,
        group_size=4,
        prompt_index=7,
        env="tool_calc",
        kind="train",
        target_step=3,
        launch_version=2,
        reward=1.0,
        status="ok",
        turns=[
            make_turn(
                prompt_ids=[1, 2, 3],
                context_len=0,
                generated_ids=[4, 5],
                generated_logprobs=[-0.5, -1.25],
                weight_version=2,
            ),
            make_turn(
                prompt_ids=[6],
                context_len=5,
                generated_ids=[7, 8],
                generated_logprobs=[-0.1, -0.2],
                weight_version=2,
                weight_version_end=3,
                version_spans=[(0, 2), (1, 3)],  # a refit split this call
            ),
        ],
    )
    base.update(kw)
    return Trajectory(**base)


def test_trajectory_round_trip_keeps_exact_tokens_and_logprobs():
    t = _traj()
    back = decode(encode(t), Trajectory)
    assert back == t
    assert back.turns[0].prompt().tolist() == [1, 2, 3]
    assert back.turns[0].generated().tolist() == [4, 5]
    np.testing.assert_array_equal(back.turns[0].logprobs(), np.array([-0.5, -1.25], dtype=np.float32))
    assert back.versions == [2, 3]
    assert back.turns[1].version_spans == [(0, 2), (1, 3)]
    assert back.num_generated_tokens == 4


def test_token_arrays_are_packed_int32_little_endian():
    turn = make_turn(
        prompt_ids=[1, 256], context_len=0, generated_ids=[2**31 - 1], generated_logprobs=[-0.5], weight_version=0
    )
    assert turn.prompt_ids == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert turn.generated_ids == b"\xff\xff\xff\x7f"
    assert len(turn.generated_logprobs) == 4


def test_task_and_weights_round_trip():
    task = make_task(
        "s0-p1",
        index=2,
        group_size=4,
        prompt_index=1,
        instance={"words": ["a", "b"], "n": 3},
        sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=32),
    )
    assert decode(encode(task), Task) == task
    ann = WeightAnnouncement(version=4, path="/w/v4", checksum="ab", num_bytes=10)
    assert decode(encode(ann), WeightAnnouncement) == ann


def test_newer_schema_version_is_rejected_loudly():
    data = encode(_traj(v=SCHEMA_VERSION + 1))
    with pytest.raises(ProtocolError, match="schema version"):
        decode(data, Trajectory)


def test_wrong_message_type_is_rejected():
    hb = Heartbeat(worker_id="w", kind="generator", url="http://x", pid=1, host="h", state="ready")
    with pytest.raises(ProtocolError, match="expected a 'trajectory' message"):
        decode(encode(hb), Trajectory)


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"\xc1garbage", "undecodable"),
        (msgspec.msgpack.encode({"type": "trajectory", "v": SCHEMA_VERSION, "task_id": 3}), "invalid 'trajectory'"),
    ],
)
def test_undecodable_or_invalid_entries_raise(payload, match):
    with pytest.raises(ProtocolError, match=match):
        decode(payload, Trajectory)


def test_semantic_validation_catches_mismatched_logprobs_and_bad_index():
    t = _traj()
    t.turns[0].generated_logprobs = t.turns[0].generated_logprobs[:4]
    with pytest.raises(ProtocolError, match="generated ids but"):
        decode(encode(t), Trajectory)
    with pytest.raises(ProtocolError, match="index_in_group"):
        decode(encode(_traj(index_in_group=4)), Trajectory)
    with pytest.raises(ProtocolError, match="reward is not finite"):
        decode(encode(_traj(reward=float("nan"))), Trajectory)
