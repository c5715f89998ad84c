"""Setting up the megatron backend: the layouts it can run (`check_supported`, before the ranks
join), megatron-core's process groups (`init_distributed`) and this rank's place among them
(`megatron_layout`), the GPTModel of a Hugging Face config split over them (`build_gpt_model`)
and its DDP settings (`ddp_config`). Used by `services.trainer.backends.megatron_adapter`, and by
``python -m services.trainer`` to refuse a layout before joining the other ranks."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.trainer.backends import megatron_cpu, megatron_hybrid, megatron_moe
from services.trainer.backends.layout import Layout
from services.trainer.backends.megatron_convert import language_model_config, rope_base, transformer_config_kwargs
from services.trainer.backends.routing_replay import replayed_layers
from services.trainer.ranks import Ranks
from shared.config_error import ConfigError
from shared.sections.policy import MegatronSection, PolicySection

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel

_DDP_KEY = "policy.megatron_cfg.distributed_data_parallel_config"


def ddp_config(policy: PolicySection) -> DistributedDataParallelConfig:
    """megatron-core DistributedDataParallelConfig from the run config. Its NaN check (which
    raises on the rank that finds one, before the gradients are reduced) is on when a non-finite
    gradient fails the run, off when the update is skipped (the step runner skips it on every rank
    at once)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg = policy.megatron_cfg
    fields = DistributedDataParallelConfig.__dataclass_fields__
    for key in cfg.distributed_data_parallel_config:
        if key not in fields:
            raise ConfigError(f"{_DDP_KEY}.{key} is not a field of megatron.core DistributedDataParallelConfig")
    skip = policy.on_nonfinite_grad == "skip"
    if skip and cfg.distributed_data_parallel_config.get("check_for_nan_in_grad"):
        raise ConfigError(
            f"{_DDP_KEY}.check_for_nan_in_grad is true, which fails the run on a NaN gradient, while "
            "policy.on_nonfinite_grad is skip: set one of them"
        )
    values = {"check_for_nan_in_grad": not skip, **cfg.distributed_data_parallel_config}
    return DistributedDataParallelConfig(**values)


_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")


def check_supported(policy: PolicySection, world_size: int = 1) -> None:
    """Refuse parallel sizes that do not fit ``world_size`` ranks or the checkpoint's layers, naming
    the key, checkpoints the backend does not build and routing replay without routed experts,
    before any rank joins the others (a multimodal checkpoint is judged by its language model,
    which is what the backend builds)."""
    cfg = policy.megatron_cfg
    for key in _SIZES:
        value = getattr(cfg, key)
        if value < 1 or world_size % value:
            raise ConfigError(
                f"policy.megatron_cfg.{key} is {value}; it must divide the trainer's {world_size} ranks "
                "(trainer.nproc_per_node x nodes)"
            )
    if cfg.context_parallel_size != 1:
        raise ConfigError(
            f"policy.megatron_cfg.context_parallel_size is {cfg.context_parallel_size}; the megatron backend "
            "supports only 1 (megatron-core splits sequences only in Transformer Engine's attention, which its "
            "local layers do not use)"
        )
    tp, pp, ep = (getattr(cfg, key) for key in _SIZES)
    for what, size in (("tensor x pipeline", tp * pp), ("expert x pipeline", ep * pp)):
        if world_size % size:
            raise ConfigError(
                f"policy.megatron_cfg: the {what} parallel sizes ({size} ranks) must divide the trainer's "
                f"{world_size} ranks"
            )
    config = Path(policy.model_name) / "config.json"
    if not config.is_file():  # a hub id, or a path only the trainer's nodes see: checked at load
        return
    hf = language_model_config(json.loads(config.read_text()))  # a multimodal checkpoint's text_config
    transformer_config_kwargs(hf)  # an architecture the backend builds
    if megatron_hybrid.is_hybrid(hf):
        megatron_hybrid.check_layout(hf, tp)
    uses_sequence_parallel(cfg, hf)
    if policy.moe_routing_replay:
        replayed_layers(hf)
    if pp > 1 and hf["num_hidden_layers"] % pp:
        raise ConfigError(
            f"policy.megatron_cfg.pipeline_model_parallel_size is {pp}; it must divide the model's "
            f"{hf['num_hidden_layers']} layers"
        )
    if pp > 1 and hf.get("tie_word_embeddings", False):
        raise ConfigError(
            f"policy.megatron_cfg.pipeline_model_parallel_size is {pp}; pipeline stages need untied "
            "embeddings (this checkpoint ties its output layer to the embedding)"
        )


def uses_sequence_parallel(cfg: MegatronSection, hf: dict[str, Any]) -> bool:
    """Whether the model is built with sequence parallelism (``policy.megatron_cfg.sequence_parallel``;
    by default on at tensor parallelism for the models megatron-core trains there only with it:
    its MoE layer refuses tensor parallelism without it, and a Gated DeltaNet layer's output norm
    sums its gradient over the tensor-parallel ranks only as a sequence-parallel norm)."""
    tp = cfg.tensor_model_parallel_size
    needs = tp > 1 and (megatron_moe.is_moe(hf) or megatron_hybrid.is_hybrid(hf))
    if needs and cfg.sequence_parallel is False:
        raise ConfigError(
            f"policy.megatron_cfg.sequence_parallel is false; model_type {hf['model_type']!r} trains at tensor "
            f"parallelism ({tp}) only with sequence parallelism (true, or null for the default)"
        )
    return tp > 1 and (needs or bool(cfg.sequence_parallel))


def init_distributed(cfg: MegatronSection, timeout_s: float | None = None) -> None:
    """torch.distributed (torchrun's environment, or a single local rank) and Megatron's groups,
    each bounded by ``timeout_s`` (in whole minutes, as megatron-core takes it)."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world == 1:  # a group of this process alone: an in-process store, no port to take
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
        else:  # many ranks started without the trainer's join (torchrun's environment)
            torch.distributed.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=world)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
            expert_model_parallel_size=cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=1,  # experts whole on each expert rank (megatron_moe.moe_config_kwargs)
            distributed_timeout_minutes=max(1, math.ceil((timeout_s or 1800) / 60)),
        )


def megatron_layout(world: Ranks, num_layers: int) -> Layout:
    """This rank's place among Megatron's groups (after `init_distributed`): tensor-parallel and
    pipeline peers train the same rows, so the rows are shared out over the data ranks; each
    stage holds ``num_layers / stages`` consecutive layers; every rank joins each stage's group,
    in order (collective)."""
    from megatron.core import parallel_state

    data = world.over(parallel_state.get_data_parallel_group())
    data_rank_of = tuple(int(r) for r in world.gather(data.rank))
    pipeline = world.over(parallel_state.get_pipeline_model_parallel_group())
    stage, stages = pipeline.rank, pipeline.world_size
    stage_ranks = world
    if stages > 1:
        of_rank = [int(s) for s in world.gather(stage)]
        for s in range(stages):
            group = torch.distributed.new_group([r for r, x in enumerate(of_rank) if x == s])
            if s == stage:
                stage_ranks = world.over(group)
    return Layout(
        world=world,
        data=data,
        data_rank_of=data_rank_of,
        pipeline=pipeline,
        stage=stage_ranks,
        layer_offset=stage * (num_layers // stages),
        expert_rank=int(parallel_state.get_expert_model_parallel_rank()),
        expert_size=int(parallel_state.get_expert_model_parallel_world_size()),
    )


def build_gpt_model(
    hf: dict[str, Any],
    dtype: torch.dtype,
    *,
    cpu_init: bool = False,
    expert_parallel: int = 1,
    vocab_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
) -> GPTModel:
    """A megatron-core GPTModel with the architecture of ``hf`` (random weights; ``vocab_size``
    rows of embedding and output, the checkpoint's by default), split over the tensor-, pipeline-
    and expert-parallel groups already initialised (this rank's stage: its layers, the embedding
    on the first, the output layer on the last); its logits are each tensor-parallel rank's
    vocabulary columns unless a forward pass asks for them whole (``runtime_gather_output``).
    ``compute_dtype``: the dtype the forward pass computes in (autocast), ``dtype`` by default;
    ``sequence_parallel``: each tensor-parallel rank holds its part of the sequence outside the
    tensor-parallel layers (a forward pass's length must then divide over the ranks)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if megatron_moe.is_moe(hf):
        megatron_cpu.without_transformer_engine()
    if megatron_hybrid.is_hybrid(hf):
        megatron_cpu.gated_delta_net_kernels()
    if sequence_parallel and (compute_dtype or dtype) != dtype:
        _reduce_scatter_into_any_dtype()
    kwargs = {**transformer_config_kwargs(hf), **megatron_moe.moe_config_kwargs(hf, expert_parallel=expert_parallel)}
    stages = int(parallel_state.get_pipeline_model_parallel_world_size())
    if stages > 1:  # megatron checks the (unused) dispatcher of a dense model against variable lengths too
        kwargs.setdefault("moe_token_dispatcher_type", "alltoall")
    config = TransformerConfig(
        **kwargs,
        tensor_model_parallel_size=tp_size(),
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=stages,
        # activations between stages: the residual stream, in the compute dtype (under autocast
        # megatron casts the residual to each block's output dtype)
        pipeline_dtype=compute_dtype or dtype,
        variable_seq_lengths=stages > 1,  # micro-batches differ in length: stages exchange shapes
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu_init,
    )
    hybrid = megatron_hybrid.is_hybrid(hf)
    model = GPTModel(
        config=config,
        transformer_layer_spec=megatron_hybrid.block_spec(hf, config)
        if hybrid
        else megatron_moe.layer_spec(hf, config),
        vocab_size=vocab_size or hf["vocab_size"],
        max_sequence_length=hf["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_percent=megatron_hybrid.rotary_percent(hf),
        rotary_base=rope_base(hf),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        parallel_output=True,  # each tensor-parallel rank's vocabulary columns; gathered on request
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    if hybrid:
        megatron_hybrid.mark_fused_parts(model, hf)
    megatron_moe.mark_experts(model)
    return model


class _Done:
    def wait(self) -> None:
        return None


def _reduce_scatter_into_any_dtype() -> None:
    """Let megatron-core's sequence-parallel linear layers compute in an autocast dtype over
    float32 weights (how the backend trains in ``policy.precision``): their backward pass
    reduce-scatters the input gradient, computed in the autocast dtype, into a buffer of the
    input's dtype (float32), and neither gloo nor NCCL reduce-scatters across dtypes. The
    gradient is reduce-scattered in its own dtype and copied into that buffer. Idempotent."""
    from megatron.core.tensor_parallel import layers

    original = layers.dist_reduce_scatter_func
    if getattr(original, "_streamrl_any_dtype", False):
        return

    def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        if output.dtype == input.dtype:
            return original(output, input, group=group, async_op=async_op)
        part = torch.empty(output.shape, dtype=input.dtype, device=output.device)
        original(part, input, group=group)
        output.copy_(part)
        return _Done() if async_op else None

    reduce_scatter._streamrl_any_dtype = True  # type: ignore[attr-defined]
    layers.dist_reduce_scatter_func = reduce_scatter


def tp_size() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_tensor_model_parallel_world_size())
