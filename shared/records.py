"""The trainer's records, typed: what it writes to ``metrics.jsonl``, what its REST API answers,
and the one body it reads.

    metrics.jsonl   one `StepRecord` (``"kind": "train"``) per step, one `ValidationRecord`
                    (``"kind": "validation"``) per validation, one `AutoscaleRecord`
                    (``"kind": "autoscale"``) per autoscaler decision, as JSON lines
    GET  /status            `TrainerStatus` (its ``last`` is the last StepRecord without the id ledger)
    POST /validate          `ValidationAccepted`;  GET /validations/<id>: `ValidationStatus`
    POST /pause, /resume    `PauseAnswer`, `ResumeAnswer` (the body of /resume: `ResumeRequest`)

A step record groups its figures by who produced them: ``batch`` (the control plane's batch builder:
rewards, masks, environment metrics), ``learner`` (forward, backward, optimizer), ``staleness``,
``buffer``, ``timing`` and ``refit``; ``nemo_rl`` gives them, and a few more, under NeMo-RL's
names; plus the ledger of the trajectory ids the step consumed and evicted (no id may appear twice
in a run). Written by the trainer (`services.trainer`); decoded by `read_records` in the CLI
(`streamrl report`, `status`, the live display), the demo summary and the benchmarks. Nothing here
is read by key from a dict.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Literal

import msgspec


class TrainerState(enum.StrEnum):
    """What the trainer's control plane is doing (GET /status ``state``)."""

    STARTING = "starting"
    LOADING_POLICY = "loading_policy"
    REFIT = "refit"
    VALIDATING = "validating"
    COLLECTING = "collecting"
    TRAINING = "training"
    PAUSED = "paused"
    FINISHED = "finished"
    FAILED = "failed"


class BatchStats(msgspec.Struct, kw_only=True):
    """A step's batch as the control plane built it (before training)."""

    reward_mean: float
    reward_std: float
    num_rows: int  # rollouts in the batch (placeholders included)
    num_placeholders: int  # backfilled failures: no loss, no part in the baselines
    num_prefix_breaks: int
    num_prefix_break_samples: int  # extra rows made of the turns after a break (env.on_prefix_break: new_sample)
    num_mixed_version_rows: int  # rollouts whose turns came from more than one weight version
    num_truncated: int
    num_masked_samples: int
    num_mask_sample_filtered: int  # masked because the environment flagged them
    mean_seq_len: float
    gen_tokens: int
    advantages_abs_mean: float
    zero_advantage_groups: int  # groups whose rewards all tie: no signal
    env: dict[str, float] = {}  # the mean of each environment metric over the step's rollouts
    rollout_failures: dict[str, int] = {}  # rollouts that failed, by reason
    # rollouts failed for an infrastructure reason (placeholders): this step's share, and the share
    # over grpo.infra_failure_window_steps steps up to this one (None: no window kept)
    infra_failure_fraction: float = 0.0
    infra_failure_fraction_window: float | None = None
    num_overlong_filtered: int = 0  # out of its token budget, masked (grpo.overlong_filtering)
    num_overlong_penalized: int = 0  # given a penalty by grpo.reward_shaping
    overlong_penalty_mean: float = 0.0  # mean penalty per rollout: the shaped reward mean is reward_mean + this
    # policy.moe_routing_replay: rollouts trained on the trainer's own routing because the generator
    # returned no route for some position (vLLM: a preempted request)
    num_rows_without_routes: int = 0


class LearnerMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the learner reports for one step; None: not measured in this step (absent in JSON)."""

    loss: float
    grad_norm: float
    num_updates: int
    # updates skipped for a NaN or inf gradient norm (policy.on_nonfinite_grad: skip); loss and
    # grad_norm are the other updates' means (0.0 when none was applied)
    num_skipped_updates: int | None = None
    train_tokens: int
    lr: float
    train_time_s: float
    # trainer / generator probability agreement (1.0 and 0.0 when they agree exactly)
    token_mult_prob_error: float | None = None
    gen_kl_error: float | None = None
    # gen_kl_error over the rows whose every token the trainer's current weights generated (None:
    # no such row this step): no policy drift in it, so it measures the refit alone
    gen_kl_error_fresh: float | None = None
    sampling_importance_ratio: float | None = None
    is_oob_ratio: float | None = None
    clip_fraction: float | None = None
    kl_penalty: float | None = None
    max_abs_logprob_diff: float | None = None
    # NeMo-RL's other divergences over the same tokens: KL(trainer || generator) (k3),
    # Jensen-Shannon, and the current policy's entropy importance-weighted to the generator's samples
    policy_kl_error: float | None = None
    js_divergence_error: float | None = None
    approx_entropy: float | None = None
    # the policy ratio pi/pi_old over the loss tokens (mean, clipped mean, extremes; none: no token)
    probs_ratio: float | None = None
    probs_ratio_clamped: float | None = None
    probs_ratio_min: float | None = None
    probs_ratio_max: float | None = None
    # with top_p < 1 (a diagnostic): token_mult_prob_error and gen_kl_error against the old policy
    # scored without the nucleus truncation, the bias the trainer's truncation removes
    token_mult_prob_error_untruncated: float | None = None
    gen_kl_error_untruncated: float | None = None
    # sequence-level logprob error; the *_after_mask figures only with grpo.seq_logprob_error_threshold
    max_seq_mult_prob_error: float | None = None
    mean_seq_mult_prob_error: float | None = None
    min_seq_mult_prob_error: float | None = None
    num_masked_seqs_by_logprob_error: int | None = None
    masked_correct_pct: float | None = None
    max_seq_mult_prob_error_after_mask: float | None = None
    mean_seq_mult_prob_error_after_mask: float | None = None
    min_seq_mult_prob_error_after_mask: float | None = None
    mean_seq_len_after_mask: float | None = None
    micro_batch_token_efficiency: float | None = None  # real tokens / tokens computed


class Staleness(msgspec.Struct, kw_only=True):
    """How old the weights behind a step's trajectories were (age = step - launch version)."""

    mean: float
    max: int
    counts: dict[str, int]  # age -> trajectories
    sampled_target_offsets: dict[str, int]  # target step - step -> groups taken
    # Weight versions that generated a trajectory's tokens -> trajectories: a multi-turn rollout
    # whose turns met refits, or a call a refit split (partial rollouts), spans several.
    trajectory_spans: dict[str, int] = msgspec.field(default_factory=dict)
    multi_version_fraction: float = 0.0  # of the step's trajectories, those spanning more than one


class BufferSummary(msgspec.Struct, kw_only=True):
    depth: dict[str, int]  # target step -> complete groups staged, after the step took its batch
    in_flight_groups: dict[str, int]  # target step -> groups issued and not yet complete
    evicted_groups: int  # evicted as stale while this step waited for its batch
    evicted_total: int
    duplicates_total: int


class DynamicSamplingStats(msgspec.Struct, kw_only=True):
    """Dynamic sampling (``grpo.use_dynamic_sampling``) since the previous step took its batch."""

    num_filtered_groups: int  # complete groups whose rewards all tied: filtered, never trained
    filtered_fraction: float  # num_filtered_groups / (num_filtered_groups + num_prompts_per_step)
    # generation batches (batch_multiplier x num_prompts_per_step groups) the step's judged groups
    # amount to, rounded up (NeMo-RL's dynamic_sampling_num_gen_batches)
    num_gen_batches: int
    filtered_reward_mean: float  # mean reward of the filtered groups (0/1 rewards: 1 all solved, 0 none)
    filtered_total: int  # groups filtered since the trainer started


class StepTiming(msgspec.Struct, kw_only=True):
    wait_data_s: float
    train_s: float  # building the batch and training it
    step_s: float
    batch_s: float = 0.0  # of train_s, building the batch (sequences, masks, advantages)
    checkpoint_s: float = 0.0  # the checkpoint phase: a save when one is due, then its acknowledgements


class RefitSummary(msgspec.Struct, kw_only=True):
    """The refit that published the step's weights (version step + 1)."""

    total_s: float
    write_s: float  # moving the bytes: writing the folder (filesystem) or the whole transfer (collective)
    checksum_s: float
    confirm_s: float  # announce to the last generator's ack
    generators: list[str]  # confirmed the version (membership follows scaling)
    dropped_generators: list[str]  # left, began draining or were lost in a transfer before confirming
    transport: str = "filesystem"
    num_bytes: int = 0
    attempts: int = 1  # a transfer that lost a generator is retried without it
    # the largest mean |logprob difference| on the probe between a generator and the trainer
    probe_error: float | None = None
    # resharding refits: the fraction of the sent elements that changed since the engines' version
    changed_fraction: float | None = None


class MeanMaxMin(msgspec.Struct, kw_only=True):
    mean: float
    max: float
    min: float


class NemoRLTiming(msgspec.Struct, kw_only=True):
    """NeMo-RL's ``timing/train/*``: seconds of the step's phases."""

    total_step_time: float
    exposed_generation: float  # waiting for the step's data
    data_processing: float  # building the batch, advantages included
    policy_training: float  # the learner's step, old-policy logprobs included
    weight_sync: float  # the refit
    checkpointing: float
    valid_tokens_per_sec_per_gpu: float  # loss tokens / total_step_time / workers


class NemoRLPerformance(msgspec.Struct, kw_only=True):
    """NeMo-RL's ``performance/*`` throughputs; ``_per_gpu``: per worker (a trainer rank or a
    generator), see docs/trainer_records.md."""

    samples_per_sec: float
    tokens_per_sec: float
    samples_per_sec_per_gpu: float
    tokens_per_sec_per_gpu: float
    policy_training_tokens_per_sec_per_gpu: float
    training_worker_group_tokens_per_sec: float
    training_worker_group_tokens_per_sec_per_gpu: float
    generation_tokens_per_sec: float
    generation_tokens_per_sec_per_gpu: float


class NemoRLTrain(msgspec.Struct, kw_only=True):
    """NeMo-RL's ``train/*`` figures that streamrl names otherwise, or that only NeMo-RL's names carry."""

    reward: float
    buffer_size: int  # complete groups staged after the step took its batch
    avg_trajectory_age: float
    num_valid_samples: int  # training rows in the loss
    total_num_tokens: int  # tokens of the step's training rows, prompts included
    advantages: MeanMaxMin  # over every generated token of the batch
    turns_per_sample: MeanMaxMin  # model calls per rollout
    gen_tokens_per_sample: MeanMaxMin
    natural_termination_rate: float
    truncation_rate: float


class NemoRLMetrics(msgspec.Struct, kw_only=True):
    """A step's figures under NeMo-RL's names (`services.trainer.nemo_rl_metrics`): written to
    TensorBoard as ``timing/train/total_step_time``, ``performance/tokens_per_sec``,
    ``train/advantages/mean``, ..., so dashboards built on NeMo-RL's logs carry over."""

    timing: NemoRLTiming = msgspec.field(name="timing/train")
    performance: NemoRLPerformance
    train: NemoRLTrain

    def named(self) -> dict[str, float]:
        """NeMo-RL's full name -> value of every figure (``timing/train/total_step_time``, ...)."""
        names: dict[str, float] = {}
        parts: list[tuple[str, dict[str, object]]] = [("", msgspec.to_builtins(self))]
        while parts:
            prefix, node = parts.pop()
            for key, value in node.items():
                if isinstance(value, dict):
                    parts.append((f"{prefix}{key}/", value))
                elif isinstance(value, int | float):
                    names[prefix + key] = float(value)
        return names


class StepRecord(msgspec.Struct, kw_only=True, tag="train", tag_field="kind", omit_defaults=True):
    step: int
    weight_version: int  # the version the step trained (its trajectories' newest possible)
    time: float  # unix time the record was written
    batch: BatchStats
    learner: LearnerMetrics
    staleness: Staleness
    buffer: BufferSummary
    timing: StepTiming
    refit: RefitSummary
    trajectories_received: int
    trajectories_per_s: float
    dynamic_sampling: DynamicSamplingStats | None = None  # with grpo.use_dynamic_sampling
    nemo_rl: NemoRLMetrics | None = None  # the figures under NeMo-RL's names (absent in older records)
    # Where the step's time went, how busy the trainer's devices were (absent in older records)
    wait_fraction: float | None = None  # timing.wait_data_s / timing.step_s
    model_tflops: float | None = None  # model TFLOP/s per trainer device (services.trainer.flops)
    mfu: float | None = None  # model_tflops / the device's peak; None: peak unknown (a CPU, unconfigured)
    rollout_s: float | None = None  # mean wall time of the step's rollouts, start to publish (overlaps steps)
    generation_s: float | None = None  # of rollout_s, the mean seconds in model calls
    workers: dict[str, int] = {}  # live workers by kind at the step's end: generator, gym_gateway
    consumed_ids: list[str] = []  # the ledger; left out of /status
    evicted_ids: list[str] = []
    filtered_ids: list[str] = []  # rollouts of groups dynamic sampling filtered (never trained)

    def without_ledger(self) -> StepRecord:
        return msgspec.structs.replace(self, consumed_ids=[], evicted_ids=[], filtered_ids=[])


class ValidationRecord(msgspec.Struct, kw_only=True, tag="validation", tag_field="kind", omit_defaults=True):
    validation_id: str
    step: int  # steps done when it ran (it ran on weight version ``step``)
    time: float
    accuracy: float  # mean reward over all rollouts (pass@1 averaged over the k samples)
    num_samples: int
    num_failed: int
    num_missing: int  # rollouts that had not arrived at the deadline
    avg_length: float  # generated tokens per rollout
    duration_s: float
    pass_k: float | None = None  # with k > 1: share of prompts where any rollout has reward > 0
    pass_all_k: float | None = None  # share of prompts where all k do
    env: dict[str, float] = {}

    def metric(self, name: str) -> float | None:
        """A numeric figure by the name ``grpo.stop_at_validation_metric`` uses: a field
        (``accuracy``, ``pass_k``, ...) or ``env/<metric>``."""
        if name.startswith("env/"):
            return self.env.get(name[4:])
        value = getattr(self, name, None) if name in self.__struct_fields__ else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def metric_names(self) -> list[str]:
        fields = [f for f in self.__struct_fields__ if self.metric(f) is not None and f not in ("step", "time")]
        return sorted(fields + [f"env/{k}" for k in self.env])


class AutoscaleRecord(msgspec.Struct, kw_only=True, tag="autoscale", tag_field="kind", omit_defaults=True):
    """One autoscaler decision (`services.trainer.autoscaler`): a role's count from ``before`` to
    ``after`` and why, from the figures it read; written once the backend answered."""

    step: int  # steps done when it was decided
    time: float  # unix time it was decided
    role: str  # generator | gym_gateway
    before: int
    after: int
    reason: str
    signals: dict[str, float]  # what it read: wait_fraction, tasks_lag, gateway_utilization, ...
    outcome: Literal["done", "failed"]
    backend: str
    apply_s: float = 0.0  # from the request to the backend's answer (new workers ready)
    error: str | None = None


Record = StepRecord | ValidationRecord | AutoscaleRecord

ValidationState = Literal["queued", "running", "done", "failed", "dropped"]


class ValidationStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A validation's state (GET /validations/<id>): queued -> running -> done | failed; queued
    -> dropped when the run ended before it could run (``error`` says why)."""

    validation_id: str
    status: ValidationState
    requested_at_step: int
    result: ValidationRecord | None = None
    error: str | None = None


class ValidationAccepted(msgspec.Struct, kw_only=True):
    validation_id: str
    at_step: int
    status: ValidationState
    result_url: str


class PauseAnswer(msgspec.Struct, kw_only=True):
    epoch: int


class ResumeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The body of ``POST /resume`` (`streamrl resume` sends it); an empty body is the same as ``{}``."""

    epoch: int | None = None  # the pause to end; None: the active user pause


class ResumeAnswer(msgspec.Struct, kw_only=True, omit_defaults=True):
    resumed: bool
    epoch: int | None = None
    reason: str | None = None  # why nothing was resumed


class WorkerSummary(msgspec.Struct, kw_only=True):
    id: str
    kind: str
    state: str
    weight_version: int
    in_flight: int
    health: str | None = None  # generators: serving, degraded, draining or lost (`shared.fleet_health`)
    health_reason: str | None = None  # why, in words


class TrainerStatus(msgspec.Struct, kw_only=True):
    """GET /status."""

    run_id: str
    state: TrainerState
    error: str | None
    step: int
    max_num_steps: int
    weight_version: int
    buffer_depth: dict[str, int]
    pending_groups: int
    in_flight_groups: dict[str, int]
    evicted_total: int
    cancelled_rollouts_total: int
    early_stopped: bool
    pause: dict[str, int]
    pause_detail: str | None = None  # why the trainer paused the run itself (infra_failures)
    last: StepRecord | None
    last_validation: ValidationRecord | None
    workers: list[WorkerSummary]
    uptime_s: float


_record_decoder = msgspec.json.Decoder(Record)
_encoder = msgspec.json.Encoder()


def encode_record(record: Record) -> bytes:
    return _encoder.encode(record)


def decode_record(line: bytes | str) -> Record:
    return _record_decoder.decode(line)


def read_records(path: Path) -> list[Record]:
    """Every record of a metrics.jsonl (none if the file does not exist); a line that is not a
    record is an error naming the file and line."""
    if not path.is_file():
        return []
    records: list[Record] = []
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(_record_decoder.decode(line))
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not a streamrl metrics record: {exc}") from None
    return records


def step_records(records: list[Record]) -> list[StepRecord]:
    return sorted((r for r in records if isinstance(r, StepRecord)), key=lambda r: r.step)


def validation_records(records: list[Record]) -> list[ValidationRecord]:
    return sorted((r for r in records if isinstance(r, ValidationRecord)), key=lambda r: r.step)


def autoscale_records(records: list[Record]) -> list[AutoscaleRecord]:
    return sorted((r for r in records if isinstance(r, AutoscaleRecord)), key=lambda r: r.time)
