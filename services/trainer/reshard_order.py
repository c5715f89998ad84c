"""A resharding refit's orders, made on the trainer's rank 0 when a transfer group forms: the plan
(`services.trainer.reshard_plan`) from every trainer rank's holdings and every member generator's
engine ranks' needs, cut into the links each side runs (`shared_torch.reshard_wire`).

Group ranks: trainer ranks first (``0 .. trainer_ranks - 1``), then each generator's engine ranks
in member order. A generator's needs come from its engine: vLLM's own weight loaders, rank by rank
(`shared_torch.engine_reads`: computed once per engine shape and kept), or every published tensor
whole for the transformers engine. Pieces are cut to fit a send slot (the transfer's bucket bytes
over its slots), so no rank ever holds more than its slots beyond its shard.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from services.trainer.reshard_plan import EngineRank, Holdings, Needs, Plan, generator_needs, make_plan, summary
from services.trainer.weight_send import ReshardOrder
from shared.boxes import Box, split, whole
from shared_torch.reshard_wire import Links, Piece, buckets_of, encode_links

log = logging.getLogger(__name__)

SLOTS = 4  # send buffers per trainer rank: their bytes together are the transfer's bucket


class EngineNeeds:
    """What each engine rank of a generator reads, by engine shape, computed once each."""

    def __init__(self, model_dir: str, *, engine: str, tensor_parallel_size: int, expert_parallel: bool) -> None:
        self.model_dir = model_dir
        self.shapes: dict[str, tuple[int, ...]] = {}  # the published tensors (set before `per_rank`)
        self.engine = engine
        self.tensor_parallel_size = tensor_parallel_size
        self.expert_parallel = expert_parallel
        self._per_rank: list[dict[str, list[Box]]] | None = None

    def per_rank(self) -> list[dict[str, list[Box]]]:
        if self._per_rank is None:
            if self.engine != "vllm":
                self._per_rank = [{name: [whole(shape)] for name, shape in self.shapes.items()}]
            else:
                from shared_torch.engine_reads import engine_rank_reads

                t0 = time.perf_counter()
                self._per_rank = [
                    engine_rank_reads(
                        self.model_dir,
                        self.shapes,
                        tensor_parallel_size=self.tensor_parallel_size,
                        rank=r,
                        expert_parallel=self.expert_parallel,
                    )
                    for r in range(self.tensor_parallel_size)
                ]
                log.info(
                    "what each of %d engine ranks reads: worked out in %.1fs",
                    self.tensor_parallel_size,
                    time.perf_counter() - t0,
                )
        return self._per_rank

    @property
    def ranks(self) -> int:
        return 1 if self.engine != "vllm" else self.tensor_parallel_size


def reshard_order(
    holdings: Holdings,
    engine: EngineNeeds,
    members: list[str],
    *,
    trainer_ranks: int,
    dtype: str,
    itemsize: int,
    bucket_bytes: int,
    generator_info: dict[str, Any],
    delta: bool = False,
) -> tuple[ReshardOrder, Plan]:
    """The order of a resharding transfer to ``members`` (each an engine of ``engine``'s shape),
    and its plan. ``generator_info``: the group's address, port, size, id and timeout, which every
    generator's init info carries."""
    needs: Needs = {}
    for member in members:
        needs.update(generator_needs(member, engine.per_rank()))
    plan = make_plan(holdings, needs, itemsize)
    group_rank = {
        EngineRank(member, r): trainer_ranks + i * engine.ranks + r
        for i, member in enumerate(members)
        for r in range(engine.ranks)
    }
    slot_bytes = max(itemsize, bucket_bytes // SLOTS)
    pieces: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for send in plan.sends:
        for box in split(send.box, slot_bytes // itemsize):
            pieces[(send.source, group_rank[send.dest])].append((send.name, box))
    links: dict[int, Links] = defaultdict(dict)
    receives: dict[int, Links] = defaultdict(dict)
    for (source, dest), ps in sorted(pieces.items()):
        buckets = buckets_of(ps, itemsize, slot_bytes)
        links[source][dest] = buckets
        receives[dest][source] = buckets
    generators = {m: [group_rank[EngineRank(m, r)] for r in range(engine.ranks)] for m in members}
    workers = {
        **generator_info,
        "dtype": dtype,
        "delta": delta,
        "slot_bytes": slot_bytes,
        "shapes": {name: list(shape) for name, shape in engine.shapes.items()},
        "receives": {m: [encode_links(receives[g]) for g in ranks] for m, ranks in generators.items()},
    }
    order = ReshardOrder(
        trainer_ranks=trainer_ranks,
        dtype=dtype,
        slot_bytes=slot_bytes,
        slots=SLOTS,
        links=dict(links),
        generators=generators,
        workers=workers,
        total_bytes=plan.total_bytes,
        delta=delta,
    )
    figures = summary(plan, sum(_volume(s) for s in engine.shapes.values()) * itemsize, len(members))
    log.info(
        "resharding plan: %d bytes over %d links (%.3fx the model per generator), busiest link %d bytes",
        plan.total_bytes,
        figures["links"],
        figures["total_over_model_x_generators"],
        figures["busiest_link"]["bytes"],
    )
    return order, plan


def _volume(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
