"""Where this rank sits among the trainer's ranks: the `Layout`, computed from the config and the
world before any model is built, and passed to everything that trains.

    world     every rank of the trainer (`services.trainer.ranks.Ranks`)
    data      the ranks that share out a step's rows; the others in a rank's tensor-parallel or
              pipeline group train the same rows (FSDP2: every rank is a data rank)
    pipeline  one rank per stage, this rank's stage among them (one rank, itself, without stages)
    stage     the ranks of this rank's stage, which deal its tensors among them when publishing
    experts   this rank's place among the expert-parallel ranks

Two reductions follow from it: an update's loss and token counts summed over the ranks that
scored its rows (`sum_over_data`: only the last stage scores, so the stages are summed first),
and what the last stage computed, on every stage (`from_last_stage`). Without stages both are
the data ranks' plain reductions. Built by the model adapters (`hf_adapter.data_parallel`,
`megatron_layout`); read by the backend, the step runner and the learner over many ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from services.trainer.ranks import Ranks

T = TypeVar("T")


@dataclass(frozen=True)
class Layout:
    world: Ranks
    data: Ranks
    data_rank_of: tuple[int, ...]  # global rank -> its data rank
    pipeline: Ranks
    stage: Ranks
    layer_offset: int = 0  # the global number of this stage's first layer
    expert_rank: int = 0
    expert_size: int = 1

    @property
    def pipelined(self) -> bool:
        return self.pipeline.world_size > 1

    @property
    def first_stage(self) -> bool:
        return self.pipeline.rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pipeline.rank == self.pipeline.world_size - 1

    def sum_over_data(self, values: list[float]) -> list[float]:
        """Figures summed over the stages (only the last one scored the rows), then the data ranks."""
        return self.data.all_sum(self.pipeline.all_sum(values))

    def from_last_stage(self, obj: T) -> T:
        """The last stage's ``obj``, on every stage (collective over the pipeline)."""
        if not self.pipelined:
            return obj
        last: T = self.pipeline.gather(obj)[-1]
        return last


def alone(world: Ranks) -> Ranks:
    """This rank as a group of one (its reductions return their input)."""
    return Ranks(rank=0, world_size=1, device=world.device, collective_timeout_s=world.collective_timeout_s)


def data_parallel(world: Ranks) -> Layout:
    """Every rank a data rank, no stages, no experts split (one rank, or FSDP2 over all)."""
    return Layout(
        world=world,
        data=world,
        data_rank_of=tuple(range(world.world_size)),
        pipeline=alone(world),
        stage=world,
    )
