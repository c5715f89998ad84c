"""How a step's rows are split into optimizer updates and across trainer ranks (`plan_step`), and
how published weights are written file by file (`ShardWriter`)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.trainer.batch import Row, StepBatch
from services.trainer.step_plan import plan_step
from services.trainer.weight_export import ShardWriter

pytestmark = pytest.mark.unit


def _batch(lengths: list[int], masked: set[int] = frozenset()) -> StepBatch:
    rows = []
    for i, n in enumerate(lengths):
        tmask = np.zeros(n, np.float32)
        tmask[n // 2 :] = 1.0
        rows.append(
            Row(
                f"t{i}",
                f"g{i // 4}",
                np.arange(n, dtype=np.int64),
                tmask,
                np.zeros(n, np.float32),
                reward=0.0,
                sample_mask=0.0 if i in masked else 1.0,
            )
        )
    return StepBatch(rows=rows)


def test_every_trainable_row_lands_on_exactly_one_rank_in_its_update():
    lengths = [5, 40, 12, 33, 7, 21, 18, 9, 50, 11, 26, 14]
    batch = _batch(lengths, masked={3})
    shares = plan_step(batch, world_size=3, train_global_batch_size=6)  # 12 rows: 2 updates
    assert len(shares) == 3 and all(len(s.updates) == 2 for s in shares)
    one_rank = plan_step(batch, world_size=1, train_global_batch_size=6)[0]
    for u in range(2):
        spread = sorted(r.task_id for s in shares for r in s.updates[u])
        assert spread == sorted(r.task_id for r in one_rank.updates[u])  # the same rows in the same update
    assert sorted(r.task_id for s in shares for r in s.rows) == sorted(f"t{i}" for i in range(12) if i != 3)


def test_ranks_get_balanced_tokens_and_keep_shortest_first_order():
    lengths = [100, 90, 80, 70, 60, 50, 40, 30, 20, 10]
    shares = plan_step(_batch(lengths), world_size=2, train_global_batch_size=None)
    tokens = [sum(len(r.input_ids) for r in s.rows) for s in shares]
    assert abs(tokens[0] - tokens[1]) <= 10, tokens  # longest first, each to the emptier rank
    for s in shares:
        n = [len(r.input_ids) for r in s.rows]
        assert n == sorted(n)


def test_the_filler_is_masked_and_nothing_trainable_plans_nothing():
    shares = plan_step(_batch([8, 9, 10]), world_size=4, train_global_batch_size=None)
    assert [len(s.rows) for s in shares] == [1, 1, 1, 0]  # a rank without rows runs only filler passes
    assert all(s.filler.sample_mask == 0.0 for s in shares)
    assert plan_step(_batch([8, 9], masked={0, 1}), world_size=2, train_global_batch_size=None) == []


def test_the_shard_writer_splits_files_and_indexes_them_as_hugging_face_does(tmp_path):
    tensors = {f"layer.{i}.weight": torch.full((64, 64), float(i)) for i in range(5)}  # 16 KiB each
    writer = ShardWriter(tmp_path, max_shard_bytes=40 * 1024)
    for name, t in tensors.items():
        writer.add(name, t)
    files = writer.close()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 64 * 64 * 4
    loaded = {}
    for f in files:
        loaded.update(load_file(f))
        assert all(index["weight_map"][k] == f.name for k in load_file(f))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert not list(tmp_path.glob(".part-*"))


def test_one_file_is_model_safetensors(tmp_path):
    writer = ShardWriter(tmp_path)
    writer.add("w", torch.ones(3))
    assert [f.name for f in writer.close()] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
