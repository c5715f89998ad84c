"""Every Redis key, stream, consumer group, TTL and length limit streamrl uses, in one place.

All keys of a run live under ``streamrl:{<run_id>}:`` (the braces are a Redis Cluster hash tag,
so one run maps to one slot and multi-key operations stay legal on a cluster).
"""

from __future__ import annotations

from dataclasses import dataclass

# Consumer groups.
GATEWAYS_GROUP = "gateways"
TRAINER_GROUP = "trainer"

# Worker registry: a worker is alive while its heartbeat is younger than this.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 10.0

# Approximate caps (XADD MAXLEN ~) for streams that are logs rather than work queues.
DEADLETTER_MAXLEN = 100_000
WEIGHT_ACKS_MAXLEN = 10_000
WEIGHTS_MAXLEN = 1_000

# Largest encoded entry a reader accepts, per stream (the last part of the key). A larger one is
# dead-lettered, not decoded: one runaway writer cannot stall a consumer or its memory. Sized for
# the largest real entry with room to spare: a trajectory of a long multi-turn agent episode
# (8 bytes per token), a task carrying an SWE instance, small control messages.
MAX_ENTRY_BYTES = {
    "tasks": 8 * 2**20,
    "trajectories": 64 * 2**20,
    "weights": 64 * 2**10,
    "weight_acks": 64 * 2**10,
}
DEFAULT_MAX_ENTRY_BYTES = 64 * 2**20  # any other stream
# A dead letter keeps at most this much of the raw payload (an oversized entry is cut to it).
DEADLETTER_PAYLOAD_MAX_BYTES = 64 * 2**10


_RUN_PREFIX = "streamrl:{"  # every key of a run starts so; the run id runs to the "}:" after it


def run_id_of(key: str) -> str:
    """``streamrl:{<run_id>}:tasks`` -> ``<run_id>`` (a key found with a `RunKeys.pattern` scan);
    ValueError for a key of no run."""
    end = key.rfind("}:")
    if not key.startswith(_RUN_PREFIX) or end < len(_RUN_PREFIX):
        raise ValueError(f"{key!r} is not a key of a streamrl run")
    return key[len(_RUN_PREFIX) : end]


def stream_name(stream_key: str) -> str:
    """``streamrl:{run}:tasks`` -> ``tasks``: the stream's name inside its run."""
    return stream_key.rsplit(":", 1)[-1]


def max_entry_bytes(stream_key: str) -> int:
    """The entry size limit of a stream (MAX_ENTRY_BYTES by name, else the default)."""
    return MAX_ENTRY_BYTES.get(stream_name(stream_key), DEFAULT_MAX_ENTRY_BYTES)


# The only field of every stream entry: the encoded message.
ENTRY_FIELD = b"m"


@dataclass(frozen=True)
class RunKeys:
    """Key names for one run."""

    run_id: str

    @classmethod
    def pattern(cls) -> RunKeys:
        """Keys whose names are SCAN patterns matching that key of every run
        (``RunKeys.pattern().tasks`` is ``streamrl:{*}:tasks``); `run_id_of` reads the run back."""
        return cls("*")

    def _k(self, name: str) -> str:
        return f"{_RUN_PREFIX}{self.run_id}}}:{name}"

    def env_key(self, *parts: str) -> str:
        """A key an environment keeps for itself under the run, e.g. to hand sessions to an agent
        outside the gateway (the gateway benchmark's does): ``streamrl:{<run>}:env:<parts>``."""
        return self._k(":".join(("env", *parts)))

    @property
    def tasks(self) -> str:
        """Stream of Task entries, consumer group GATEWAYS_GROUP."""
        return self._k("tasks")

    @property
    def trajectories(self) -> str:
        """Stream of Trajectory entries, consumer group TRAINER_GROUP."""
        return self._k("trajectories")

    @property
    def weights(self) -> str:
        """Stream of WeightAnnouncement entries; every generator reads all of it."""
        return self._k("weights")

    @property
    def weights_snapshot(self) -> str:
        """String: the newest weight version on disk (an encoded WeightSnapshot), written by a
        trainer whose versions move by a collective transport; generators starting mid-run load it."""
        return self._k("weights:snapshot")

    @property
    def weight_acks(self) -> str:
        """Stream of WeightAck entries written by generators."""
        return self._k("weight_acks")

    @property
    def deadletter(self) -> str:
        """Stream of DeadLetter entries."""
        return self._k("deadletter")

    @property
    def registry(self) -> str:
        """Sorted set: worker id -> unix time its heartbeat expires."""
        return self._k("registry")

    @property
    def registry_info(self) -> str:
        """Hash: worker id -> encoded Heartbeat."""
        return self._k("registry:info")

    @property
    def generator_calls(self) -> str:
        """Hash: ``<gateway id>|<generator id>`` -> encoded CallSummary, the model calls one
        gateway made to one generator in its sliding window (`shared.fleet_health`)."""
        return self._k("generators:calls")

    @property
    def generator_health(self) -> str:
        """Hash: generator id -> encoded GeneratorHealth, the fleet's memory of each generator's
        health state and since when (hysteresis, lost generators; `shared.fleet_health`)."""
        return self._k("generators:health")

    @property
    def pause(self) -> str:
        """Hash: pause reason -> epoch (the protocol: `shared.pause`)."""
        return self._k("pause")

    @property
    def pause_epoch(self) -> str:
        """Counter giving every pause a fresh epoch, so a stale resume cannot end a newer pause."""
        return self._k("pause:epoch")

    @property
    def trainer_step(self) -> str:
        """The trainer's current step (string int), for workers and the CLI."""
        return self._k("trainer:step")

    @property
    def trainer_incarnation(self) -> str:
        """Counter bumped by every trainer start; prefixes the group ids it issues, so a trainer
        resumed from a checkpoint never reuses an id the crashed one already handed out."""
        return self._k("trainer:incarnation")

    @property
    def scale_request(self) -> str:
        """The latest ScaleRequest of `streamrl scale` for the run's `streamrl up` supervisor."""
        return self._k("scale:request")

    @property
    def scale_status(self) -> str:
        """The supervisor's ScaleStatus for the latest scale request."""
        return self._k("scale:status")

    @property
    def stop(self) -> str:
        """Set when the run has finished; workers drain and exit."""
        return self._k("stop")
