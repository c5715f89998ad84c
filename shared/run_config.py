"""The run's config tree: the one schema every service of a run agrees on.

A run is one YAML file that all services read (as NeMo-RL's single config tree), so the schema is
part of the cross-service contract and lives here; each service reads only its own sections
(`generator`, `gym_gateway`, `trainer`) plus the shared ones. Key names follow NeMo-RL where one
exists (`grpo.num_prompts_per_step`, `loss_fn.use_importance_sampling_correction`, ...).
Every field carries a one-line description (shown by ``streamrl config explain``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from shared.config_error import ConfigError
from shared.protocol import SamplingParams

ServiceName = Literal["generator", "gym_gateway", "trainer"]  # a service's config section and module name
SERVICES: tuple[ServiceName, ...] = ("generator", "gym_gateway", "trainer")


def D(text: str) -> Meta:
    return Meta(description=text)


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class RunSection(_Section):
    run_id: Annotated[str, D("name of the run; all Redis keys live under streamrl:{run_id}:")] = "default"
    output_dir: Annotated[str, D("folder for metrics, weights, checkpoints and logs")] = "runs/default"
    seed: Annotated[int, D("seed for data order, sampling and initialisation")] = 42


class RedisSection(_Section):
    url: Annotated[str | None, D("Redis 7+/Valkey URL (env REDIS_URL); null: `streamrl up` embeds Valkey")] = None
    embedded_appendfsync: Annotated[
        Literal["always", "everysec"],
        D(
            "the embedded Valkey keeps an append-only file and is restarted on it if it dies; always: nothing "
            "acknowledged is lost on a kill -9 (slower writes), everysec: up to a second of writes may be"
        ),
    ] = "everysec"


class SupervisorSection(_Section):
    """How `streamrl up` heals a job on one machine."""

    max_restarts: Annotated[
        int,
        D(
            "restarts of one service (a generator or gateway worker, the trainer, the embedded Valkey) within "
            "restart_window_s before the job fails; 0: the first crash fails it"
        ),
    ] = 3
    restart_window_s: Annotated[float, D("window in which max_restarts counts")] = 600.0
    restart_backoff_s: Annotated[
        float, D("delay before the first restart in the window, doubled for each further one (at most 60 s)")
    ] = 1.0


class DataSection(_Section):
    train_path: Annotated[str, D("JSONL of training task instances, one object per line")] = ""
    val_path: Annotated[str | None, D("JSONL of validation task instances")] = None
    shuffle: Annotated[bool, D("shuffle the training prompts each epoch (seeded by run.seed)")] = True


class OptimizerSection(_Section):
    name: Annotated[Literal["adamw"], D("optimizer")] = "adamw"
    lr: Annotated[float, D("learning rate")] = 1e-5
    weight_decay: Annotated[float, D("decoupled weight decay")] = 0.0
    betas: Annotated[tuple[float, float], D("Adam betas")] = (0.9, 0.999)
    eps: Annotated[float, D("Adam epsilon")] = 1e-8
    scheduler: Annotated[Literal["constant", "linear", "cosine"], D("learning-rate decay over the run's updates")] = (
        "constant"
    )
    warmup_steps: Annotated[int, D("optimizer updates of linear warm-up from 0")] = 0
    min_lr_ratio: Annotated[float, D("final learning rate as a fraction of lr (linear/cosine)")] = 0.0


class VllmSection(_Section):
    dtype: Annotated[str, D("engine dtype (float32 on CPU for exact logprobs)")] = "auto"
    enforce_eager: Annotated[bool, D("skip torch.compile/graph capture (fast start on CPU)")] = False
    max_model_len: Annotated[int | None, D("engine context length; null: the model's")] = None
    kv_cache_memory_bytes: Annotated[int | None, D("KV cache size in bytes (required on CPU)")] = None
    gpu_memory_utilization: Annotated[float, D("GPU memory fraction for weights+KV (GPU only)")] = 0.9
    max_num_seqs: Annotated[int, D("max sequences batched together by the engine")] = 256
    enable_prefix_caching: Annotated[bool | None, D("prefix caching; null: the engine's default")] = None
    enable_chunked_prefill: Annotated[
        bool | None,
        D(
            "split long prompts across engine steps; null: the engine's default on GPUs, off on CPUs (vLLM's CPU "
            "sampler cannot rewind a seeded request's generator after a partial prefill)"
        ),
    ] = None
    max_num_batched_tokens: Annotated[int | None, D("token budget of one engine step; null: the engine's default")] = (
        None
    )
    tensor_parallel_size: Annotated[int, D("tensor parallel degree of each engine")] = 1
    enable_expert_parallel: Annotated[
        bool, D("shard MoE experts across the engine's ranks (expert parallel size = tensor_parallel_size)")
    ] = False
    load_format: Annotated[
        str | None,
        D(
            "how the engine loads its first weights (vLLM's load_format); null: dummy (random, nothing read) when "
            "refit.transport is collective, vLLM's auto otherwise. With dummy the generator serves nothing until a "
            "refit or snapshot brings real weights (the trainer's first refit does at start-up)"
        ),
    ] = None
    vllm_kwargs: Annotated[
        dict[str, Any],
        D(
            "any other vLLM engine argument by its AsyncEngineArgs name (moe_backend, pipeline_parallel_size, "
            "data_parallel_size, kv_cache_dtype, compilation_config, ...), checked with vLLM's own argument types "
            "when the generator starts and by `streamrl config check`"
        ),
    ] = msgspec.field(default_factory=dict)

    def initial_load_format(self, transport: str) -> str:
        """The load_format the engine starts with under ``refit.transport`` = ``transport``."""
        if self.load_format is not None:
            return self.load_format
        return "dummy" if transport == "collective" else "auto"

    def devices_per_engine(self) -> int:
        """Accelerators one engine spans: tensor x pipeline x data parallel sizes."""
        kw = self.vllm_kwargs
        sizes = (kw.get("pipeline_parallel_size", 1), kw.get("data_parallel_size", 1))
        n = self.tensor_parallel_size
        for size in sizes:
            n *= size if isinstance(size, int) and size > 0 else 1
        return n


class GenerationSection(_Section):
    backend: Annotated[Literal["vllm", "transformers"], D("generation engine")] = "vllm"
    temperature: Annotated[float, D("training sampling temperature")] = 1.0
    top_p: Annotated[float, D("training nucleus sampling")] = 1.0
    top_k: Annotated[int | None, D("training top-k; must stay null (on-policy gate)")] = None
    max_new_tokens: Annotated[int, D("cap on generated tokens per model call")] = 512
    val_temperature: Annotated[float | None, D("validation temperature; null: the training value")] = None
    val_top_p: Annotated[float | None, D("validation top-p; null: the training value")] = None
    vllm_cfg: VllmSection = msgspec.field(default_factory=VllmSection)

    def sampling(self, kind: Literal["train", "validation"]) -> SamplingParams:
        if kind == "validation":
            return SamplingParams(
                temperature=self.temperature if self.val_temperature is None else self.val_temperature,
                top_p=self.top_p if self.val_top_p is None else self.val_top_p,
                top_k=None,
                max_tokens=self.max_new_tokens,
                kind="validation",
            )
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_new_tokens
        )


class SequencePackingSection(_Section):
    enabled: Annotated[bool, D("pack rows into micro-batches up to train_mb_tokens (else pad per micro-batch)")] = False
    train_mb_tokens: Annotated[int, D("token budget of one packed micro-batch")] = 4096
    algorithm: Annotated[Literal["first_fit_decreasing"], D("how rows are assigned to packs")] = "first_fit_decreasing"


class MegatronOptimizerSection(_Section):
    use_distributed_optimizer: Annotated[
        bool,
        D(
            "shard AdamW's state over the data-parallel ranks (each rank steps the parameters it owns, then "
            "broadcasts them; experts over their own data-parallel ranks)"
        ),
    ] = False


class MegatronSection(_Section):
    tensor_model_parallel_size: Annotated[int, D("tensor parallel ranks (must divide the trainer's ranks)")] = 1
    pipeline_model_parallel_size: Annotated[
        int, D("pipeline stages, each a run of decoder layers (must divide the trainer's ranks and the layers)")
    ] = 1
    expert_model_parallel_size: Annotated[
        int, D("expert parallel ranks of MoE layers (must divide the trainer's ranks and the experts)")
    ] = 1
    context_parallel_size: Annotated[
        int,
        D(
            "ranks splitting each sequence (only 1: megatron-core runs context parallelism in Transformer Engine's "
            "attention, which the backend's layers do not use)"
        ),
    ] = 1
    optimizer: MegatronOptimizerSection = msgspec.field(default_factory=MegatronOptimizerSection)
    distributed_data_parallel_config: Annotated[
        dict[str, Any],
        D(
            "fields of megatron.core DistributedDataParallelConfig, passed through (unknown fields are an error); "
            "check_for_nan_in_grad stays on unless set to false"
        ),
    ] = msgspec.field(default_factory=dict)


class DTensorSection(_Section):
    """How the torch backend shards the policy across the trainer's ranks (NeMo-RL's ``dtensor_cfg``
    names): FSDP2 ``fully_shard`` per decoder layer over a device mesh of every rank."""

    cpu_offload: Annotated[
        bool, D("keep sharded parameters, gradients and optimizer state in host memory (GPUs; FSDP2 CPU offload)")
    ] = False
    activation_checkpointing: Annotated[
        bool, D("recompute each decoder layer's activations in the backward pass instead of keeping them")
    ] = False


class PolicySection(_Section):
    model_name: Annotated[str, D("HF model folder (or hub id where reachable) of the policy")] = ""
    tokenizer_name: Annotated[str | None, D("tokenizer folder; null: model_name")] = None
    max_total_sequence_length: Annotated[int, D("longest trajectory (prompt+generations) trained on")] = 4096
    train_global_batch_size: Annotated[int | None, D("rows per optimizer step; null: the whole step's batch")] = None
    train_micro_batch_size: Annotated[int, D("rows per forward/backward pass")] = 8
    max_grad_norm: Annotated[float, D("gradient clipping norm")] = 1.0
    precision: Annotated[
        Literal["float32", "bfloat16"],
        D(
            "compute precision; master weights, gradient reduction and optimizer state stay float32, and weights "
            "are published to generators in this precision"
        ),
    ] = "float32"
    dtensor_cfg: DTensorSection = msgspec.field(default_factory=DTensorSection)
    optimizer: OptimizerSection = msgspec.field(default_factory=OptimizerSection)
    sequence_packing: SequencePackingSection = msgspec.field(default_factory=SequencePackingSection)
    megatron_cfg: MegatronSection = msgspec.field(default_factory=MegatronSection)
    generation: GenerationSection = msgspec.field(default_factory=GenerationSection)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_name or self.model_name


class AsyncGrpoSection(_Section):
    enabled: Annotated[bool, D("asynchronous GRPO (generation overlaps training)")] = True
    max_trajectory_age_steps: Annotated[
        int, D("staleness bound L: tasks issued up to step+L, older groups evicted")
    ] = 1
    in_flight_weight_updates: Annotated[bool, D("refit without draining in-flight generation")] = False
    allow_future_targets: Annotated[bool, D("a step may consume groups staged for later steps")] = True


class RewardShapingSection(_Section):
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


class GrpoSection(_Section):
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
    reward_shaping: RewardShapingSection = msgspec.field(default_factory=RewardShapingSection)
    async_grpo: AsyncGrpoSection = msgspec.field(default_factory=AsyncGrpoSection)


class LossSection(_Section):
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


class NemoGymSection(_Section):
    """Driver for NeMo-Gym agents and resources servers (``env: nemo_gym`` rows)."""

    backfill_failed_rollouts: Annotated[
        bool, D("NeMo-RL name: a failed rollout becomes a zero-token placeholder (same as failure_policy: backfill)")
    ] = False
    agent_servers: Annotated[
        dict[str, str], D("agent server base URL by agent name (a row's agent_ref.name), e.g. http://127.0.0.1:16036")
    ] = msgspec.field(default_factory=dict)
    head_server_url: Annotated[
        str | None,
        D(
            "NeMo-Gym head server (e.g. http://127.0.0.1:11000): agents missing from agent_servers, and their "
            "resources servers, are found in its global config"
        ),
    ] = None
    default_agent: Annotated[str | None, D("agent for rows without agent_ref")] = None
    connect_timeout_s: Annotated[
        float, D("connecting to an agent, head or resources server; the rollout deadline bounds the whole /run")
    ] = 10.0
    infra_failure_kinds: Annotated[
        list[str],
        D(
            "verify failure_kind values that fail the rollout as an infrastructure error (retried or backfilled); "
            "other failure kinds are trained masked"
        ),
    ] = msgspec.field(default_factory=list)


class OpenHandsSection(_Section):
    """Driver for OpenHands SDK agents run in their own Python environment (``env: openhands`` rows)."""

    python: Annotated[
        str,
        D(
            "Python of the OpenHands SDK's virtualenv (scripts/setup_openhands.sh); "
            "relative to the streamrl source root"
        ),
    ] = ".venv-openhands/bin/python"
    model_name: Annotated[
        str, D("model name the agent sends (as LiteLLM's openai/<name>); the session proxy serves any")
    ] = "policy"
    max_iterations: Annotated[int | None, D("cap on agent steps (one model call each); null: env.max_turns")] = None
    tools: Annotated[
        list[str], D("OpenHands tools by name (terminal, file_editor, task_tracker, glob, grep, apply_patch)")
    ] = msgspec.field(default_factory=lambda: ["terminal", "file_editor"])
    default_tools: Annotated[
        list[str],
        D(
            "OpenHands built-in tools kept (FinishTool, ThinkTool); an episode ends at finish or at a reply "
            "without tool calls"
        ),
    ] = msgspec.field(default_factory=lambda: ["FinishTool", "ThinkTool"])
    terminal_type: Annotated[
        Literal["tmux", "subprocess"] | None, D("backend of the terminal tool; null: tmux when installed")
    ] = None
    native_tool_calling: Annotated[
        bool, D("tools as the API's tools field (else described in the prompt and parsed from text)")
    ] = True
    system_prompt: Annotated[
        str | None, D("system prompt replacing OpenHands' own (tool guidance is still added); null: OpenHands'")
    ] = None
    timeout_s: Annotated[
        float | None,
        D(
            "agent time limit; the agent is then stopped and its workspace scored (truncated); "
            "null: only the rollout deadline"
        ),
    ] = None
    llm_timeout_s: Annotated[float, D("limit of one model call made by the agent")] = 300.0
    num_retries: Annotated[int, D("retries of a failed model call inside the agent (1-4 s apart)")] = 1
    check_timeout_s: Annotated[float, D("limit of a task's check command; past it the reward is 0")] = 60.0
    workspace_root: Annotated[
        str | None, D("parent folder of per-rollout workspaces; null: the system temp folder")
    ] = None
    mask_truncated: Annotated[
        bool, D("flag rollouts that end without the agent finishing (masked out of the loss)")
    ] = False
    warm_runners: Annotated[
        int, D("runners that import the SDK once and fork each episode; 0: a fresh process per rollout"), Meta(ge=0)
    ] = 0


class SweSection(_Section):
    """Driver for SWE instances with hidden tests, R2E-Gym style (``env: swe`` rows)."""

    runtime: Annotated[
        Literal["local", "docker", "podman"],
        D("where agent commands and hidden tests run: local subprocesses, or a container engine's CLI"),
    ] = "local"
    image: Annotated[str, D("container image for instances whose row names no docker_image (docker/podman)")] = ""
    instances_path: Annotated[
        str,
        D(
            "folder of instance folders, or a JSON/JSONL file of rows, that task rows name by instance_id; "
            "'': the shipped set"
        ),
    ] = ""
    workspace_root: Annotated[
        str | None, D("parent folder of per-rollout workspaces; null: the system temp folder")
    ] = None
    git_init_workspace: Annotated[
        bool, D("give the agent's copy a fresh git repository with one commit (never the original history)")
    ] = True
    command_timeout_s: Annotated[float, D("deadline of one agent command; its whole process group is killed")] = 60.0
    eval_timeout_s: Annotated[float, D("deadline of the hidden test run; past it the reward is 0")] = 300.0
    max_output_chars: Annotated[int, D("characters of a command's output kept (head and tail) for the agent")] = 8000
    shell: Annotated[str, D("shell that runs every command as `<shell> -c <command>`")] = "bash"
    local_path: Annotated[
        str | None,
        D("PATH of local commands; null: the gateway Python's bin folder, then /usr/local/bin:/usr/bin:/bin"),
    ] = None
    container_workdir: Annotated[str, D("where the workspace is mounted inside the container")] = "/testbed"
    container_engine_args: Annotated[
        list[str], D("engine flags placed before `run` (e.g. podman's --runtime runc, --root, --storage-driver)")
    ] = msgspec.field(default_factory=list)
    container_ulimits: Annotated[
        list[str], D("--ulimit flags of every container (podman as root needs limits below the host's)")
    ] = msgspec.field(default_factory=lambda: ["nofile=1024:1024", "nproc=1024:1024"])
    protected_paths: Annotated[
        list[str],
        D("globs of files the reward run takes from the snapshot, not from the agent (test config, import hooks)"),
    ] = msgspec.field(
        default_factory=lambda: [
            "conftest.py",
            "*/conftest.py",
            "pytest.ini",
            "tox.ini",
            "pytest.py",
            "pytest/*",
            "_pytest/*",
            "setup.cfg",
            "pyproject.toml",
            "sitecustomize.py",
            "usercustomize.py",
            "*.pth",
            ".venv/*",
        ]
    )


class EnvSection(_Section):
    name: Annotated[str, D("environment used for tasks whose row names none")] = "tool_calc"
    failure_policy: Annotated[
        Literal["fail_fast", "retry", "backfill"],
        D(
            "rollout failed for an infrastructure reason (sandbox, timeout, transport, generator gone): stop the "
            "run; retry it up to max_rollout_retries times, then stop; or train a zero-token placeholder"
        ),
    ] = "fail_fast"
    max_rollout_retries: Annotated[
        int, D("extra attempts of an infrastructure-failed rollout (failure_policy: retry)")
    ] = 2
    on_prefix_break: Annotated[
        Literal["mask", "new_sample"],
        D(
            "a rollout whose agent rewrote its token history: keep it out of the loss (baselines only), or train "
            "the turns from the break on as a new sample with the rollout's advantage"
        ),
    ] = "mask"
    on_tool_call_error: Annotated[
        Literal["observe", "end"],
        D(
            "a tool call the model wrote that cannot be used (not valid JSON, no name, bad arguments, an unclosed "
            "tag, an unknown tool): the agent gets an error observation and goes on, or the rollout ends as the "
            "policy failure tool_call_<reason> (truncated, reward 0, turns kept). Counted per reason either way"
        ),
    ] = "observe"
    max_turns: Annotated[int, D("cap on model calls per rollout")] = 8
    should_mask_flagged_samples: Annotated[
        bool,
        D(
            "rollouts the environment flags (mask_sample) are kept out of the loss but count in baselines; "
            "false: the flag is not carried at all"
        ),
    ] = True
    nemo_gym: NemoGymSection = msgspec.field(default_factory=NemoGymSection)
    openhands: OpenHandsSection = msgspec.field(default_factory=OpenHandsSection)
    swe: SweSection = msgspec.field(default_factory=SweSection)


def backfills_failures(env: EnvSection) -> bool:
    """Whether an infrastructure-failed rollout is trained on as a zero-token placeholder:
    ``env.failure_policy: backfill``, or NeMo-RL's ``env.nemo_gym.backfill_failed_rollouts``."""
    return env.failure_policy == "backfill" or env.nemo_gym.backfill_failed_rollouts


class CheckpointSection(_Section):
    enabled: Annotated[bool, D("save checkpoints")] = True
    checkpoint_dir: Annotated[
        str | None, D("folder; null: <output_dir>/checkpoints (on many nodes: a filesystem every node shares)")
    ] = None
    save_period: Annotated[int, D("save every N steps (and at the last step)")] = 10
    keep_last: Annotated[int, D("checkpoints kept on disk")] = 2
    async_save: Annotated[
        bool,
        D(
            "write the learner's shards in the background: training goes on once they are staged in memory, and "
            "the step's trajectories are acknowledged only when the write is complete"
        ),
    ] = False


class CollectiveRefitSection(_Section):
    backend: Annotated[
        Literal["auto", "gloo", "nccl"],
        D("vLLM weight-transfer engine; auto: nccl when the generators run on GPUs, gloo (CPU) otherwise"),
    ] = "auto"
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


class RefitSection(_Section):
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


class LoggerSection(_Section):
    log_dir: Annotated[str | None, D("folder for metrics.jsonl and plots; null: output_dir")] = None
    plot: Annotated[bool, D("write reward_curve.png at the end")] = True
    tensorboard: Annotated[
        bool, D("also write every metrics record as TensorBoard scalars to <log_dir>/tensorboard")
    ] = True


class AuthSection(_Section):
    """Control-plane auth. The token itself comes only from env STREAMRL_API_TOKEN or STREAMRL_API_TOKEN_FILE."""

    allow_open_bind: Annotated[
        bool, D("let a service without an API token bind a non-loopback address (private networks only)")
    ] = False
    protect_agent_routes: Annotated[
        bool,
        D(
            "require the API token on the generator's /v1/* and the gateway's session routes "
            "(/sessions/*, /ng-rollout/*) too "
            "(agents send it as api_key)"
        ),
    ] = False


class GeneratorSection(_Section):
    host: Annotated[str, D("bind address")] = "127.0.0.1"
    port: Annotated[int, D("port of the first generator (more get the next ports); 0: any free port")] = 8100
    num_workers: Annotated[int, D("generator processes started by `streamrl up`")] = 1
    turn_terminator: Annotated[str | None, D("token that ends a chat turn; null: the tokenizer's EOS")] = None
    weight_load_timeout_s: Annotated[float, D("deadline for loading one weight version")] = 120.0
    drain_timeout_s: Annotated[
        float, D("deadline to finish in-flight requests before a drained refit, and for the drain at SIGTERM")
    ] = 60.0
    drain_session_idle_s: Annotated[
        float,
        D(
            "at SIGTERM the generator keeps serving sessions it already has (new ones go elsewhere) until none has "
            "called for this long; raise it for agents whose tools run long between turns"
        ),
    ] = 3.0
    max_concurrent_requests: Annotated[int, D("requests admitted at once; more wait (backpressure)")] = 512
    gpus: Annotated[
        str | None,
        D(
            "GPU ids of this node dealt to the generators `streamrl up` starts (comma-separated), each its "
            "vllm_cfg parallel size of them; null: the node's GPUs after the trainer's first nproc_per_node"
        ),
    ] = None
    cpu_cores_per_worker: Annotated[
        int | None,
        D(
            "on a node without GPUs, bind each generator `streamrl up` starts to this many cores of its own "
            "(VLLM_CPU_OMP_THREADS_BIND); null: vLLM's own binding (every engine on the same cores)"
        ),
    ] = None


class GatewaySection(_Section):
    host: Annotated[str, D("bind address of the session proxy")] = "127.0.0.1"
    port: Annotated[int, D("port of the first gateway worker; 0: any free port")] = 8200
    num_workers: Annotated[int, D("gateway processes started by `streamrl up`")] = 1
    max_concurrent_rollouts: Annotated[int, D("rollouts one worker runs at once")] = 64
    rollout_timeout_s: Annotated[float, D("deadline of one rollout")] = 600.0
    reclaim_idle_s: Annotated[float, D("take over tasks a dead worker left pending this long")] = 900.0
    request_timeout_s: Annotated[float, D("deadline of one model call through the proxy")] = 300.0
    max_failovers: Annotated[int, D("other generators a session's call may move to when its generator is gone")] = 2
    generator_wait_s: Annotated[
        float, D("how long a new session waits for a serving generator before its rollout fails as infra")
    ] = 30.0
    drain_timeout_s: Annotated[
        float, D("at SIGTERM or the run's end, deadline for running rollouts to finish; the rest go back to the group")
    ] = 30.0


class TrainerSection(_Section):
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


class RunConfig(_Section):
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
