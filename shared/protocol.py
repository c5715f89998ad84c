"""The wire protocol: every message that crosses a process boundary through Redis, and the run
file a `streamrl up` job leaves for the command line.

Messages are msgspec Structs, tagged (field ``type``) so one decoder handles the union, encoded as
msgpack. Token ids and logprobs travel as packed little-endian int32/float32 bytes (see
`shared.tokens`). Every message carries the schema version ``v`` it was written with; a reader
rejects any other version loudly (`ProtocolError`), so a rolling upgrade never mis-reads entries.

Who writes what:
    trainer  -> tasks        Task                (consumer group "gateways")
    gateway  -> trajectories Trajectory          (consumer group "trainer")
    trainer  -> weights      WeightAnnouncement  (read by every generator)
    trainer  -> weights:snapshot WeightSnapshot  (one value: the newest version on disk)
    generator-> weight_acks  WeightAck           (read by the trainer while it waits on a refit)
    any      -> registry     Heartbeat           (worker registry, see `shared.registry`)
    any      -> deadletter   DeadLetter          (entries that failed to decode or validate)
    CLI      -> scale:request ScaleRequest       (`streamrl scale`, read by the `streamrl up` supervisor)
    supervisor -> scale:status ScaleStatus       (its progress on the latest request)
    supervisor -> run.json  RunFile              (a JSON file in the job's output folder, not a
                                                 stream entry: `streamrl status`, pause, resume,
                                                 validate and scale find the run through it)
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np

from shared.routes import RouteShape
from shared.tokens import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs

SCHEMA_VERSION = 1

TaskKind = Literal["train", "validation"]
RolloutStatus = Literal["ok", "failed", "env_flagged", "truncated"]
WorkerKind = Literal["generator", "gym_gateway", "trainer"]


class ProtocolError(ValueError):
    """An entry that cannot be decoded, has another schema version, or fails validation."""


class _Message(msgspec.Struct, kw_only=True, tag_field="type"):
    v: int = SCHEMA_VERSION


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """Sampling parameters of one request profile (train or validation)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 256
    kind: TaskKind = "train"


class Task(_Message, tag="task"):
    """One rollout to run: issued by the trainer's scheduler, consumed by one gateway worker."""

    task_id: str
    group_id: str
    index_in_group: int
    group_size: int
    prompt_index: int
    env: str
    instance: dict[str, Any]
    kind: TaskKind
    target_step: int
    sampling: SamplingParams
    deadline_s: float
    issued_at: float = msgspec.field(default_factory=time.time)
    attempt: int = 0
    # W3C trace context of the trajectory's trace (`shared.tracing`); empty when tracing is off.
    traceparent: str = ""
    tracestate: str = ""


class Turn(msgspec.Struct, kw_only=True):
    """One model call of a rollout.

    ``prompt_ids`` holds only the prompt tokens that are new relative to the rollout's context:
    the prompt the engine saw is ``context[:context_len] + prompt_ids``. When the agent's history
    is token-exact, ``context_len`` equals the length of everything before this turn.
    """

    prompt_ids: bytes
    context_len: int
    generated_ids: bytes
    generated_logprobs: bytes
    weight_version: int
    weight_version_end: int
    finish_reason: str = "stop"
    generator_id: str = ""
    latency_s: float = 0.0
    # (first generated token index, weight version) per segment when a refit split this call
    # (the generator continued it on the new weights); empty: every token came from weight_version.
    version_spans: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # With policy.moe_routing_replay: the MoE routes the generator returned for the positions
    # routes_start .. of the sequence it ran (context[:context_len] + prompt + generated, the last
    # token excepted), packed (`shared.routes`, the trajectory's route_shape); empty when none came.
    routes: bytes = b""
    routes_start: int = 0

    def versions(self) -> list[int]:
        """The weight versions that generated this call's tokens, oldest first."""
        return [v for _, v in self.version_spans] if self.version_spans else [self.weight_version]

    def prompt(self) -> np.ndarray:
        return unpack_ids(self.prompt_ids)

    def generated(self) -> np.ndarray:
        return unpack_ids(self.generated_ids)

    def logprobs(self) -> np.ndarray:
        return unpack_logprobs(self.generated_logprobs)


class Trajectory(_Message, tag="trajectory"):
    """One finished rollout, published by the gateway after the environment scored it."""

    task_id: str
    group_id: str
    index_in_group: int
    group_size: int
    prompt_index: int
    env: str
    kind: TaskKind
    target_step: int
    launch_version: int
    reward: float
    status: RolloutStatus
    turns: list[Turn]
    # Why a rollout failed or was cut ("timeout: ...", "sandbox: ...", "model_refused: ..."), and
    # whose fault it was: "infra" (status failed: the failure policy decides) or "policy" (the
    # model's own doing, e.g. it filled the context: trained as a truncated rollout).
    fallback_reason: str | None = None
    failure_kind: Literal["infra", "policy"] | None = None
    # The environment's "do not train on this" flag (e.g. an iteration cap was hit). Carried as
    # True/False on every rollout when env.should_mask_flagged_samples is on; left out of the
    # record entirely (UNSET, not False) when it is off.
    mask_sample: bool | msgspec.UnsetType = msgspec.UNSET
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    gateway_id: str = ""
    route_shape: RouteShape | None = None  # the turns' routes (policy.moe_routing_replay)
    started_at: float = 0.0
    finished_at: float = 0.0
    traceparent: str = ""  # W3C trace context of its publish span (`shared.tracing`); empty: not traced
    tracestate: str = ""

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t.generated_ids) // 4 for t in self.turns)

    @property
    def versions(self) -> list[int]:
        """The weight versions that generated this rollout's tokens."""
        return sorted({v for t in self.turns for v in t.versions()})


WeightTransportName = Literal["filesystem", "collective"]


class CollectiveOrder(msgspec.Struct, kw_only=True, frozen=True):
    """The control message of a collective weight transfer (``refit.transport: collective``).

    Without ``update_info``: join group ``group_id`` (vLLM's ``init_weight_transfer_engine`` with
    ``init_info``, ``rank_offset`` set to ``ranks[worker_id]``); the trainer's sending rank opens it
    meanwhile. With ``update_info``: receive the announced version over that group (vLLM's
    ``start_weight_update``, ``update_weights(update_info)``, ``finish_weight_update``). Generators
    not in ``ranks`` ignore it."""

    group_id: str
    backend: str  # vLLM weight-transfer engine: gloo (CPU) or nccl
    init_info: dict[str, Any]
    ranks: dict[str, int]  # worker_id -> the rank of its first engine worker in the group
    update_info: dict[str, Any] | None = None


class WeightSnapshot(_Message, tag="weight_snapshot"):
    """A weight version on disk (safetensors folder + per-file digests): what a generator that
    starts mid-run loads when the run's versions move by a collective transport."""

    version: int
    path: str
    checksum: str
    files: dict[str, str] = msgspec.field(default_factory=dict)
    num_bytes: int = 0


class WeightAnnouncement(_Message, tag="weights"):
    """Weight version ``version`` is ready: in the safetensors folder ``path`` (transport
    ``filesystem``; ``files`` maps each file to its digest, ``checksum`` names the folder), or over
    the collective group ``collective`` names (transport ``collective``; ``checksum`` empty: each
    generator reports what it received in its ack)."""

    version: int
    path: str = ""
    checksum: str = ""
    num_bytes: int = 0
    transport: WeightTransportName = "filesystem"
    files: dict[str, str] = msgspec.field(default_factory=dict)
    collective: CollectiveOrder | None = None
    format: Literal["safetensors"] = "safetensors"
    mode: Literal["drain", "keep"] = "drain"
    probe: list[int] = msgspec.field(default_factory=list)  # token ids each generator scores once loaded
    created_at: float = msgspec.field(default_factory=time.time)


class WeightAck(_Message, tag="weight_ack"):
    """A generator's answer to a WeightAnnouncement. After a collective transfer ``checksum`` is
    the digest of what it received and ``engine_checksum`` a digest of the engine's own
    per-parameter checksums (equal on every generator holding the same weights)."""

    worker_id: str
    version: int
    ok: bool
    error: str | None = None
    cache_reset: bool = False
    load_s: float = 0.0
    checksum: str | None = None
    engine_checksum: str | None = None
    group: str | None = None  # the transfer group of a collective version
    # the announcement's probe scored at this version: token t's logprob given tokens < t, t >= 1
    probe_logprobs: list[float] | None = None
    at: float = msgspec.field(default_factory=time.time)


WorkerState = Literal["starting", "ready", "paused", "loading", "failed", "draining", "awaiting_weights"]


class Heartbeat(_Message, tag="heartbeat", kw_only=True):
    """A live worker's registry record, refreshed every few seconds."""

    worker_id: str
    kind: WorkerKind
    url: str
    pid: int = msgspec.field(default_factory=os.getpid)  # the sending process's, unless given
    host: str = msgspec.field(default_factory=socket.gethostname)
    state: WorkerState
    weight_version: int = -1
    in_flight: int = 0
    started_at: float = 0.0
    at: float = msgspec.field(default_factory=time.time)
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    error: str | None = None


class DeadLetter(_Message, tag="deadletter"):
    """An entry that could not be used, with the reason; the raw payload is kept for audit."""

    source: str
    entry_id: str
    reason: str
    payload: bytes
    at: float = msgspec.field(default_factory=time.time)


class ScaleRequest(_Message, tag="scale_request"):
    """`streamrl scale` to a running `streamrl up`: the wanted number of workers per service
    ("generator", "gym-gateway"); services left out keep their count. The latest request wins."""

    request_id: str
    targets: dict[str, int]
    at: float = msgspec.field(default_factory=time.time)


class ScaleStatus(_Message, tag="scale_status"):
    """The supervisor's progress on the latest ScaleRequest, counts per service."""

    request_id: str
    phase: Literal["scaling", "done", "failed"]
    ready: dict[str, int]  # started and answering /ready
    starting: dict[str, int] = msgspec.field(default_factory=dict)  # started, not ready yet
    stopping: dict[str, int] = msgspec.field(default_factory=dict)  # signalled, still draining
    error: str | None = None
    at: float = msgspec.field(default_factory=time.time)


class RunChild(msgspec.Struct, kw_only=True):
    """One child process of a `streamrl up` job, as its run file records it."""

    pid: int | None  # None: not started
    url: str
    log: str  # its log file


class RunFile(msgspec.Struct, kw_only=True):
    """``run.json`` in the output folder of a `streamrl up` job: written by its supervisor once every
    service is up, and again whenever a child is restarted or the worker counts change. Read by
    `streamrl status` (run id, Redis, trainer), ``pause``/``resume``/``validate`` (the trainer's
    URL) and ``scale`` (run id, Redis). JSON, not a stream message: no tag and no schema version;
    a field this reader does not know is ignored."""

    run_id: str
    trainer_url: str
    redis_url: str  # without its password (`shared.auth.redact_url`): a reader then needs REDIS_URL
    children: dict[str, RunChild] = {}  # by name: generator-0, gateway-0, trainer, ...
    restarts: dict[str, int] = {}  # per service, by the supervisor (supervisor.max_restarts)


RUN_FILE = "run.json"


def write_run_file(folder: Path, run: RunFile) -> None:
    """Write ``run`` as ``folder/run.json`` (indented: people read it too)."""
    (folder / RUN_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(run), indent=2))


def read_run_file(path: Path) -> RunFile:
    """The run file at ``path``; ProtocolError naming the file and the field when it is not one."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=RunFile)
    except msgspec.DecodeError as exc:  # not JSON, or a field missing or of the wrong type
        raise ProtocolError(f"{path} is not the run file of a `streamrl up` job: {exc}") from exc


Message = (
    Task
    | Trajectory
    | WeightAnnouncement
    | WeightAck
    | WeightSnapshot
    | Heartbeat
    | DeadLetter
    | ScaleRequest
    | ScaleStatus
)
M = TypeVar("M", bound=_Message)


class _Header(msgspec.Struct):
    type: str = ""
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}  # one per message type


def encode(msg: _Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, expected: type[M]) -> M:
    """Decode ``data`` as ``expected``; raise ProtocolError naming what is wrong."""
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable entry: {exc}") from exc
    tag = expected.__struct_config__.tag
    if header.type != tag:
        raise ProtocolError(f"expected a {tag!r} message, got type {header.type!r}")
    if header.v != SCHEMA_VERSION:
        raise ProtocolError(
            f"{tag!r} message has schema version {header.v}; this reader understands only version {SCHEMA_VERSION}"
        )
    decoder = _decoders.get(expected)
    if decoder is None:
        decoder = _decoders[expected] = msgspec.msgpack.Decoder(expected)
    try:
        msg: M = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"invalid {tag!r} message: {exc}") from exc
    _validate(msg)
    return msg


def _validate(msg: _Message) -> None:
    """Semantic checks msgspec's types cannot express."""
    if isinstance(msg, Trajectory):
        if not 0 <= msg.index_in_group < msg.group_size:
            raise ProtocolError(
                f"trajectory {msg.task_id}: index_in_group {msg.index_in_group} outside group of {msg.group_size}"
            )
        for i, turn in enumerate(msg.turns):
            for name in ("prompt_ids", "generated_ids", "generated_logprobs"):
                if len(getattr(turn, name)) % 4:
                    raise ProtocolError(f"trajectory {msg.task_id}: turns[{i}].{name} is not packed 32-bit data")
            if len(turn.generated_ids) != len(turn.generated_logprobs):
                raise ProtocolError(
                    f"trajectory {msg.task_id}: turns[{i}] has {len(turn.generated_ids) // 4} generated ids "
                    f"but {len(turn.generated_logprobs) // 4} logprobs"
                )
            if turn.context_len < 0:
                raise ProtocolError(f"trajectory {msg.task_id}: turns[{i}].context_len is negative")
        if not np.isfinite(msg.reward):
            raise ProtocolError(f"trajectory {msg.task_id}: reward is not finite")
    elif isinstance(msg, Task):
        if not 0 <= msg.index_in_group < msg.group_size:
            raise ProtocolError(f"task {msg.task_id}: index_in_group outside group")
    elif isinstance(msg, WeightAnnouncement):
        if msg.transport == "filesystem" and not msg.path:
            raise ProtocolError(f"weight version {msg.version}: a filesystem announcement needs a path")
        if msg.transport == "collective" and msg.collective is None:
            raise ProtocolError(f"weight version {msg.version}: a collective announcement needs its order")


def make_turn(
    *,
    prompt_ids: list[int] | np.ndarray,
    context_len: int,
    generated_ids: list[int] | np.ndarray,
    generated_logprobs: list[float] | np.ndarray,
    weight_version: int,
    weight_version_end: int | None = None,
    **kwargs: Any,
) -> Turn:
    """Build a Turn from plain sequences, packing the arrays."""
    return Turn(
        prompt_ids=pack_ids(prompt_ids),
        context_len=context_len,
        generated_ids=pack_ids(generated_ids),
        generated_logprobs=pack_logprobs(generated_logprobs),
        weight_version=weight_version,
        weight_version_end=weight_version if weight_version_end is None else weight_version_end,
        **kwargs,
    )
