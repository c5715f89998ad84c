"""MoE routes on the wire (shared/routes.py) and in training rows (services/trainer/batch.py):
packing round trips at every id width, the reference run's routes fit the trajectory stream's
entry cap at its longest sequence, and a rollout's rows carry routes only when its calls covered
every position."""

import msgspec
import numpy as np
import pytest

from services.trainer.batch import build_row
from shared import keys as K
from shared.protocol import Trajectory, encode, make_turn
from shared.routes import RouteShape, moe_layers, pack, route_shape, unpack

TINY = RouteShape(layers=4, top_k=2, num_experts=8)
# Qwen3.5-397B-A17B: 60 layers, every one with 512 routed experts, 10 per token.
REFERENCE = RouteShape(layers=60, top_k=10, num_experts=512)


@pytest.mark.parametrize("experts", [1, 2, 8, 256, 257, 512, 65536])
def test_pack_round_trips_at_every_id_width(experts):
    shape = RouteShape(layers=5, top_k=3, num_experts=experts)
    ids = np.random.default_rng(experts).integers(0, experts, size=(11, 5, 3))
    data = pack(ids, shape)
    assert len(data) == 11 * shape.bytes_per_token
    assert np.array_equal(unpack(data, shape), ids)
    assert np.array_equal(unpack(data[3 * shape.bytes_per_token :], shape), ids[3:])  # token-aligned records


def test_bad_routes_are_refused():
    with pytest.raises(ValueError, match="not \\[tokens, 4, 2\\]"):
        pack(np.zeros((3, 4, 3), np.int64), TINY)
    with pytest.raises(ValueError, match="outside"):
        pack(np.full((1, 4, 2), 8), TINY)
    with pytest.raises(ValueError, match="whole"):
        unpack(b"\x00" * 5, TINY)


def test_the_reference_runs_longest_trajectory_fits_the_stream_cap():
    tokens = 65_536  # the reference run's sequence packing length, its longest trajectory
    assert REFERENCE.bits == 9 and REFERENCE.bytes_per_token == 688  # 7 ids in each 64-bit word
    turn = make_turn(
        prompt_ids=np.zeros(tokens // 2, np.int64),
        context_len=0,
        generated_ids=np.zeros(tokens // 2, np.int64),
        generated_logprobs=np.zeros(tokens // 2, np.float32),
        weight_version=0,
        routes=pack(np.zeros((tokens - 1, 60, 10), np.int64), REFERENCE),
    )
    traj = _trajectory([turn], REFERENCE)
    size = len(encode(traj))
    assert size < K.MAX_ENTRY_BYTES["trajectories"], f"{size / 2**20:.1f} MiB"
    assert size > 0.6 * K.MAX_ENTRY_BYTES["trajectories"]  # the cap is what bounds routes, and they fit


def test_moe_layers_and_route_shape_from_a_config():
    qwen3_5 = {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}
    assert moe_layers(qwen3_5) == [0, 1, 2, 3]
    assert route_shape({"text_config": qwen3_5}) == TINY  # a multimodal checkpoint's text part
    qwen3_moe = {**qwen3_5, "mlp_only_layers": [0], "decoder_sparse_step": 1}
    assert moe_layers(qwen3_moe) == [1, 2, 3]
    assert route_shape({"num_hidden_layers": 4}) is None  # dense
    # transformers 5 saves a Qwen3-MoE's expert count as num_local_experts
    resaved = {k: v for k, v in qwen3_moe.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert moe_layers(resaved) == [1, 2, 3] and route_shape(resaved) == RouteShape(layers=3, top_k=2, num_experts=8)


def _trajectory(turns, shape) -> Trajectory:
    return Trajectory(
        task_id="t0",
        group_id="g0",
        index_in_group=0,
        group_size=1,
        prompt_index=0,
        env="e",
        kind="train",
        target_step=0,
        launch_version=0,
        reward=1.0,
        status="ok",
        turns=turns,
        route_shape=shape,
    )


def _routes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, size=(n, 4, 2))


def _turn(context_len: int, prompt: int, gen: int, routes: np.ndarray | None, start: int):
    return make_turn(
        prompt_ids=np.arange(prompt) + 10 + context_len,
        context_len=context_len,
        generated_ids=np.arange(gen) + 500,
        generated_logprobs=np.full(gen, -1.0, np.float32),
        weight_version=0,
        **({} if routes is None else {"routes": pack(routes, TINY), "routes_start": start}),
    )


def test_a_rows_routes_are_its_calls_routes_end_to_end():
    # Call 1 ran 6 prompt + 4 generated tokens (routes of 9 positions); call 2 continues the
    # context (10 tokens) with 3 new prompt tokens and 2 generated, asking from position 9.
    first, second = _routes(9, 1), _routes(3 + 2 + 1 - 1 + 1, 2)
    turns = [_turn(0, 6, 4, first, 0), _turn(10, 3, 2, second, 9)]
    row = build_row(msgspec.convert(msgspec.to_builtins(_trajectory(turns, TINY)), Trajectory), max_len=100)
    assert len(row.input_ids) == 15 and row.routes is not None
    assert np.array_equal(row.routes[:9], first) and np.array_equal(row.routes[9:14], second[:5])


def test_a_row_missing_a_calls_routes_has_none():
    turns = [_turn(0, 6, 4, _routes(9, 1), 0), _turn(10, 3, 2, None, 0)]  # e.g. a preempted request
    assert build_row(_trajectory(turns, TINY), max_len=100).routes is None
    gap = [_turn(0, 6, 4, _routes(9, 1), 0), _turn(10, 3, 2, _routes(4, 2), 11)]  # positions 9, 10 never came
    assert build_row(_trajectory(gap, TINY), max_len=100).routes is None
    assert build_row(_trajectory(turns, None), max_len=100).routes is None  # replay off


def test_a_new_sample_after_a_prefix_break_keeps_the_routes_of_its_kept_context():
    first = _routes(9, 1)
    # Call 2 keeps 7 of the 10 tokens and asks for routes from position 6 on.
    second = _routes(3 + 2 + 7 - 6 - 1, 2)
    turns = [_turn(0, 6, 4, first, 0), _turn(7, 3, 2, second, 6)]
    head = build_row(_trajectory(turns, TINY), max_len=100, on_prefix_break="new_sample")
    [sample] = head.segments
    assert sample.routes is not None and len(sample.input_ids) == 12
    # A position two calls routed keeps the earlier call's route: the tokens after it were sampled so.
    assert np.array_equal(sample.routes[:7], first[:7]) and np.array_equal(sample.routes[7:11], second[1:])
