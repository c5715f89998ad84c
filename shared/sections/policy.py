"""The policy model's sections (``policy``): the model and its batch shape, how the trainer
shards it (``dtensor_cfg``, ``megatron_cfg``), its optimizer (``optimizer``) and sequence packing
(``sequence_packing``). ``policy.generation`` is the generator's (`shared.sections.generator`).

Read by the trainer's backends (`services.trainer.backends`); the generator reads
``policy.model_name`` and ``policy.generation``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from shared.sections.base import D, Section
from shared.sections.generator import GenerationSection


class OptimizerSection(Section):
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


class SequencePackingSection(Section):
    enabled: Annotated[bool, D("pack rows into micro-batches up to train_mb_tokens (else pad per micro-batch)")] = False
    train_mb_tokens: Annotated[int, D("token budget of one packed micro-batch")] = 4096
    algorithm: Annotated[Literal["first_fit_decreasing"], D("how rows are assigned to packs")] = "first_fit_decreasing"


class DTensorSection(Section):
    """How the torch backend shards the policy across the trainer's ranks (NeMo-RL's ``dtensor_cfg``
    names): FSDP2 ``fully_shard`` per decoder layer over a device mesh of every rank."""

    cpu_offload: Annotated[
        bool, D("keep sharded parameters, gradients and optimizer state in host memory (GPUs; FSDP2 CPU offload)")
    ] = False
    activation_checkpointing: Annotated[
        bool, D("recompute each decoder layer's activations in the backward pass instead of keeping them")
    ] = False


class MegatronOptimizerSection(Section):
    use_distributed_optimizer: Annotated[
        bool,
        D(
            "shard AdamW's state over the data-parallel ranks (each rank steps the parameters it owns, then "
            "broadcasts them; experts over their own data-parallel ranks)"
        ),
    ] = False


class MegatronSection(Section):
    tensor_model_parallel_size: Annotated[int, D("tensor parallel ranks (must divide the trainer's ranks)")] = 1
    pipeline_model_parallel_size: Annotated[
        int, D("pipeline stages, each a run of decoder layers (must divide the trainer's ranks and the layers)")
    ] = 1
    expert_model_parallel_size: Annotated[
        int, D("expert parallel ranks of MoE layers (must divide the trainer's ranks and the experts)")
    ] = 1
    sequence_parallel: Annotated[
        bool | None,
        D(
            "split the activations outside the tensor-parallel layers (norms, residual, router) along the "
            "sequence over the tensor-parallel ranks; null: on at tensor parallelism for mixture-of-experts and "
            "Gated DeltaNet models (megatron-core trains those at tensor parallelism only with it), off otherwise"
        ),
    ] = None
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
            "check_for_nan_in_grad follows policy.on_nonfinite_grad (on with fail) unless set"
        ),
    ] = msgspec.field(default_factory=dict)


class PolicySection(Section):
    model_name: Annotated[str, D("HF model folder (or hub id where reachable) of the policy")] = ""
    tokenizer_name: Annotated[str | None, D("tokenizer folder; null: model_name")] = None
    max_total_sequence_length: Annotated[int, D("longest trajectory (prompt+generations) trained on")] = 4096
    train_global_batch_size: Annotated[int | None, D("rows per optimizer step; null: the whole step's batch")] = None
    train_micro_batch_size: Annotated[int, D("rows per forward/backward pass")] = 8
    max_grad_norm: Annotated[float, D("gradient clipping norm")] = 1.0
    on_nonfinite_grad: Annotated[
        Literal["fail", "skip"],
        D(
            "an optimizer update whose gradient norm is NaN or inf: fail the run, naming the step and the "
            "parameters (the checkpoint before it stays the latest), or skip the update (no optimizer or "
            "schedule step; num_skipped_updates in the step record)"
        ),
    ] = "fail"
    precision: Annotated[
        Literal["float32", "bfloat16"],
        D(
            "compute precision; master weights, gradient reduction and optimizer state stay float32, and weights "
            "are published to generators in this precision"
        ),
    ] = "float32"
    moe_routing_replay: Annotated[
        bool,
        D(
            "MoE routing replay (R3): generators return the experts every token was routed to, the routes "
            "travel with the trajectory, and the trainer's forward passes route those tokens the same way; "
            "a model without routed experts, or an engine that cannot return routes, fails the run at start"
        ),
    ] = False
    dtensor_cfg: DTensorSection = msgspec.field(default_factory=DTensorSection)
    optimizer: OptimizerSection = msgspec.field(default_factory=OptimizerSection)
    sequence_packing: SequencePackingSection = msgspec.field(default_factory=SequencePackingSection)
    megatron_cfg: MegatronSection = msgspec.field(default_factory=MegatronSection)
    generation: GenerationSection = msgspec.field(default_factory=GenerationSection)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_name or self.model_name
