"""The trainer service's sections: its server and deadlines (``trainer``), its datasets
(``data``), checkpoints (``checkpointing``), how weight versions reach the generators (``refit``)
and its metrics log (``logger``).

Read by the trainer (`services.trainer`); the generator reads ``refit.transport`` and
``refit.collective`` too (it receives what the trainer sends). The GRPO algorithm's sections are
in `shared.sections.grpo`, the policy's in `shared.sections.policy`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.sections.base import D, Section


class TrainerSection(Section):
    host: Annotated[str, D("bind address of the REST API")] = "127.0.0.1"
    port: Annotated[int, D("REST port")] = 8300
    refit_timeout_s: Annotated[float, D("deadline for all generators to confirm a weight version")] = 300.0
    startup_timeout_s: Annotated[float, D("deadline for the first generator to register")] = 600.0
    data_timeout_s: Annotated[float, D("longest wait for a step's data before failing loudly")] = 3600.0
    torch_threads: Annotated[int | None, D("torch intra-op threads (per rank); null: torch's default")] = None
    nproc_per_node: Annotated[
        int,
        D(
            "trainer ranks on this node: streamrl up starts them with torchrun; rank 0 runs the control plane, "
            "every rank a shard of the learner"
        ),
    ] = 1
    nnodes: Annotated[
        int,
        D(
            "nodes the trainer's ranks span (torchrun's multi-node mode, c10d rendezvous at trainer.rdzv_endpoint); "
            "world size = nnodes x nproc_per_node, which must fit the backend's parallel layout"
        ),
    ] = 1
    rdzv_endpoint: Annotated[
        str | None,
        D("HOST:PORT of the trainer's c10d rendezvous (a port on one of its nodes); required when nnodes > 1"),
    ] = None
    rdzv_timeout_s: Annotated[
        float,
        D("deadline for every node of the trainer to reach the rendezvous (each node fails naming the endpoint)"),
    ] = 600.0
    drain_timeout_s: Annotated[
        float,
        D(
            "at SIGTERM, deadline for stopping the run (its own cleanup, then a cancel) before the server shuts "
            "down; a restart resumes from the newest checkpoint"
        ),
    ] = 60.0
    collective_timeout_s: Annotated[
        float,
        D("longest wait of any collective between trainer ranks; a rank that died or hangs fails the trainer after it"),
    ] = 600.0
    validation_drain_timeout_s: Annotated[
        float | None,
        D("deadline for in-flight training rollouts to finish before a validation; null: the rollout timeout"),
    ] = None
    on_drain_timeout: Annotated[
        Literal["proceed", "cancel"],
        D(
            "at the drain deadline: validate while they run, or cancel them (their prompts go back, their results "
            "are dropped when they arrive)"
        ),
    ] = "proceed"
    backend: Annotated[
        Literal["torch", "megatron"],
        D("training backend: torch (transformers, FSDP2) or megatron (megatron-core: tensor/expert parallel, MoE)"),
    ] = "torch"
    stream_retention_s: Annotated[
        float,
        D(
            "acknowledged entries of the tasks and trajectories streams are trimmed after every step once "
            "older than this (for inspection meanwhile); 0: as soon as acked. Unacked entries are never trimmed"
        ),
    ] = 3600.0
    peak_tflops_per_device: Annotated[
        Annotated[float, msgspec.Meta(gt=0)] | None,
        D(
            "peak TFLOP/s of one trainer device at policy.precision, the denominator of each step's mfu; null: "
            "the dense data-sheet figure of a known GPU (H100, H200, A100, L40S), none on a CPU (mfu stays null)"
        ),
    ] = None


class DataSection(Section):
    train_path: Annotated[str, D("JSONL of training task instances, one object per line")] = ""
    val_path: Annotated[str | None, D("JSONL of validation task instances")] = None
    shuffle: Annotated[bool, D("shuffle the training prompts each epoch (seeded by run.seed)")] = True


class CheckpointSection(Section):
    enabled: Annotated[bool, D("save checkpoints")] = True
    checkpoint_dir: Annotated[
        str | None, D("folder; null: <output_dir>/checkpoints (on many nodes: a filesystem every node shares)")
    ] = None
    save_period: Annotated[int, D("save every N steps (and at the last step)")] = 10
    save_period_s: Annotated[
        float | None,
        D(
            "also save after the first step that ends this many seconds (wall clock) after the last checkpoint "
            "or the trainer's start; null: by steps only"
        ),
    ] = None
    keep_last: Annotated[int, D("checkpoints kept on disk")] = 2
    async_save: Annotated[
        bool,
        D(
            "write the learner's shards in the background: training goes on once they are staged in memory, and "
            "the step's trajectories are acknowledged only when the write is complete"
        ),
    ] = False


class CollectiveRefitSection(Section):
    backend: Annotated[
        Literal["auto", "gloo", "nccl"],
        D("vLLM weight-transfer engine; auto: nccl when the generators run on GPUs, gloo (CPU) otherwise"),
    ] = "auto"
    method: Annotated[
        Literal["auto", "reshard", "broadcast"],
        D(
            "reshard: every trainer rank sends the slices of its own shard that each engine rank keeps straight "
            "to it, all links at once, no tensor gathered (gloo); broadcast: the trainer's ranks gather each "
            "tensor and rank 0 broadcasts it whole to every engine rank; auto: reshard where it is built (gloo), "
            "broadcast elsewhere (nccl)"
        ),
    ] = "auto"
    delta: Annotated[
        bool,
        D(
            "resharding refits send each bucket as the elements that changed since the version the engine rank "
            "holds (a bitmap and their values, when smaller), bit-exact: both ends keep their last payload of each "
            "bucket (each rank's shard once more in memory)"
        ),
    ] = False
    master_address: Annotated[
        str | None,
        D("address generators reach trainer rank 0 at for the transfer group; null: this host's name"),
    ] = None
    bucket_mb: Annotated[int, D("parameters are packed and sent in buckets of at most this many MiB")] = 256
    verify_engine_checksums: Annotated[
        bool,
        D(
            "after each transfer every generator computes vLLM's per-parameter checksums and the trainer requires "
            "them equal across generators (a full pass over each engine's weights; off for very large models)"
        ),
    ] = True
    snapshot_period: Annotated[
        int | None,
        D(
            "write the published version to disk every N steps, for generators that start mid-run; "
            "null: checkpointing.save_period"
        ),
    ] = None


class RefitSection(Section):
    transport: Annotated[
        Literal["filesystem", "collective"],
        D(
            "how weight versions reach the generators: a safetensors folder they load, or vLLM's weight-transfer "
            "engines (gloo on CPU, nccl on GPUs) from trainer memory to engine memory"
        ),
    ] = "filesystem"
    collective: CollectiveRefitSection = msgspec.field(default_factory=CollectiveRefitSection)
    max_attempts: Annotated[
        int, D("a transfer that lost a generator is retried without it, up to this many attempts in all")
    ] = 3
    probe_tokens: Annotated[
        int,
        D(
            "after every refit each generator scores a fixed probe sequence of this many tokens at the new version "
            "and the trainer compares with its own logprobs at that version (0: off)"
        ),
    ] = 32
    max_probe_error: Annotated[
        float,
        D(
            "bound on the probe's mean absolute logprob difference between a generator and the trainer; above it "
            "the generator serves other weights than the trainer sent and the run fails, naming the generator and "
            "the version"
        ),
    ] = 0.05
    max_gen_kl_error: Annotated[
        float | None,
        D(
            "bound on gen_kl_error_fresh (gen_kl_error over the rows the trainer's current weights generated "
            "wholly) of the first step with such rows after each refit; above it the refit delivered other "
            "weights than the trainer holds and the run fails loudly, named (null: not checked). Same weights "
            "give numerical noise only, no policy drift (whole steps, drift included, stay below 0.004 in "
            "NeMo-RL's 397B release runs); weights that differ give 0.1 to 1. Such rows exist at a run's or "
            "resume's first step and at every step of a lag-0 run"
        ),
    ] = 0.05


class LoggerSection(Section):
    log_dir: Annotated[str | None, D("folder for metrics.jsonl and plots; null: output_dir")] = None
    plot: Annotated[bool, D("write reward_curve.png at the end")] = True
    tensorboard: Annotated[
        bool, D("also write every metrics record as TensorBoard scalars to <log_dir>/tensorboard")
    ] = True
