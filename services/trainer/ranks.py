"""The trainer's ranks: this process's place among them, and the collectives the learner uses.

A trainer started by ``torchrun`` (``WORLD_SIZE`` > 1) joins one process group: NCCL on GPUs,
gloo on CPU, each with ``trainer.collective_timeout_s`` as the bound of every collective, so a
rank that died or hangs fails the others instead of stalling them. Rank 0 runs the control plane
and a learner; every other rank runs a learner only (`services.trainer.rank_worker`).

`Ranks` is what a backend needs to know of the others: its rank and the world size, a device mesh
to shard over, and the reductions that make every logged figure global (sums, maxima, gathered
objects). `SINGLE` is the one-process trainer, whose reductions return their input.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shared.netaddr import advertise_address, this_host

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


def launched_world_size() -> int:
    """The world size torchrun (or a cluster launcher) set for this process; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    device: torch.device
    # gloo group of every rank for background checkpoint writes, apart from the training collectives
    checkpoint_group: Any = None
    # the process group the reductions run over (None: every rank); see `over`
    group: Any = None
    # the bound of every collective (None: the process group's default)
    collective_timeout_s: float | None = None
    # each rank's (host name, address), in rank order: errors name the host a lost rank ran on
    hosts: tuple[tuple[str, str], ...] = ()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def over(self, group: Any) -> Ranks:
        """The same process's place in ``group`` (a subgroup of the ranks, e.g. the ranks that
        share out the data when tensor-parallel ranks see the same rows): its reductions and
        gathers run over that group only."""
        return Ranks(
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            device=self.device,
            checkpoint_group=self.checkpoint_group,
            group=group,
            collective_timeout_s=self.collective_timeout_s,
            hosts=self.hosts,
        )

    def mesh(self) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("fsdp",))

    def all_sum(self, values: list[float]) -> list[float]:
        if not self.sharded:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return [float(v) for v in t.tolist()]

    def all_max(self, values: list[float]) -> list[float]:
        if not self.sharded:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [float(v) for v in t.tolist()]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.sharded:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def lost_hosts(ranks: Ranks, error: BaseException) -> str:
    """Which of the trainer's hosts ``error`` (a failed collective) names, as "host h1 (10.0.0.2:
    rank 1)"; every rank's host when it names none."""
    text = str(error)
    named = [f"{name} ({addr}: rank {r})" for r, (name, addr) in enumerate(ranks.hosts) if r and addr in text]
    if named:
        return "lost host " + ", ".join(named)
    return "ranks on hosts " + ", ".join(f"{r}: {name} ({addr})" for r, (name, addr) in enumerate(ranks.hosts))


SINGLE = Ranks(rank=0, world_size=1, device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def join(collective_timeout_s: float) -> Ranks:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=collective_timeout_s))
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)
    hosts: list[tuple[str, str]] = [("", "")] * dist.get_world_size()
    dist.all_gather_object(hosts, (this_host(), advertise_address()), group=checkpoint_group)
    ranks = Ranks(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=device,
        checkpoint_group=checkpoint_group,
        collective_timeout_s=collective_timeout_s,
        hosts=tuple(tuple(h) for h in hosts),  # type: ignore[misc]
    )
    log.info("trainer rank %d of %d on %s (%s)", ranks.rank, ranks.world_size, device, backend)
    return ranks


LEAVE_BARRIER_S = 60.0


def leave(ranks: Ranks | None = None) -> None:
    """Leave the process group. Given ``ranks`` (a clean exit: every rank is leaving), the ranks
    first meet at a barrier on the gloo group, so that none tears its connections down while a peer
    is still reading the last message on them (a rank whose peer vanishes mid-message is aborted
    by gloo, "terminate called without an active exception"). A rank that does not come within
    ``LEAVE_BARRIER_S`` is named in a warning and the group is destroyed anyway; after a failure
    (no ``ranks``) there is no barrier."""
    if not dist.is_initialized():
        return
    if ranks is not None and ranks.world_size > 1 and ranks.checkpoint_group is not None:
        try:
            dist.monitored_barrier(
                group=ranks.checkpoint_group, timeout=datetime.timedelta(seconds=LEAVE_BARRIER_S), wait_all_ranks=True
            )
        except RuntimeError as exc:
            log.warning("rank %d: leaving without every rank at the barrier: %s", ranks.rank, exc)
    dist.destroy_process_group()


@contextlib.contextmanager
def leaving(ranks: Ranks) -> Iterator[None]:
    """Run the body, then `leave`: with the barrier when it returned, without it when it raised."""
    try:
        yield
    except BaseException:
        leave()
        raise
    leave(ranks)
