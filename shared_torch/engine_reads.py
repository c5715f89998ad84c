"""What one rank of a vLLM engine reads of each published tensor, learned from vLLM's own model
code rather than restated from its sharding rules.

A weight transfer that never gathers whole tensors must know, for every engine rank, which
slices of which published (Hugging Face) tensor that rank keeps: its tensor-parallel part of a
projection, its heads of a fused QKV or Gated DeltaNet projection (replicated key-value heads
when there are fewer than ranks), its padded share of the vocabulary, its experts under expert
parallelism, the whole of a norm. vLLM encodes all of it in each layer's ``weight_loader``.
`engine_rank_reads` runs those loaders on a tensor of element numbers: it builds the model of
one engine rank (vLLM's model class for the checkpoint's config, that rank's parallel groups
stood in for by `_StandIn` sizes and ranks, parameters in float64 on the CPU), fills every
parameter with -1, loads each published tensor as ``1 + its element numbers`` (each tensor its
own range: `shared.boxes.Numbering`), and reads back which element numbers each parameter holds. Padding a
loader zero-fills reads as 0 and is no element. The numbers name elements exactly (float64 holds
integers to 2**53), whatever the loader did on the way: narrow, chunk, view, transpose, stack
into fused experts, concatenate parts.

The result (`Reads`) is a list of boxes per tensor (`shared.boxes`): what that rank must receive.
Tensors the engine does not load (the MTP head, a vision tower it was not built with) are absent.
Used by the refit's resharding plan (`services.trainer.reshard_plan`) and its tests, for any
layout, including ones no machine here runs: building a rank's model allocates its parameters
without touching them, so a layout's size is bounded by one rank's share of the model.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from shared.boxes import Box, Numbering

Reads = dict[str, list[Box]]


class _StandIn:
    """A parallel group's size and this rank's place in it, all a model reads while it is built
    and loaded (no communication happens then)."""

    def __init__(self, size: int, rank: int) -> None:
        self.world_size, self.rank_in_group, self.rank, self.local_rank = size, rank, rank, rank
        self.ranks = list(range(size))
        self.unique_name = "stand-in"
        # what MoE blocks ask of the device group: size() and rank()
        self.device_group = self.cpu_group = types.SimpleNamespace(size=lambda: size, rank=lambda: rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


@contextlib.contextmanager
def _groups(tp: int, rank: int, expert_parallel: bool) -> Iterator[None]:
    """vLLM's parallel groups of engine rank ``rank`` of ``tp`` (one pipeline stage, one data
    rank; expert parallelism over the tensor-parallel ranks, as vLLM lays it out then)."""
    from vllm.distributed import parallel_state as ps

    names = ("_TP", "_PP", "_DP", "_EP", "_DCP", "_PCP")
    saved = {n: getattr(ps, n) for n in names}
    stand_ins = {n: _StandIn(1, 0) for n in names}
    stand_ins["_TP"] = _StandIn(tp, rank)
    stand_ins["_EP"] = _StandIn(tp, rank) if expert_parallel else _StandIn(1, 0)
    try:
        for n, group in stand_ins.items():
            setattr(ps, n, group)
        yield
    finally:
        for n, group in saved.items():
            setattr(ps, n, group)


def _model(model_dir: Path, tp: int, expert_parallel: bool) -> torch.nn.Module:
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", enforce_eager=True, skip_tokenizer_init=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=expert_parallel),
        load_config=LoadConfig(load_format="dummy"),
        device_config=DeviceConfig("cpu"),
    )
    with set_current_vllm_config(config):
        model = initialize_model(vllm_config=config)
    return model.double()


def engine_rank_reads(
    model_dir: str | os.PathLike[str],
    shapes: Mapping[str, Sequence[int]],
    *,
    tensor_parallel_size: int = 1,
    rank: int = 0,
    expert_parallel: bool = False,
) -> Reads:
    """The boxes of each tensor in ``shapes`` (published name -> shape) that engine rank
    ``rank`` of a vLLM engine of ``tensor_parallel_size`` ranks (``expert_parallel``: vLLM's
    ``enable_expert_parallel``) reads, for the checkpoint config in ``model_dir``."""
    numbering = Numbering({name: tuple(shape) for name, shape in shapes.items()})
    with _groups(tensor_parallel_size, rank, expert_parallel):
        model = _model(Path(model_dir), tensor_parallel_size, expert_parallel)
        params = list(model.parameters())
        with torch.no_grad():
            for p in params:
                p.fill_(-1)
            model.load_weights((name, torch.from_numpy(numbering.numbers(name))) for name in shapes)
    return numbering.boxes(np.concatenate([p.detach().reshape(-1).numpy() for p in params]))


def checkpoint_shapes(model_dir: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a safetensors checkpoint folder with its shape (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118  # safe_open is not a mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes
