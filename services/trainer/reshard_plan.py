"""The resharding plan of a refit without a gather: for every engine rank of every generator,
which slices of which trainer rank's own shard it receives, so that each trainer rank sends its
slices straight to the engine ranks that keep them and no rank ever holds a whole tensor.

Both sides are described in the published (Hugging Face) names and shapes, as lists of boxes
per tensor (`shared.boxes`):

* what each trainer rank holds (`Holdings`), from the training backend's layout:
  `fsdp_holdings` (the torch backend: FSDP2 shards each parameter's rows over the ranks, and the
  published names come from transformers' own reverse conversion of what each rank holds) and
  `megatron_holdings` (tensor-parallel parts, pipeline stages, expert ranks, data replicas,
  through the backend's own HF -> Megatron conversion). Both run the layout's code on element
  numbers (`shared.boxes.Numbering`) and read back which elements each rank holds.
* what each engine rank needs (`Needs`), from vLLM's own weight loaders
  (`shared_torch.engine_reads.engine_rank_reads`), per generator: a generator's engine ranks
  all read whole copies of what vLLM replicates (norms, routers), their own heads and rows of the
  rest, their own experts under expert parallelism.

`make_plan` cuts every needed box into pieces, each taken from one trainer rank that holds it;
among data-parallel replicas of a piece it takes the one that has sent least so far, so the
replicas share the sending and different generators are fed from different trainer ranks. Each
needed element is sent exactly once to each engine rank that needs it (`Plan.check` proves it
on any layout); the total is what the engines read, the model's bytes per generator plus what
vLLM replicates over a generator's ranks. `Plan.links` gives the bytes of every (trainer rank,
engine rank) link and `Plan.busiest` the largest, the figure a transfer's time follows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.boxes import Box, Numbering, intersect, mask_boxes, subtract, volume

# tensor name -> boxes of it, per trainer rank / per engine rank
Holdings = dict[int, dict[str, list[Box]]]


@dataclass(frozen=True, order=True)
class EngineRank:
    generator: str
    rank: int


Needs = dict[EngineRank, dict[str, list[Box]]]


@dataclass(frozen=True)
class Send:
    source: int  # trainer rank
    dest: EngineRank
    name: str
    box: Box
    nbytes: int


@dataclass
class Plan:
    sends: list[Send] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.sends)

    def links(self) -> dict[tuple[int, EngineRank], int]:
        """Bytes on each (trainer rank, engine rank) link."""
        out: dict[tuple[int, EngineRank], int] = defaultdict(int)
        for s in self.sends:
            out[(s.source, s.dest)] += s.nbytes
        return dict(out)

    def busiest(self) -> tuple[tuple[int, EngineRank], int]:
        """The link that carries the most bytes, and its bytes."""
        link, nbytes = max(self.links().items(), key=lambda kv: kv[1])
        return link, nbytes

    def sent_by(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for s in self.sends:
            out[s.source] += s.nbytes
        return dict(out)

    def received_by(self) -> dict[EngineRank, int]:
        out: dict[EngineRank, int] = defaultdict(int)
        for s in self.sends:
            out[s.dest] += s.nbytes
        return dict(out)

    def check(self, needs: Needs, holdings: Holdings) -> None:
        """Raise unless every engine rank receives each element it needs exactly once, nothing it
        does not need, each piece from a trainer rank that holds it."""
        got: dict[tuple[EngineRank, str], list[Box]] = defaultdict(list)
        for s in self.sends:
            if not any(_inside(s.box, h) for h in holdings.get(s.source, {}).get(s.name, [])):
                raise AssertionError(f"trainer rank {s.source} does not hold {s.name} {s.box}")
            got[(s.dest, s.name)].append(s.box)
        for dest, tensors in needs.items():
            for name, boxes in tensors.items():
                pieces = got.pop((dest, name), [])
                for i, a in enumerate(pieces):
                    if not any(_inside(a, b) for b in boxes):
                        raise AssertionError(f"{dest} receives {name} {a}, which it does not need")
                    for b in pieces[i + 1 :]:
                        if intersect(a, b) is not None:
                            raise AssertionError(f"{dest} receives {name} {intersect(a, b)} twice")
                if sum(map(volume, pieces)) != sum(map(volume, boxes)):
                    raise AssertionError(f"{dest} receives part of {name} only")
        if got:
            raise AssertionError(f"sends nobody needs: {sorted(got)[:3]}")


def _inside(a: Box, b: Box) -> bool:
    return intersect(a, b) == a


def make_plan(holdings: Holdings, needs: Needs, itemsize: Mapping[str, int] | int) -> Plan:
    """Every needed box cut into pieces each sent by one trainer rank holding it (see above);
    ``itemsize``: bytes per element on the wire, per tensor or for all."""
    holders: dict[str, dict[Box, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, tensors in sorted(holdings.items()):
        for name, boxes in tensors.items():
            for box in boxes:
                holders[name][box].append(rank)
    sent: dict[int, int] = defaultdict(int)
    plan = Plan()
    for dest in sorted(needs):
        for name, boxes in needs[dest].items():
            size = itemsize if isinstance(itemsize, int) else itemsize[name]
            for box in boxes:
                left = [box]
                for held, ranks in holders[name].items():
                    rest = []
                    for piece in left:
                        part = intersect(piece, held)
                        if part is None:
                            rest.append(piece)
                            continue
                        source = min(ranks, key=lambda r: (sent[r], r))
                        nbytes = volume(part) * size
                        sent[source] += nbytes
                        plan.sends.append(Send(source, dest, name, part, nbytes))
                        rest.extend(subtract(piece, part))
                    left = rest
                if left:
                    raise ValueError(f"no trainer rank holds {name} {left[0]}, which {dest} needs")
    return plan


def generator_needs(generator: str, per_rank: Iterable[dict[str, list[Box]]]) -> Needs:
    """One generator's engine ranks' needs, rank by rank."""
    return {EngineRank(generator, r): reads for r, reads in enumerate(per_rank)}


# ---- the training backends' layouts -----------------------------------------------------------


def _holdings_of(numbering: Numbering, held: Mapping[Any, list[np.ndarray]]) -> dict[Any, dict[str, list[Box]]]:
    return {key: numbering.boxes(np.concatenate([a.reshape(-1) for a in arrays])) for key, arrays in held.items()}


def megatron_holdings(
    shapes: dict[str, tuple[int, ...]],
    config: dict[str, Any],
    *,
    tensor: int,
    pipeline: int,
    expert: int,
    world_size: int,
) -> Holdings:
    """What each of ``world_size`` megatron ranks holds of the published tensors ``shapes`` of a
    checkpoint whose config.json is ``config``, at tensor x pipeline x expert parallel sizes
    ``tensor``, ``pipeline``, ``expert`` (megatron-core's rank order: tensor ranks innermost, then
    data, then stages; expert ranks innermost over a stage's ranks, experts whole on each: the
    backend's expert tensor-parallel size is 1). The backend's own HF -> Megatron conversion
    (`megatron_convert`) runs on element numbers and each rank's part is cut as
    `megatron_tp.cut` cuts it."""
    import torch

    from services.trainer.backends import megatron_tp
    from services.trainer.backends.megatron_convert import (
        hf_globals_to_megatron,
        hf_layer_to_megatron,
        language_model_config,
        language_model_prefix,
        padded_vocab,
    )

    hf, prefix = language_model_config(config), language_model_prefix(config)
    numbering = Numbering(shapes)
    state = _NumberedState(numbering)
    per_stage = world_size // pipeline
    layers = int(hf["num_hidden_layers"]) // pipeline
    dense: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)  # (stage, tensor rank)
    experts: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)  # (stage, expert rank)
    for stage in range(pipeline):
        first, last = stage == 0, stage == pipeline - 1
        for ep_rank in range(expert):
            parts = [hf_globals_to_megatron(state, hf, first=first, last=last, prefix=prefix)]
            parts += [
                hf_layer_to_megatron(state, hf, i, ep_rank=ep_rank, ep_size=expert, prefix=prefix)
                for i in range(stage * layers, (stage + 1) * layers)
            ]
            for part in parts:
                for name, full in part.items():
                    if ".local_experts." in name:
                        experts[(stage, ep_rank)].append(full.numpy())
                    elif ep_rank == 0:
                        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                            full = torch.nn.functional.pad(full, (0, 0, 0, padded_vocab(hf) - full.shape[0]))
                        for tp_rank in range(tensor):
                            cut = megatron_tp.cut(full, name, hf, tensor, tp_rank)
                            dense[(stage, tp_rank)].append(cut.numpy())
    dense_boxes, expert_boxes = _holdings_of(numbering, dense), _holdings_of(numbering, experts)
    holdings: Holdings = {}
    for rank in range(world_size):
        stage, local = divmod(rank, per_stage)
        holdings[rank] = {**dense_boxes[(stage, local % tensor)], **expert_boxes.get((stage, local % expert), {})}
    return holdings


def fsdp_holdings(
    model: Any, world_size: int, published: Callable[[Iterable[tuple[str, Any]]], Iterable[tuple[str, Any]]]
) -> Holdings:
    """What each of ``world_size`` FSDP2 ranks holds of the published tensors of ``model`` (a
    transformers model; meta tensors are enough): each parameter's rows split as FSDP2 splits
    them (``torch.chunk`` along dim 0), followed into the published names by ``published`` (the
    torch backend's stored-name conversion, `shared_torch.stored_names.as_stored`) run on the
    parameters' element numbers."""
    import torch

    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    numbering = Numbering(shapes)
    row_size = np.array([int(np.prod(shapes[n][1:], dtype=np.int64)) for n in numbering.names], dtype=np.int64)
    chunk = np.array([-(-(shapes[n][0] if shapes[n] else 1) // world_size) for n in numbering.names], dtype=np.int64)
    holdings: Holdings = {r: {} for r in range(world_size)}
    for name, values in published((n, torch.from_numpy(numbering.numbers(n))) for n in shapes):
        numbers = values.numpy().astype(np.int64)
        source = np.searchsorted(numbering.starts, numbers, side="right") - 1
        row = (numbers - numbering.starts[source]) // row_size[source]
        owner = row // chunk[source]
        for r in np.unique(owner):
            holdings[int(r)][name] = mask_boxes(owner == r)
    return holdings


class _NumberedState(Mapping[str, Any]):
    """A checkpoint's tensors as their element numbers (float64 torch tensors), made on request."""

    def __init__(self, numbering: Numbering) -> None:
        self._numbering = numbering

    def __getitem__(self, key: str) -> Any:
        import torch

        return torch.from_numpy(self._numbering.numbers(key))

    def __iter__(self) -> Any:
        return iter(self._numbering.names)

    def __len__(self) -> int:
        return len(self._numbering.names)


def summary(plan: Plan, model_bytes: int, generators: int) -> dict[str, Any]:
    """The plan's figures: bytes in total against the model's bytes per generator, the busiest
    link, the most any trainer rank sends and any engine rank receives."""
    (source, dest), busiest = plan.busiest()
    return {
        "total_bytes": plan.total_bytes,
        "model_bytes_x_generators": model_bytes * generators,
        "total_over_model_x_generators": plan.total_bytes / (model_bytes * generators),
        "busiest_link": {
            "trainer_rank": source,
            "generator": dest.generator,
            "engine_rank": dest.rank,
            "bytes": busiest,
        },
        "most_sent_by_a_trainer_rank": max(plan.sent_by().values()),
        "most_received_by_an_engine_rank": max(plan.received_by().values()),
        "links": len(plan.links()),
        "sends": len(plan.sends),
    }
