"""The trainer's algorithm: GRPO's batch, validation and DAPO settings (``grpo``, with
``grpo.async_grpo`` and ``grpo.reward_shaping``) and the loss (``loss_fn``) with the checks of
its options against each other (`check_loss_fn`).

Key names follow NeMo-RL's. Read by the trainer's scheduler, buffer, collection, validation and
backends (`services.trainer`); `shared.run_config.RunConfig.check` runs `check_loss_fn`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.config_error import ConfigError
from shared.sections.base import D, Section


class AsyncGrpoSection(Section):
    enabled: Annotated[bool, D("asynchronous GRPO (generation overlaps training)")] = True
    max_trajectory_age_steps: Annotated[
        int, D("staleness bound L: tasks issued up to step+L, older groups evicted")
    ] = 1
    in_flight_weight_updates: Annotated[bool, D("refit without draining in-flight generation")] = False
    allow_future_targets: Annotated[bool, D("a step may consume groups staged for later steps")] = True


class RewardShapingSection(Section):
    """DAPO's soft overlong punishment (NeMo-RL's ``grpo.reward_shaping``), added to each rollout's
    reward before advantages: 0 up to ``max_response_length - overlong_buffer_length`` generated
    tokens, then falling linearly to ``-overlong_buffer_penalty`` at ``max_response_length``."""

    enabled: Annotated[bool, D("penalise long responses before advantages are computed")] = False
    overlong_buffer_length: Annotated[
        int, D("generated tokens before max_response_length over which the penalty grows from 0")
    ] = 128
    overlong_buffer_penalty: Annotated[float, D("penalty at (and beyond) max_response_length")] = 1.0
    max_response_length: Annotated[
        int | None,
        D(
            "generated tokens of a rollout (all its turns) that get the full penalty; "
            "null: policy.max_total_sequence_length"
        ),
    ] = None


class GrpoSection(Section):
    num_prompts_per_step: Annotated[int, D("prompt groups per training step")] = 32
    num_generations_per_prompt: Annotated[int, D("rollouts per prompt (group size G)")] = 16
    max_num_steps: Annotated[int, D("training steps to run")] = 100
    normalize_rewards: Annotated[bool, D("divide advantages by the group's reward std")] = True
    use_leave_one_out_baseline: Annotated[bool, D("baseline = mean of the other rollouts of the group")] = True
    val_period: Annotated[int, D("validate every N steps; 0: never")] = 0
    val_at_start: Annotated[bool, D("validate before the first step")] = False
    val_at_end: Annotated[bool, D("validate after the last step")] = False
    max_val_samples: Annotated[int | None, D("validation prompts per validation; null: all")] = None
    val_start_at: Annotated[
        int,
        D(
            "periodic validation only once this many steps are done (cadence stays on multiples of val_period); "
            "-1: no delay"
        ),
    ] = -1
    val_num_generations_per_prompt: Annotated[int, D("rollouts per validation prompt (k of pass@k)")] = 1
    stop_at_validation_metric: Annotated[
        str | None,
        D("stop training once this validation metric reaches the threshold (e.g. accuracy, pass_k); null: never"),
    ] = None
    stop_at_validation_threshold: Annotated[float | None, D("threshold for stop_at_validation_metric (inclusive)")] = (
        None
    )
    seq_logprob_error_threshold: Annotated[
        float | None,
        D(
            "mask rows whose mean exp|logp_gen - logp_train| exceeds this (equal is kept) out of the loss; "
            "null: only measure"
        ),
    ] = None
    use_dynamic_sampling: Annotated[
        bool,
        D(
            "DAPO dynamic sampling: a complete group whose rewards all tie (no signal) is filtered, its ids go to "
            "the ledger (never trained) and a new prompt is issued in its place"
        ),
    ] = False
    batch_multiplier: Annotated[
        float,
        D(
            "with use_dynamic_sampling: groups kept coming per target step = batch_multiplier x "
            "num_prompts_per_step (rounded up), so filtered groups are replaced before a step waits for them"
        ),
    ] = 1.0
    dynamic_sampling_max_gen_batches: Annotated[
        int,
        D(
            "with use_dynamic_sampling: a step still short of num_prompts_per_step groups fails the run once "
            "its judged groups exceed this many generation batches (batch_multiplier x num_prompts_per_step each)"
        ),
    ] = 10
    overlong_filtering: Annotated[
        bool,
        D(
            "mask rollouts that ran out of tokens without a natural end (last call stopped at its token limit, or "
            "cut at policy.max_total_sequence_length) out of the loss; they still count in the group baseline"
        ),
    ] = False
    max_infra_failure_fraction: Annotated[
        float | None,
        D(
            "over the last infra_failure_window_steps steps, the share of rollouts failed for an infrastructure "
            "reason (trained as placeholders under env.failure_policy: backfill) above which the run pauses "
            "(reason infra_failures, naming the failure classes and counts) before training the step; "
            "`streamrl resume` continues and starts a new window; null: no bound"
        ),
    ] = 0.5
    infra_failure_window_steps: Annotated[int, D("steps the infrastructure-failure share is taken over")] = 5
    reward_shaping: RewardShapingSection = msgspec.field(default_factory=RewardShapingSection)
    async_grpo: AsyncGrpoSection = msgspec.field(default_factory=AsyncGrpoSection)


class LossSection(Section):
    ratio_clip_min: Annotated[float, D("PPO clip below 1 (r >= 1 - ratio_clip_min)")] = 0.2
    ratio_clip_max: Annotated[float, D("PPO clip above 1 (r <= 1 + ratio_clip_max)")] = 0.2
    ratio_clip_c: Annotated[float | None, D("dual-clip constant (> 1) for negative advantages; null: off")] = None
    use_importance_sampling_correction: Annotated[
        bool, D("weight tokens by pi_train_old/pi_generator (required for async)")
    ] = True
    truncated_importance_sampling_ratio: Annotated[float | None, D("upper bound of the IS weight; null: none")] = 5.0
    truncated_importance_sampling_type: Annotated[
        Literal["tis", "icepop", "seq-mask-tis"],
        D(
            "tis: clamp the weight; icepop: drop tokens outside the bounds; seq-mask-tis: drop sequences "
            "whose geometric-mean weight is outside the bounds"
        ),
    ] = "tis"
    truncated_importance_sampling_ratio_min: Annotated[
        float | None, D("lower IS bound (icepop and seq-mask-tis need it)")
    ] = None
    reference_policy_kl_penalty: Annotated[
        float, D("beta of the KL to the initial policy (kept as a second, frozen copy); 0: off")
    ] = 0.0
    reference_policy_kl_type: Annotated[
        Literal["k1", "k2", "k3"],
        D("per-token KL estimator with log r = logp_ref - logp: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r"),
    ] = "k3"
    kl_input_clamp_value: Annotated[
        float | None, D("clamp log r to +-this before the KL estimator (no gradient where it binds); null: none")
    ] = 20.0
    kl_output_clamp_value: Annotated[float | None, D("clamp each token's KL to +-this; null: none")] = 10.0
    use_on_policy_kl_approximation: Annotated[
        bool, D("weight each token's KL by pi_theta/pi_generator, as the samples come from the generator")
    ] = False
    use_kl_in_reward: Annotated[
        bool,
        D(
            "subtract beta x the rollout's summed KL from its reward and recompute the group advantages, "
            "instead of adding the KL to the loss"
        ),
    ] = False
    token_level_loss: Annotated[bool, D("mean over all valid tokens of the step (else per sequence)")] = True
    sequence_level_importance_ratios: Annotated[
        bool,
        D(
            "GSPO: one PPO ratio per sequence (the geometric mean of its token ratios, clipped per sequence) and "
            "one IS weight per sequence; needs token_level_loss: false"
        ),
    ] = False
    disable_ppo_ratio: Annotated[bool, D("REINFORCE/RLOO: the actor term is -A logp, no ratio and no clipping")] = False
    force_on_policy_ratio: Annotated[
        bool, D("ratio exp(logp - sg(logp)) = 1 with its gradient kept; needs one optimizer update per step")
    ] = False
    use_cispo: Annotated[
        bool, D("CISPO: the actor term is -A sg(clip(ratio)) logp (the clipped ratio is a detached weight, no PPO max)")
    ] = False


def check_loss_fn(lf: LossSection, rows_per_update: int | None, rows_per_step: int) -> None:
    """The loss options that contradict each other or the batch plan; each error names the keys."""
    if lf.reference_policy_kl_penalty < 0:
        raise ConfigError("loss_fn.reference_policy_kl_penalty must be >= 0")
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):
        value = getattr(lf, key)
        if value is not None and value <= 0:
            raise ConfigError(f"loss_fn.{key} must be > 0 (or null)")
    if lf.use_kl_in_reward and lf.reference_policy_kl_penalty == 0:
        raise ConfigError("loss_fn.use_kl_in_reward needs loss_fn.reference_policy_kl_penalty > 0")
    ratios = [k for k in _RATIO_KEYS if getattr(lf, k)]
    if len(ratios) > 1:
        raise ConfigError(
            f"loss_fn.{ratios[0]} and loss_fn.{ratios[1]} cannot both be set (each defines the ratio its own way)"
        )
    if lf.sequence_level_importance_ratios and lf.token_level_loss:
        raise ConfigError("loss_fn.sequence_level_importance_ratios (GSPO) needs loss_fn.token_level_loss: false")
    if (
        lf.sequence_level_importance_ratios
        and lf.truncated_importance_sampling_ratio is not None
        and lf.truncated_importance_sampling_type == "seq-mask-tis"
    ):
        raise ConfigError(
            "loss_fn.truncated_importance_sampling_type: seq-mask-tis cannot be combined with "
            "loss_fn.sequence_level_importance_ratios (it masks sequences but keeps token weights)"
        )
    if lf.use_cispo and lf.ratio_clip_c is not None:
        raise ConfigError("loss_fn.use_cispo cannot be combined with loss_fn.ratio_clip_c (dual clip)")
    if lf.force_on_policy_ratio and rows_per_update is not None and rows_per_update != rows_per_step:
        raise ConfigError(
            "loss_fn.force_on_policy_ratio needs one optimizer update per step: policy.train_global_batch_size "
            "must be null or grpo.num_prompts_per_step x num_generations_per_prompt"
        )


# The options that each replace the clipped PPO ratio; at most one may be set.
_RATIO_KEYS = ("use_cispo", "force_on_policy_ratio", "disable_ppo_ratio", "sequence_level_importance_ratios")
