"""The megatron backend's parts of the policy: loading them from a checkpoint, and reading them
back as published boxes for a refit without a gather.

`local_parts` is the load: the checkpoint's HF tensors converted a layer at a time into
megatron-core's (`megatron_convert`), each cut to this rank's tensor-parallel part of the live
parameter (`megatron_tp.local_part`), this stage's layers only, experts of this expert rank only.
`MegatronShards` runs that same load on a checkpoint of element numbers (`shared.boxes.Numbering`)
instead of weights: each live parameter's local elements then name the published element they
hold, so a box of a published tensor the resharding plan asks of this rank is found in the live
parameters (a strided view where one fits, a gather otherwise), by the code that put it there.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.trainer.backends import megatron_export, megatron_tp
from services.trainer.backends.layout import Layout
from services.trainer.backends.megatron_convert import (
    hf_globals_to_megatron,
    hf_layer_to_megatron,
    language_model_config,
    language_model_prefix,
    padded_vocab,
)
from services.trainer.reshard_plan import Holdings, _NumberedState, megatron_holdings
from services.trainer.reshard_source import Take, take_of
from shared.boxes import Box, Numbering
from shared_torch.reshard_wire import Piece


def local_parts(
    params: Mapping[str, torch.nn.Parameter],
    state: Mapping[str, torch.Tensor],
    hf: dict[str, Any],
    layout: Layout,
    prefix: str,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(live parameter name, this rank's part of it) for every parameter of this stage, converted
    from the HF tensors ``state`` a layer at a time; raises when the two do not fit."""
    loaded: set[str] = set()
    ep = {"ep_rank": layout.expert_rank, "ep_size": layout.expert_size}
    first, count = layout.layer_offset, hf["num_hidden_layers"] // layout.pipeline.world_size
    layers = (hf_layer_to_megatron(state, hf, i, **ep, prefix=prefix) for i in range(first, first + count))
    stage_globals = hf_globals_to_megatron(state, hf, first=layout.first_stage, last=layout.last_stage, prefix=prefix)
    for part in itertools.chain([stage_globals], layers):  # a layer at a time
        for global_name, full in part.items():
            name = megatron_tp.renumber(global_name, -first)
            if name not in params:
                raise ValueError(f"checkpoint does not fit the Megatron model: unexpected {global_name}")
            if name in megatron_export.VOCAB_ROWS:  # zero rows up to the padded vocabulary (sliced off the logits)
                full = F.pad(full, (0, 0, 0, padded_vocab(hf) - full.shape[0]))
            yield name, megatron_tp.local_part(full, params[name], name)
            loaded.add(name)
    missing = sorted(params.keys() - loaded)
    if missing:
        raise ValueError(f"checkpoint does not fit the Megatron model: missing {missing[:5]}")


class MegatronShards:
    """This rank's parts of ``module`` (megatron-core's GPT model) as published boxes."""

    def __init__(
        self, module: torch.nn.Module, model_dir: str, checkpoint_config: dict[str, Any], layout: Layout
    ) -> None:
        from megatron.core import parallel_state

        from shared_torch.engine_reads import checkpoint_shapes

        self.module = module
        self.config = checkpoint_config
        self.layout = layout
        self.tensor = parallel_state.get_tensor_model_parallel_world_size()
        hf, prefix = language_model_config(checkpoint_config), language_model_prefix(checkpoint_config)
        self.numbering = Numbering(checkpoint_shapes(Path(model_dir)))
        params = dict(module.named_parameters())
        self._numbers = {
            name: part.numpy().astype(np.int64)
            for name, part in local_parts(params, _NumberedState(self.numbering), hf, layout, prefix)
        }
        held = np.unique(np.concatenate([a.reshape(-1) for a in self._numbers.values()]))
        self.shapes = {n: s for n, s in self.numbering.shapes.items() if n in self.numbering.boxes(held)}
        self._takes: dict[Piece, list[Take]] = {}

    def holdings(self) -> Holdings:
        """What every rank holds (the plan is made on rank 0 for all)."""
        world = self.layout.world.world_size
        return megatron_holdings(
            self.shapes,
            self.config,
            tensor=self.tensor,
            pipeline=self.layout.pipeline.world_size,
            expert=self.layout.expert_size,
            world_size=world,
        )

    def prepare(self, pieces: Iterable[Piece]) -> None:
        """Where each piece this rank sends lies in its parameters (once per transfer group)."""
        keys = list(self._numbers)
        flat = np.concatenate([self._numbers[k].reshape(-1) for k in keys])
        owner = np.concatenate([np.full(self._numbers[k].size, i, dtype=np.int64) for i, k in enumerate(keys)])
        starts = np.concatenate([[0], np.cumsum([self._numbers[k].size for k in keys])[:-1]])
        order = np.argsort(flat, kind="stable")
        ranked = flat[order]
        self._takes = {}
        for name, box in pieces:
            wanted = self._box_numbers(name, box)
            at = np.searchsorted(ranked, wanted.reshape(-1))
            if (at >= ranked.size).any() or (ranked[np.minimum(at, ranked.size - 1)] != wanted.reshape(-1)).any():
                raise ValueError(f"this rank does not hold all of {name} {box}")
            where = order[at]
            keys_at = owner[where]
            local = where - starts[keys_at]
            self._takes[(name, box)] = [
                take_of(keys[k], local.reshape(wanted.shape), keys_at.reshape(wanted.shape) == k)
                for k in np.unique(keys_at)
            ]

    def _box_numbers(self, name: str, box: Box) -> np.ndarray:
        grid = np.meshgrid(*[np.arange(s, e) for s, e in box], indexing="ij")
        shape = self.numbering.shapes[name]
        return (
            self.numbering.first[name] + np.ravel_multi_index(tuple(grid), shape)
            if shape
            else np.array(self.numbering.first[name])
        )

    def reader(self) -> Any:
        """``fill(piece, out)`` over the live parameters, for the pieces `prepare` was given."""
        takes = self._takes
        params = {n: p.detach() for n, p in self.module.named_parameters()}

        def fill(piece: Piece, out: torch.Tensor) -> None:
            for take in takes[piece]:
                take.put(params[take.key], out)

        return fill
