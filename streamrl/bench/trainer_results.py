"""What the trainer section's worker processes report (`streamrl.bench.trainer_worker` writes,
`streamrl.bench.trainer` reads), the section's `TrainerResults`, and the pure functions between
them (medians of paired steps, training state per rank, checkpoint saves, policy builds, the
megatron layouts)."""

from __future__ import annotations

import statistics

import msgspec

from streamrl.bench.report import MIB, Results

# -- what the workers report ---------------------------------------------------------------------


class PairedRound(msgspec.Struct):
    """One round of two sides alternated step by step: a step of each, seconds."""

    side_s: float  # the backend (compare), the learner over every rank (scale)
    base_s: float  # the bare loop (compare), the one-rank learner (scale)
    load_avg: float


class StateBytes(msgspec.Struct):
    """Bytes of one rank's training state (a DTensor's local shard, a sharded optimizer's own part)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


class Save(msgspec.Struct):
    """One `save_checkpoint`, the slowest rank's seconds."""

    is_async: bool
    warm_up: bool
    blocking_s: float  # until it returned
    on_disk_s: float  # until `wait_for_save` returned
    num_bytes: int


class Build(msgspec.Struct):
    """One rank building the policy."""

    peak_growth: int  # bytes of private (anonymous) memory
    seconds: float
    bytes_read: int | None  # of the checkpoint


class WorkerOut(msgspec.Struct, kw_only=True):
    """What a worker writes (rank 0); each mode fills its part."""

    world_size: int = 0  # set by the worker's main, as the batch's tokens
    tokens: int = 0
    rounds: list[PairedRound] = []  # compare, scale
    backend_loss: float | None = None  # compare: the first step's
    bare_loss: float | None = None
    step_s: list[float] = []  # alone
    state: StateBytes | None = None  # alone: rank 0's after the steps
    load_avg: float = 0.0  # alone: after the steps
    single: StateBytes | None = None  # state: one rank's after one step
    ranks: list[StateBytes] = []  # state: every rank's after one step
    saves: list[Save] = []  # state
    builds: list[Build] = []  # load: every rank's


# -- the section's figures -------------------------------------------------------------------------


class Paired(msgspec.Struct):
    """Tokens/s of each side (tokens over its median step time) and side/base as the median of the
    rounds' ratios of throughput, with their range."""

    tok_s: float
    base_tok_s: float
    ratio: float
    ratio_min: float
    ratio_max: float


class Losses(msgspec.Struct):
    backend: float
    bare: float


class Range(msgspec.Struct):
    lo: float
    hi: float


class MemoryRow(msgspec.Struct):
    kind: str  # params, grads, optimizer, total
    single_mib: float  # at one rank
    per_rank_mib: float  # the largest rank's at many
    ratio: float


class SaveTimes(msgspec.Struct):
    blocking_s: float
    on_disk_s: float


class Checkpoints(msgspec.Struct):
    """Medians of the timed saves, synchronous and asynchronous, and asynchronous over synchronous."""

    shards_mib: float
    n: int  # timed saves each way
    sync: SaveTimes
    asynchronous: SaveTimes
    ratio: SaveTimes


class BuildFigures(msgspec.Struct):
    """Building the policy one way, the largest rank's figures."""

    peak_growth_mib: float
    bytes_read_mib: float | None
    seconds: float


class Loading(msgspec.Struct):
    whole: BuildFigures  # the whole checkpoint on every rank, then sharded
    shards: BuildFigures  # each rank reads its own rows
    growth_ratio: float  # shards / whole
    seconds_ratio: float


class LayoutRow(msgspec.Struct):
    """A megatron layout at many ranks against one rank of the same model."""

    name: str
    tok_s: float
    base_tok_s: float
    ratio: float
    state_ratio: float  # rank 0's training state over one rank's


class LayoutRun(msgspec.Struct):
    """A megatron layout timed alone."""

    tok_s: float
    state_bytes: int
    load_avg: float


class Megatron(msgspec.Struct):
    first_loss: Losses
    throughput: Paired  # against the bare loop, one rank
    layouts: list[LayoutRow]


class TrainerResults(Results):
    date: str
    machine: str
    cores: int
    world_size: int
    small_params_m: float  # millions of parameters: throughput model
    large_params_m: float  # memory and checkpoint model
    tokens: int  # of the throughput batch
    rounds: int  # alternated steps per side
    first_loss: Losses
    throughput: Paired  # the backend against the bare loop, one rank
    scaling: Paired  # world_size ranks against one
    load_avg_throughput: Range
    load_avg_scaling: Range
    memory: list[MemoryRow]
    checkpoint: Checkpoints
    loading: Loading | None
    megatron: Megatron | None  # None without megatron-core
    section_s: float


def paired(rounds: list[PairedRound], tokens: int) -> Paired:
    ratios = [r.base_s / r.side_s for r in rounds]
    return Paired(
        tok_s=tokens / statistics.median(r.side_s for r in rounds),
        base_tok_s=tokens / statistics.median(r.base_s for r in rounds),
        ratio=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
    )


def load_range(rounds: list[PairedRound]) -> Range:
    return Range(min(r.load_avg for r in rounds), max(r.load_avg for r in rounds))


def memory(single: StateBytes, ranks: list[StateBytes]) -> list[MemoryRow]:
    """Training state at one rank and per rank at many (the largest rank's), by kind, MiB."""
    rows = []
    for kind in ("params", "grads", "optimizer", "total"):
        one = getattr(single, kind)
        each = max(getattr(r, kind) for r in ranks)
        rows.append(MemoryRow(kind, one / MIB, each / MIB, each / one))
    return rows


def checkpoints(saves: list[Save]) -> Checkpoints:
    """Medians of the timed (not warm-up) saves, synchronous and asynchronous."""
    medians = {}
    for is_async in (False, True):
        timed = [s for s in saves if s.is_async == is_async and not s.warm_up]
        medians[is_async] = SaveTimes(
            statistics.median(s.blocking_s for s in timed), statistics.median(s.on_disk_s for s in timed)
        )
    sync, asyn = medians[False], medians[True]
    timed_sync = [s for s in saves if not s.is_async and not s.warm_up]
    return Checkpoints(
        shards_mib=statistics.median(s.num_bytes for s in timed_sync) / MIB,
        n=len(timed_sync),
        sync=sync,
        asynchronous=asyn,
        ratio=SaveTimes(asyn.blocking_s / sync.blocking_s, asyn.on_disk_s / sync.on_disk_s),
    )


def _largest(builds: list[Build], *, counts_bytes: bool) -> BuildFigures:
    growth = max(b.peak_growth for b in builds)
    read = max(b.bytes_read or 0 for b in builds) / MIB if counts_bytes else None
    return BuildFigures(growth / MIB, read, max(b.seconds for b in builds))


def loading(whole: list[Build], shards: list[Build]) -> Loading:
    """Building the policy both ways: the largest rank's figures of each (loaded whole, every rank
    reads the whole file), and shards over whole."""
    w, s = _largest(whole, counts_bytes=False), _largest(shards, counts_bytes=True)
    growth_ratio = s.peak_growth_mib / max(w.peak_growth_mib, 1 / MIB)
    return Loading(w, s, growth_ratio, s.seconds / w.seconds)


def megatron_figures(compare: WorkerOut, layouts: dict[str, LayoutRun]) -> Megatron:
    """The megatron backend against the bare loop, and each layout at many ranks against the
    one-rank run of the same model (``dense, 1 rank``, ``MoE, 1 rank``)."""
    assert compare.backend_loss is not None and compare.bare_loss is not None  # compare mode fills them
    base = {"dense": layouts["dense, 1 rank"], "MoE": layouts["MoE, 1 rank"]}
    rows = []
    for name, r in layouts.items():
        if "1 rank" in name:
            continue
        b = base["MoE" if name.startswith("MoE") else "dense"]
        rows.append(LayoutRow(name, r.tok_s, b.tok_s, r.tok_s / b.tok_s, r.state_bytes / b.state_bytes))
    return Megatron(Losses(compare.backend_loss, compare.bare_loss), paired(compare.rounds, compare.tokens), rows)
