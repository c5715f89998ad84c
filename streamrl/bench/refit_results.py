"""The refit section's figures: each size's (`figures`, from what the workers reported,
`streamrl.bench.refit_runs`), the reference run modelled from the largest (`extrapolate`), and the
section's `RefitResults` (`summarize`), rendered by ``templates/refit.md.jinja``. Called by
`streamrl.bench.refit`."""

from __future__ import annotations

import statistics

import msgspec

from streamrl.bench.refit_runs import BringUp, HashRates, RefitRun, SizeRun
from streamrl.bench.report import GIB, Results

# -- one size's figures ----------------------------------------------------------------------------


class Spread(msgspec.Struct):
    median: float
    min: float
    max: float


class Range(msgspec.Struct):
    lo: float
    hi: float


class TransportFigures(msgspec.Struct):
    """Medians of one transport's timed refits."""

    total: Spread
    save_s: float
    confirm_s: float
    load_s: float
    num_bytes: float
    n: int


class SizeFigures(msgspec.Struct):
    name: str
    peak_memory_bytes: int
    filesystem: TransportFigures
    collective: TransportFigures
    num_bytes: float  # published
    broadcast_s: float
    broadcast_bytes: int
    write_read_s: float  # baseline B: save_file + load_file back
    save_file_s: float
    load_file_s: float
    cast_s: float
    hash_gib_s: HashRates
    collective_ratio: float  # collective bandwidth over raw broadcast bandwidth
    filesystem_ratio: float  # filesystem time over raw write+read
    load_avg_refits: Range
    load_avg_baselines: Range
    bring_up: BringUp


def _spread(values: list[float]) -> Spread:
    return Spread(statistics.median(values), min(values), max(values))


def _transport(runs: list[RefitRun]) -> TransportFigures:
    return TransportFigures(
        total=_spread([r.total_s for r in runs]),
        save_s=statistics.median(r.save_s for r in runs),
        confirm_s=statistics.median(r.confirm_s for r in runs),
        load_s=statistics.median(r.load_s for r in runs),
        num_bytes=statistics.median(r.num_bytes for r in runs),
        n=len(runs),
    )


def figures(size: SizeRun) -> SizeFigures:
    """One size's medians (timed refits only), baselines and the ratios the targets name."""
    timed = [r for r in size.refit.refits if not r.warm_up]
    fs = _transport([r for r in timed if r.transport == "filesystem"])
    coll = _transport([r for r in timed if r.transport == "collective"])
    prep, bcast = size.prepare, size.broadcast
    base_load = [r.load_avg for r in prep.rounds[1:]] + [bcast.load_avg]
    refit_load = [r.load_avg for r in timed]
    return SizeFigures(
        name=size.name,
        peak_memory_bytes=size.peak_memory_bytes,
        filesystem=fs,
        collective=coll,
        num_bytes=coll.num_bytes,
        broadcast_s=bcast.s,
        broadcast_bytes=bcast.num_bytes,
        write_read_s=prep.total_s,
        save_file_s=prep.save_s,
        load_file_s=prep.load_s,
        cast_s=prep.cast_s,
        hash_gib_s=prep.hash_gib_s,
        # bandwidth ratio: bytes over time on each side (the same bytes, both from the parameter list)
        collective_ratio=(coll.num_bytes / coll.total.median) / (bcast.num_bytes / bcast.s),
        filesystem_ratio=fs.total.median / prep.total_s,
        load_avg_refits=Range(min(refit_load), max(refit_load)),
        load_avg_baselines=Range(min(base_load), max(base_load)),
        bring_up=size.refit.bring_up_s,
    )


# -- the reference run, modelled -------------------------------------------------------------------


class Reference(msgspec.Struct, frozen=True, kw_only=True):
    """The run the extrapolation is for, and the hardware it assumes (assumptions, not measured)."""

    params: float = 397e9  # Qwen3.5-397B-A17B
    bytes_per_param: int = 2  # bfloat16
    trainer_ranks: int = 64
    generators: int = 24
    gpus_per_generator: int = 8  # 92.5 GiB of weights per GPU: an 8-GPU H200-class node per engine
    network_gib_s: float = 40.0  # NCCL broadcast over one 400 Gb/s InfiniBand NIC per GPU
    parallel_fs_gib_s: float = 100.0  # aggregate parallel-filesystem bandwidth, reads or writes

    @property
    def num_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def gib(self) -> float:
        return self.num_bytes / GIB

    @property
    def rank_share_gib(self) -> float:
        """What each trainer rank writes."""
        return self.gib / self.trainer_ranks

    @property
    def per_gpu_gib(self) -> float:
        """What each generator GPU holds."""
        return self.gib / self.gpus_per_generator

    @property
    def wire_s(self) -> float:
        """The model once over the network."""
        return self.gib / self.network_gib_s

    @property
    def read_all_s(self) -> float:
        """Every generator reading the model from the parallel filesystem at once."""
        return self.generators * self.gib / self.parallel_fs_gib_s

    @property
    def delta_sync_s(self) -> tuple[float, float]:
        """verl's delta sync (published: it sends 1-3% of the bf16 bytes) at our network's rate."""
        return 0.01 * self.wire_s, 0.03 * self.wire_s


class Extrapolation(msgspec.Struct):
    """The measured per-byte costs of the largest size scaled to `reference` (a model, not a
    measurement). Seconds of each way of refitting the reference run, and the rates behind them."""

    reference: Reference
    write_rate_gib_s: float  # one trainer rank's export
    write_s: float  # each rank writing its share (or the filesystem's bandwidth, if slower)
    load_rate_gib_s: float  # one generator's verify + reload
    read_one_s: float  # one generator reading the whole model
    filesystem_s: float
    overhead: float  # the collective refit over the raw broadcast, as measured
    collective_s: float
    overhead_on_gpu: float  # without the trainer's one-thread CPU cast
    collective_gpu_s: float
    checksums_s: float  # vLLM's sha256 over each GPU's weights, after the transfer
    sha_refit_s: float  # sha256 of the model on each side: the refit this project used before


def extrapolate(fig: SizeFigures, ref: Reference | None = None) -> Extrapolation:
    """The measured per-byte costs of ``fig`` (the largest size) scaled to ``ref`` (default: `Reference`)."""
    ref = ref or Reference()
    fs, coll = fig.filesystem, fig.collective
    write_rate = fs.num_bytes / fs.save_s / GIB
    load_rate = fs.num_bytes / fs.load_s / GIB
    write_s = max(ref.rank_share_gib / write_rate, ref.gib / ref.parallel_fs_gib_s)
    read_s = max(ref.gib / load_rate, ref.read_all_s)
    overhead = coll.total.median / fig.broadcast_s
    overhead_on_gpu = max(1.0, (coll.total.median - fig.cast_s) / fig.broadcast_s)
    sha = fig.hash_gib_s.sha256
    return Extrapolation(
        reference=ref,
        write_rate_gib_s=write_rate,
        write_s=write_s,
        load_rate_gib_s=load_rate,
        read_one_s=ref.gib / load_rate,
        filesystem_s=write_s + read_s,
        overhead=overhead,
        collective_s=ref.wire_s * overhead,
        overhead_on_gpu=overhead_on_gpu,
        collective_gpu_s=ref.wire_s * overhead_on_gpu,
        checksums_s=ref.per_gpu_gib / sha,
        sha_refit_s=2 * ref.gib / sha,
    )


# -- the section -----------------------------------------------------------------------------------


class SizeRow(msgspec.Struct):
    """One size in the section's first table, and its generator bring-up."""

    name: str
    published_gib: float
    filesystem: Spread  # seconds, publish to confirmed
    collective: Spread
    broadcast_s: float
    broadcast_gib_s: float
    write_read_s: float
    collective_ratio: float
    filesystem_ratio: float
    load_avg_refits: Range
    load_avg_baselines: Range
    bring_up: BringUp


class Phases(msgspec.Struct):
    """Medians of one transport's refits at the largest size, seconds."""

    save_s: float  # RefitReport.save_s: moving the bytes
    confirm_s: float  # then until confirmed
    load_s: float  # the generator's, from its ack


class Largest(msgspec.Struct):
    """Where the time goes at the largest size, and what it needed of the host."""

    published_gib: float
    collective_ratio: float
    filesystem_ratio: float
    filesystem: Phases
    collective: Phases
    collective_total_s: float  # median, publish to confirmed
    cast_s: float
    save_file_s: float
    load_file_s: float
    broadcast_s: float
    hash_gib_s: HashRates
    peak_memory_gib: float


class RefitResults(Results):
    date: str
    machine: str
    cores: int
    memory_gib: float  # the host's
    refits: int  # timed per transport and size
    bucket_mb: int
    sizes: list[SizeRow]
    largest: Largest
    model: Extrapolation  # the reference run, modelled from the largest size's costs
    section_s: float
    notes: list[str] = []  # paragraphs written by hand about this run; a new run starts without

    @property
    def twice_fits(self) -> bool:
        """Whether a model twice the largest would fit the host's memory at its refits' peak."""
        return 2 * self.largest.peak_memory_gib <= self.memory_gib


def _row(f: SizeFigures) -> SizeRow:
    return SizeRow(
        name=f.name,
        published_gib=f.num_bytes / GIB,
        filesystem=f.filesystem.total,
        collective=f.collective.total,
        broadcast_s=f.broadcast_s,
        broadcast_gib_s=f.broadcast_bytes / GIB / f.broadcast_s,
        write_read_s=f.write_read_s,
        collective_ratio=f.collective_ratio,
        filesystem_ratio=f.filesystem_ratio,
        load_avg_refits=f.load_avg_refits,
        load_avg_baselines=f.load_avg_baselines,
        bring_up=f.bring_up,
    )


def _largest(f: SizeFigures) -> Largest:
    def phases(t: TransportFigures) -> Phases:
        return Phases(t.save_s, t.confirm_s, t.load_s)

    return Largest(
        published_gib=f.num_bytes / GIB,
        collective_ratio=f.collective_ratio,
        filesystem_ratio=f.filesystem_ratio,
        filesystem=phases(f.filesystem),
        collective=phases(f.collective),
        collective_total_s=f.collective.total.median,
        cast_s=f.cast_s,
        save_file_s=f.save_file_s,
        load_file_s=f.load_file_s,
        broadcast_s=f.broadcast_s,
        hash_gib_s=f.hash_gib_s,
        peak_memory_gib=f.peak_memory_bytes / GIB,
    )


def summarize(
    sizes: list[SizeRun],
    *,
    date: str,
    machine: str,
    cores: int,
    memory_bytes: int,
    refits: int,
    bucket_mb: int,
    section_s: float,
) -> RefitResults:
    """The section's figures from every size's runs (the model from the largest)."""
    figs = [figures(s) for s in sizes]
    return RefitResults(
        date=date,
        machine=machine,
        cores=cores,
        memory_gib=memory_bytes / GIB,
        refits=refits,
        bucket_mb=bucket_mb,
        sizes=[_row(f) for f in figs],
        largest=_largest(figs[-1]),
        model=extrapolate(figs[-1]),
        section_s=section_s,
    )
