"""The run's config tree: the one schema every service of a run agrees on, composed here.

A run is one YAML file that all services read (as NeMo-RL's single config tree), so the schema is
part of the cross-service contract. Each section is declared by its owner, one module per service
or environment driver under `shared.sections` (the trainer's, the generator's, the gateway's, ...);
this module composes them into `RunConfig`, holds the checks that span sections (`RunConfig.check`)
and what each service requires (`RunConfig.check_service`), and lists every key (`explain`, for
``streamrl config explain``). Each service reads only its own sections plus the run-wide ones. Key
names follow NeMo-RL where one exists (`grpo.num_prompts_per_step`, ...).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Meta

from shared.config_error import ConfigError
from shared.sections.autoscale import AutoscaleSection, check_autoscale
from shared.sections.base import Section
from shared.sections.gateway import EnvSection, GatewaySection
from shared.sections.generator import GeneratorSection, VllmSection
from shared.sections.grpo import GrpoSection, LossSection, check_loss_fn
from shared.sections.policy import PolicySection
from shared.sections.run import AuthSection, RedisSection, RunSection, SupervisorSection
from shared.sections.tracing import TracingSection, check_tracing
from shared.sections.trainer import CheckpointSection, DataSection, LoggerSection, RefitSection, TrainerSection

ServiceName = Literal["generator", "gym_gateway", "trainer"]  # a service's config section and module name
SERVICES: tuple[ServiceName, ...] = ("generator", "gym_gateway", "trainer")


class RunConfig(Section):
    run: RunSection = msgspec.field(default_factory=RunSection)
    redis: RedisSection = msgspec.field(default_factory=RedisSection)
    supervisor: SupervisorSection = msgspec.field(default_factory=SupervisorSection)
    data: DataSection = msgspec.field(default_factory=DataSection)
    policy: PolicySection = msgspec.field(default_factory=PolicySection)
    grpo: GrpoSection = msgspec.field(default_factory=GrpoSection)
    loss_fn: LossSection = msgspec.field(default_factory=LossSection)
    env: EnvSection = msgspec.field(default_factory=EnvSection)
    checkpointing: CheckpointSection = msgspec.field(default_factory=CheckpointSection)
    refit: RefitSection = msgspec.field(default_factory=RefitSection)
    logger: LoggerSection = msgspec.field(default_factory=LoggerSection)
    generator: GeneratorSection = msgspec.field(default_factory=GeneratorSection)
    gym_gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    auth: AuthSection = msgspec.field(default_factory=AuthSection)
    autoscale: AutoscaleSection = msgspec.field(default_factory=AutoscaleSection)
    tracing: TracingSection = msgspec.field(default_factory=TracingSection)

    def check(self) -> None:
        """Cross-field checks every service runs (`shared.config.load` calls this); each error names
        the key to change. Never rewrites anything. What one service alone reads: `check_service`."""
        g, lf = self.grpo, self.loss_fn
        vllm_cfg = self.policy.generation.vllm_cfg
        typed = sorted({f.name for f in msgspec.structs.fields(VllmSection)} & set(vllm_cfg.vllm_kwargs))
        if typed:
            raise ConfigError(
                f"policy.generation.vllm_cfg.vllm_kwargs.{typed[0]}: set policy.generation.vllm_cfg.{typed[0]} instead"
            )
        if g.num_generations_per_prompt < 2:
            raise ConfigError("grpo.num_generations_per_prompt must be >= 2 (GRPO compares rollouts of a group)")
        if g.num_prompts_per_step < 1:
            raise ConfigError("grpo.num_prompts_per_step must be >= 1")
        if g.max_infra_failure_fraction is not None and not 0.0 <= g.max_infra_failure_fraction < 1.0:
            raise ConfigError(
                f"grpo.max_infra_failure_fraction is {g.max_infra_failure_fraction}; it must be in [0, 1) "
                "(null: no bound)"
            )
        if g.infra_failure_window_steps < 1:
            raise ConfigError("grpo.infra_failure_window_steps must be >= 1")
        if g.async_grpo.max_trajectory_age_steps < 0:
            raise ConfigError("grpo.async_grpo.max_trajectory_age_steps must be >= 0")
        if (
            g.async_grpo.enabled
            and g.async_grpo.max_trajectory_age_steps > 0
            and not lf.use_importance_sampling_correction
        ):
            raise ConfigError(
                "loss_fn.use_importance_sampling_correction must be true with grpo.async_grpo.enabled "
                "(asynchronous samples are off-policy)"
            )
        if (
            lf.truncated_importance_sampling_type in ("icepop", "seq-mask-tis")
            and lf.truncated_importance_sampling_ratio_min is None
        ):
            raise ConfigError(
                "loss_fn.truncated_importance_sampling_ratio_min is required for "
                f"{lf.truncated_importance_sampling_type}"
            )
        if g.seq_logprob_error_threshold is not None and g.seq_logprob_error_threshold < 1.0:
            raise ConfigError("grpo.seq_logprob_error_threshold must be >= 1.0 (1.0 means the engines agree exactly)")
        if lf.ratio_clip_c is not None and lf.ratio_clip_c <= 1:
            raise ConfigError("loss_fn.ratio_clip_c must be > 1 (or null)")
        check_loss_fn(lf, self.policy.train_global_batch_size, g.num_prompts_per_step * g.num_generations_per_prompt)
        if self.policy.generation.top_k not in (None, -1):
            raise ConfigError("policy.generation.top_k must be null: training samples must stay on-policy")
        if self.policy.sequence_packing.enabled and self.policy.sequence_packing.train_mb_tokens < 1:
            raise ConfigError("policy.sequence_packing.train_mb_tokens must be >= 1")
        if self.policy.train_micro_batch_size < 1:
            raise ConfigError("policy.train_micro_batch_size must be >= 1")
        if (
            self.policy.train_global_batch_size is not None
            and (g.num_prompts_per_step * g.num_generations_per_prompt) % self.policy.train_global_batch_size
        ):
            raise ConfigError(
                "policy.train_global_batch_size must divide grpo.num_prompts_per_step x num_generations_per_prompt"
            )
        if g.val_num_generations_per_prompt < 1:
            raise ConfigError("grpo.val_num_generations_per_prompt must be >= 1")
        self._check_dapo()
        check_autoscale(self)
        check_tracing(self.tracing)
        if self.trainer.stream_retention_s < 0:
            raise ConfigError("trainer.stream_retention_s must be >= 0")
        if self.supervisor.max_restarts < 0 or self.supervisor.restart_backoff_s < 0:
            raise ConfigError("supervisor.max_restarts and supervisor.restart_backoff_s must be >= 0")
        if self.trainer.nproc_per_node < 1:
            raise ConfigError("trainer.nproc_per_node must be >= 1")
        if self.refit.max_attempts < 1:
            raise ConfigError("refit.max_attempts must be >= 1")
        if self.refit.collective.bucket_mb < 1:
            raise ConfigError("refit.collective.bucket_mb must be >= 1")
        if self.refit.collective.method == "reshard":
            if self.refit.collective.backend == "nccl":
                raise ConfigError(
                    "refit.collective.method: reshard runs over gloo only (refit.collective.backend: gloo or auto on "
                    "CPU machines); over nccl use method broadcast"
                )
        if self.trainer.collective_timeout_s <= 0:
            raise ConfigError("trainer.collective_timeout_s must be > 0")
        if g.stop_at_validation_metric is not None:
            if g.stop_at_validation_threshold is None:
                raise ConfigError("grpo.stop_at_validation_threshold is required with grpo.stop_at_validation_metric")
            if g.stop_at_validation_metric == "pass_k" and g.val_num_generations_per_prompt < 2:
                raise ConfigError("grpo.stop_at_validation_metric pass_k needs grpo.val_num_generations_per_prompt > 1")

    def _check_dapo(self) -> None:
        """Dynamic sampling and overlong reward shaping (`check`'s part)."""
        g, rs = self.grpo, self.grpo.reward_shaping
        if g.batch_multiplier < 1.0:
            raise ConfigError("grpo.batch_multiplier must be >= 1.0")
        if g.batch_multiplier != 1.0 and not g.use_dynamic_sampling:
            raise ConfigError("grpo.batch_multiplier has an effect only with grpo.use_dynamic_sampling: true")
        if g.dynamic_sampling_max_gen_batches < 1:
            raise ConfigError("grpo.dynamic_sampling_max_gen_batches must be >= 1")
        if rs.enabled:
            max_len = rs.max_response_length or self.policy.max_total_sequence_length
            if rs.overlong_buffer_length < 1 or rs.overlong_buffer_length > max_len:
                raise ConfigError(
                    "grpo.reward_shaping.overlong_buffer_length must be in [1, max_response_length] "
                    f"({max_len}: grpo.reward_shaping.max_response_length, else policy.max_total_sequence_length)"
                )
            if rs.overlong_buffer_penalty < 0:
                raise ConfigError("grpo.reward_shaping.overlong_buffer_penalty must be >= 0")

    def check_service(self, service: ServiceName) -> None:
        """What ``service`` itself reads, on top of `check`: each service requires only that (a
        generator needs the policy but no dataset, a gym gateway neither). Called by
        `shared.service_cli` at start-up, and for every service by ``streamrl up`` and ``config check``."""
        if service != "gym_gateway" and not self.policy.model_name:
            raise ConfigError("policy.model_name is required")
        if service != "trainer":  # the generator and the gym gateway read no dataset
            return
        g = self.grpo
        if not self.data.train_path:
            raise ConfigError("data.train_path is required (the trainer reads its training tasks there)")
        if (g.val_period > 0 or g.val_at_start or g.val_at_end) and not self.data.val_path:
            raise ConfigError("data.val_path is required when grpo.val_period > 0, val_at_start or val_at_end")


def explain(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, type, description) for every leaf of the schema, for ``streamrl config explain``."""
    rows: list[tuple[str, str, str]] = []
    for field in msgspec.structs.fields(cls):
        key = f"{prefix}{field.encode_name}"
        tp = field.type
        desc = ""
        if getattr(tp, "__metadata__", None):
            desc = next((m.description for m in tp.__metadata__ if isinstance(m, Meta) and m.description), "")
            tp = tp.__origin__
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            rows.extend(explain(tp, key + "."))
        else:
            rows.append((key, getattr(tp, "__name__", str(tp)).replace("typing.", ""), desc))
    return rows
