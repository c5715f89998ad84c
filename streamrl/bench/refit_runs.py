"""What the refit section's worker processes report: `streamrl.bench.refit_worker` writes these as
JSON, `streamrl.bench.refit` reads them back, one `SizeRun` per model size."""

from __future__ import annotations

import msgspec


class SaveLoadRound(msgspec.Struct):
    save_s: float
    load_s: float
    total_s: float
    load_avg: float


class HashRates(msgspec.Struct):
    """GiB/s over the model's bytes, one thread."""

    sha256: float
    xxh3_128: float


class Prepared(msgspec.Struct):
    """``prepare``: the model built, baseline B (save_file + load_file back), hashes, the cast."""

    build_s: float
    num_bytes: int
    rounds: list[SaveLoadRound]  # the first is a warm-up
    save_s: float  # medians of the timed rounds
    load_s: float
    total_s: float
    hash_gib_s: HashRates
    cast_s: float  # float32 -> bfloat16, one thread


class Broadcast(msgspec.Struct):
    """``broadcast``: baseline A, rank 0's view."""

    num_bytes: int
    buckets: int
    rounds_s: list[float]  # the first is a warm-up
    s: float  # median of the timed rounds
    load_avg: float


class RefitRun(msgspec.Struct):
    """One `WeightPublisher.refit`, timed by its `RefitReport` and the generator's ack."""

    transport: str  # filesystem, collective
    version: int
    warm_up: bool
    total_s: float
    save_s: float
    confirm_s: float
    num_bytes: int
    attempts: int
    load_s: float
    load_avg: float


class BringUp(msgspec.Struct):
    """Generator process start to /ready, seconds, by ``load_format``."""

    dummy: float
    auto: float


class Refits(msgspec.Struct):
    """``refit``: every refit of both transports, and the generator's bring-up both ways."""

    bring_up_s: BringUp
    refits: list[RefitRun]


class SizeRun(msgspec.Struct):
    """The three parts for one model size."""

    name: str  # "59M"
    params: int
    prepare: Prepared
    broadcast: Broadcast
    refit: Refits
    peak_memory_bytes: int  # in use on the host during the refits
