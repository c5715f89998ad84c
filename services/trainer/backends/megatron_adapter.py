"""The megatron-core model adapter (``trainer.backend: megatron``; the ``megatron`` extra).

The policy is a megatron-core ``GPTModel`` built from the Hugging Face config of a Qwen2, Qwen3,
Qwen3-MoE or Qwen3.5-MoE checkpoint (RMSNorm, QK-norm, SwiGLU, RoPE, grouped-query attention,
untied embeddings; routed experts through `megatron_moe`; Qwen3.5's Gated DeltaNet and gated
attention layers through `megatron_hybrid`), wrapped in megatron-core's
``DistributedDataParallel``. ``policy.megatron_cfg.distributed_data_parallel_config`` is passed
through to ``DistributedDataParallelConfig`` field by field (an unknown field is an error naming
it); ``check_for_nan_in_grad`` stays on unless the config sets it to false.

Ranks (``trainer.nproc_per_node``, torchrun): ``tensor_model_parallel_size`` ranks split every
attention and MLP matrix, the vocabulary embedding and the output layer (logits are gathered
whole, or scored from each rank's vocabulary columns: `logprobs`);
``pipeline_model_parallel_size`` stages each hold a run of layers, megatron-core's schedule moving
micro-batches through them (`megatron_pipeline`); ``expert_model_parallel_size`` ranks split the
experts; the rest is data parallel. The `Layout` is computed once, from megatron's groups, before
any model is built (`megatron_setup.megatron_layout`): rank 0 shares out each step's rows over the
data ranks only, so token-level normalisation and every figure stay global. With sequence
parallelism (``policy.megatron_cfg.sequence_parallel``; on at tensor parallelism for MoE and Gated
DeltaNet models) each tensor rank holds its part of the sequence between the tensor-parallel
layers, and a forward pass is padded to a multiple of the tensor ranks (`logits`). Gradients: DDP's
buffers are reduced over the data ranks and the replicated QK-norm gradients (and, with sequence
parallelism, every norm's and the router's) summed over the tensor ranks (megatron's
``finalize_model_grads``); the clipping norm counts each tensor-parallel
part once and every expert once (`clip_grads`). Weights are kept in float32 and computed in
``policy.precision`` under autocast; AdamW steps on each rank's part (`megatron_optim`). Layouts
that cannot fit the ranks or the checkpoint are refused by name (`megatron_setup.check_supported`).

Weights move between the two layouts with `megatron_convert` (per layer): Megatron fuses Q, K and
V into one ``linear_qkv`` matrix ordered by query group and gate/up into one ``linear_fc1``; the
vocabulary is padded to a multiple of 128 rows. Loading reads the HF safetensors a layer at a
time, each rank keeping its part (`megatron_tp.local_part`); publishing gathers a layer at a time
and every rank of a stage writes its deal of the HF files (`megatron_export`,
`services.trainer.weight_export`), so generators load Megatron-trained weights unchanged.
Checkpoints are Distributed Checkpoints in a layout independent of the parallel sizes
(`megatron_tp.CheckpointLayout`), resumable at other tensor-, pipeline-, expert- and data-parallel
sizes. Packed rows attend within their row through a block-causal mask (`packed_mask`), and go
through Gated DeltaNet layers one row at a time (`linear_attention.rows_apart`). With
``policy.moe_routing_replay`` the routers take the generator's experts where a row carries routes,
each rank those of its tokens and its stage's MoE layers (`megatron_routing`). Tensors of the
checkpoint the model does not build (Qwen3.5's multi-token-prediction ``mtp.*``) are published
unchanged beside the trained ones (`_untrained`). A multimodal checkpoint whose language model the
backend builds (the released Qwen3.5-MoE, ``Qwen3_5MoeForConditionalGeneration``) is built from
its ``text_config``, read and published under its own names (``model.language_model.*``:
`megatron_convert.language_model_prefix`), its vision tower (``model.visual.*``) carried unchanged
as the MTP weights are, and its config.json published as it is.

It runs on CPU too: megatron-core's CUDA-only calls are replaced once, when the adapter is built
without CUDA (`megatron_cpu.apply`); the tests train at tensor, data, expert and pipeline
parallelism 2 against one rank there, and scripts/gpu_check.sh checks it on a GPU.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.trainer.backends import (
    megatron_cpu,
    megatron_export,
    megatron_hybrid,
    megatron_moe,
    megatron_optim,
    megatron_pipeline,
    megatron_routing,
    megatron_shards,
    megatron_tp,
    step,
)
from services.trainer.backends.adapter import LoadedModel, OnLogits
from services.trainer.backends.base import NonFiniteGradient, describe_nonfinite, nonfinite_grads
from services.trainer.backends.hf_adapter import adamw_settings, compute_dtype
from services.trainer.backends.hf_format import read_tensors
from services.trainer.backends.layout import Layout
from services.trainer.backends.linear_attention import rows_apart
from services.trainer.backends.megatron_convert import (
    SafetensorsState,
    language_model_config,
    language_model_prefix,
    padded_vocab,
)
from services.trainer.backends.megatron_setup import (
    build_gpt_model,
    check_supported,
    ddp_config,
    init_distributed,
    megatron_layout,
    tp_size,
    uses_sequence_parallel,
)
from services.trainer.backends.micro_batch import MicroBatch, sampled_logprobs_of, unpacked
from services.trainer.ranks import Ranks
from services.trainer.sharded_load import checkpoint_files
from services.trainer.weight_export import ShardWriter, deal
from shared.config_error import ConfigError
from shared.run_config import RunConfig
from shared.sections.policy import PolicySection

# what a published folder carries beside the weights, copied from the policy's folder
_BESIDE_WEIGHTS = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class MegatronAdapter:
    name = "megatron"

    def __init__(self, policy: PolicySection, ranks: Ranks, *, seed: int) -> None:
        """Join megatron's groups (``policy.megatron_cfg``) and find this rank's `Layout`; on a
        machine without CUDA, first let megatron-core run on the CPU (`megatron_cpu.apply`)."""
        cfg = policy.megatron_cfg
        check_supported(policy, ranks.world_size)
        self.policy = policy
        self.dtype = compute_dtype(policy)
        # the checkpoint's config.json, published as it is; the language model's config (a multimodal
        # checkpoint's text_config), which the model is built from; where its weights are stored
        self.checkpoint_config: dict[str, Any] = json.loads((Path(policy.model_name) / "config.json").read_text())
        self.hf_config = language_model_config(self.checkpoint_config)
        self.prefix = language_model_prefix(self.checkpoint_config)
        self.vocab = int(self.hf_config["vocab_size"])
        if padded_vocab(self.hf_config) % cfg.tensor_model_parallel_size:
            raise ConfigError(
                f"policy.megatron_cfg.tensor_model_parallel_size is {cfg.tensor_model_parallel_size}; it must "
                f"divide the padded vocabulary ({padded_vocab(self.hf_config)} rows)"
            )
        self.sequence_parallel = uses_sequence_parallel(cfg, self.hf_config)
        init_distributed(cfg, ranks.collective_timeout_s)
        if not torch.cuda.is_available():
            megatron_cpu.apply(moe=megatron_moe.is_moe(self.hf_config), pipeline=cfg.pipeline_model_parallel_size > 1)
        megatron_cpu.seed_rng(seed)
        self.layout: Layout = megatron_layout(ranks, self.hf_config["num_hidden_layers"])
        # policy.moe_routing_replay: the routes of the next forward pass, in every model built
        self.replay = (
            megatron_routing.MegatronReplay(self.hf_config, self.layout, sequence_parallel=self.sequence_parallel)
            if policy.moe_routing_replay
            else None
        )
        # made on first use for the policy (collective, or costly), by id of the model they describe
        self._checkpoint_layouts: dict[int, megatron_tp.CheckpointLayout] = {}
        self._stage_metadata: dict[int, list[megatron_export.Meta]] = {}

    @classmethod
    def from_config(cls, cfg: RunConfig, ranks: Ranks) -> MegatronAdapter:
        return cls(cfg.policy, ranks, seed=cfg.run.seed)

    @property
    def _device(self) -> torch.device:
        return self.layout.world.device

    def build(self) -> LoadedModel:
        """A GPTModel of this rank's stage and parts, float32 master weights (computed in
        ``policy.precision`` under autocast: `_autocast`), loaded from the HF checkpoint and
        wrapped in megatron-core's DDP; its routers replay the generator's routes
        (``policy.moe_routing_replay``: `megatron_routing`)."""
        from megatron.core.distributed import DistributedDataParallel

        model = build_gpt_model(
            self.hf_config,
            torch.float32,
            expert_parallel=self.layout.expert_size,
            vocab_size=padded_vocab(self.hf_config),
            compute_dtype=self.dtype,
            sequence_parallel=self.sequence_parallel,
        ).to(self._device)
        self._load_hf(model)
        if self.replay is not None:
            self.replay.attach(model)
        if megatron_hybrid.is_hybrid(self.hf_config):
            megatron_hybrid.separate_rows(model)
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config(self.policy), module=model)
        # Set after DDP has chosen to average gradients over the data ranks (as FSDP2 does, which the
        # update's normalisation expects): the pipeline schedule then keeps our summed losses as
        # they are instead of dividing them by the micro-batch count.
        model.config.calculate_per_token_loss = True
        return LoadedModel(ddp)

    def _load_hf(self, model: torch.nn.Module) -> None:
        """The HF checkpoint into ``model``, one layer at a time, each rank reading only its stage's
        layers and keeping its part of each (`megatron_shards.local_parts`)."""
        params = dict(model.named_parameters())
        state = SafetensorsState(self.policy.model_name)
        for name, part in megatron_shards.local_parts(params, state, self.hf_config, self.layout, self.prefix):
            with torch.no_grad():
                params[name].copy_(part)

    def pad_token_id(self, model: torch.nn.Module) -> int:
        return int(self.hf_config.get("pad_token_id") or 0)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW on this rank's parts; its state sharded over the data ranks with
        ``policy.megatron_cfg.optimizer.use_distributed_optimizer`` (`megatron_optim`)."""
        from megatron.core import parallel_state

        return megatron_optim.build(
            list(model.parameters()),
            adamw_settings(self.policy),
            distributed=self.policy.megatron_cfg.optimizer.use_distributed_optimizer and self.layout.world.sharded,
            dense_group=parallel_state.get_data_parallel_group(),
            expert_group=parallel_state.get_expert_data_parallel_group(),
        )

    # ---- the step's passes ----------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bfloat16 compute over the float32 master weights (any number of ranks)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        autocast: contextlib.AbstractContextManager[Any] = torch.autocast(self._device.type, dtype=self.dtype)
        return autocast

    @property
    def _vocab_parallel(self) -> bool:
        """Logprobs from each tensor-parallel rank's vocabulary columns (top_p 1: megatron's
        vocabulary-parallel cross entropy combines the ranks' softmax sums) instead of gathered
        logits: the logits of a 150K+ vocabulary, whole on every rank, would outweigh the
        activations. A top-p nucleus needs the whole row."""
        return self.policy.generation.top_p == 1.0 and tp_size() > 1

    def logits(self, model: torch.nn.Module, mb: MicroBatch, *, whole: bool | None = None) -> torch.Tensor:
        """[B, T, V] logits over the padded vocabulary, gathered over the tensor-parallel ranks
        unless they are scored column-wise (``whole``: force either); on a stage before the last,
        its output activations. Right padding only follows real tokens, so the causal mask alone
        keeps real tokens exact; a pack's rows attend within their row only (`packed_mask`). With
        routing replay the routers take ``mb``'s routes (`megatron_routing.MegatronReplay.set`)."""
        rows: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if mb.pack is None:
            ids = mb.input_ids
            position_ids = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
        else:
            ids, position_ids = mb.pack.input_ids, mb.pack.position_ids
        width = ids.shape[1]
        pad = -width % tp_size() if self.sequence_parallel else 0
        if pad:  # the ranks split the sequence: pad tokens after the last row, each a row of its own
            ids = F.pad(ids, (0, pad), value=self.pad_token_id(model))
            position_ids = F.pad(position_ids, (0, pad))
        if mb.pack is None:
            mask = megatron_cpu.causal_mask(ids.shape[1], ids.device)
        else:
            mask = packed_mask(position_ids)
            rows = rows_apart(mb.pack.starts, ids.shape[1])
        if self.replay is not None:
            self.replay.set(mb, ids.shape[1])
        gather = not self._vocab_parallel if whole is None else whole
        with self._autocast(), rows:
            logits: torch.Tensor = model(
                input_ids=ids, position_ids=position_ids, attention_mask=mask, runtime_gather_output=gather
            )
        if pad and self.layout.last_stage:  # a stage before the last passes on its activations whole
            logits = logits[:, :width]
        return logits

    def logprobs(
        self, logits: torch.Tensor, mb: MicroBatch, untruncated: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """As from any whole logits (padded columns dropped), or from this rank's vocabulary
        columns (`_vocab_parallel`)."""
        gen = self.policy.generation
        if not self._vocab_parallel:
            return sampled_logprobs_of(logits[..., : self.vocab], mb, gen.temperature, gen.top_p, untruncated)
        from megatron.core import parallel_state, tensor_parallel

        logits = logits[:, :-1].float()
        if gen.temperature != 1.0:
            logits = logits / gen.temperature
        # columns past the checkpoint's vocabulary (padding, on the last ranks) take no probability
        first = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
        columns = torch.arange(first, first + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(columns >= self.vocab, float("-inf"))
        return unpacked(F.pad(-tensor_parallel.vocab_parallel_cross_entropy(logits, mb.ids[:, 1:]), (1, 0)), mb)

    def run(self, model: torch.nn.Module, mbs: list[MicroBatch], on_logits: OnLogits, *, forward_only: bool) -> None:
        """In order on one stage; through megatron-core's schedule over several."""
        if not self.layout.pipelined:
            step.in_order(model, mbs, self.logits, self.backward, on_logits, forward_only=forward_only)
            return
        backward_context = self._backward_autocast()
        megatron_pipeline.run(
            model, mbs, self.logits, on_logits, forward_only=forward_only, backward_context=backward_context
        )

    def backward(self, loss: torch.Tensor) -> None:
        with self._backward_autocast():
            loss.backward()

    def _backward_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """CPU autocast again for the backward pass: megatron-core's linear layers are autograd
        functions that restore the forward's autocast state in their backward for CUDA only
        (``custom_bwd(device_type="cuda")``), so on CPU their bfloat16 output gradients would meet
        float32 weights."""
        if self._device.type != "cpu":
            return contextlib.nullcontext()
        return self._autocast()

    def zero_grads(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad(set_to_none=True)

    def grads_ready(self, model: torch.nn.Module) -> None:
        """DDP accumulated into main_grad buffers: reduce them over the data ranks, sum the QK-norm
        gradients over the tensor-parallel ranks (megatron's finalize_model_grads), and hand them
        to the optimizer as .grad."""
        from megatron.core.distributed import finalize_model_grads

        try:
            finalize_model_grads([model])
        except RuntimeError as exc:  # DDP's check_for_nan_in_grad, on this rank's buckets
            if "found NaN" not in str(exc) and "found Inf" not in str(exc):
                raise
            names = nonfinite_grads((n, getattr(p, "main_grad", p.grad)) for n, p in model.named_parameters())
            raise NonFiniteGradient(
                f"megatron-core's check_for_nan_in_grad: {exc}; {describe_nonfinite(names, self.layout.world.rank)}"
            ) from None
        for p in model.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad.to(p.dtype)

    def clip_grads(self, model: torch.nn.Module, max_norm: float) -> float:
        return megatron_optim.clip_grad_norm(model, max_norm, sharded=self.layout.world.sharded, device=self._device)

    # ---- state and weights ----------------------------------------------------------------------

    def _checkpoint_layout(self, model: torch.nn.Module) -> megatron_tp.CheckpointLayout:
        """The views of ``model``'s parameters in the checkpoint layout."""
        if id(model) not in self._checkpoint_layouts:
            first_expert = 0
            if megatron_moe.is_moe(self.hf_config):
                experts = megatron_moe.num_experts(self.hf_config)
                first_expert = self.layout.expert_rank * experts // self.layout.expert_size
            self._checkpoint_layouts[id(model)] = megatron_tp.CheckpointLayout(
                model.module, first_expert, self._device.type, layer_offset=self.layout.layer_offset
            )
        return self._checkpoint_layouts[id(model)]

    def checkpoint_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, copy: bool = False
    ) -> dict[str, Any]:
        """Parameters and optimizer moments in the ranks-independent layout (`megatron_tp`): views
        that a load writes into in place, or with ``copy`` copies (torch's asynchronous staging
        cannot copy the views' storage, and training would change it under the write)."""
        return megatron_tp.checkpoint_tensors(model.module, optimizer, self._checkpoint_layout(model), copy=copy)

    def restore_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """The load wrote into the views of the parameters and moments; nothing to copy."""

    def _hf_tensors(self, model: torch.nn.Module, *, meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's part of the policy in HF naming, one layer at a time, each tensor whole
        (`megatron_export.stage_tensors`: collective over the stage; ``meta``: shapes only)."""
        return megatron_export.stage_tensors(
            model.module,
            self.hf_config,
            layer_offset=self.layout.layer_offset,
            num_layers=self.hf_config["num_hidden_layers"] // self.layout.pipeline.world_size,
            vocab=self.vocab,
            ep_size=self.layout.expert_size,
            meta=meta,
            prefix=self.prefix,
        )

    def _stages_metadata(self, model: torch.nn.Module) -> list[megatron_export.Meta]:
        """Every stage's tensors (name, shape), on every rank (collective the first time)."""
        if id(model) not in self._stage_metadata:
            walk = self._hf_tensors(model, meta=True)
            self._stage_metadata[id(model)] = megatron_export.stage_metadata(walk, self.layout.pipeline)
        return self._stage_metadata[id(model)]

    def weight_metadata(self, model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
        return [item for stage in self._stages_metadata(model) for item in stage]

    def weight_shards(self, model: torch.nn.Module) -> Any:
        """This rank's parts, read as the published tensors (`megatron_shards.MegatronShards`)."""
        module, model_dir = model.module, self.policy.model_name
        return megatron_shards.MegatronShards(module, model_dir, self.checkpoint_config, self.layout)

    def weight_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """In the compute precision, on rank 0 only (`megatron_export.to_first_rank`)."""
        from megatron.core import parallel_state

        pipeline_group = parallel_state.get_pipeline_model_parallel_group()
        world = self.layout.world
        return megatron_export.to_first_rank(
            self._hf_tensors(model),
            self._stages_metadata(model),
            self.layout.pipeline,
            self.dtype,
            is_first_rank=world.is_root,
            in_first_ranks_pipeline=not world.sharded or 0 in dist.get_process_group_ranks(pipeline_group),
        )

    def save_weights(self, model: torch.nn.Module, out_dir: Path, max_file_bytes: int) -> dict[str, str]:
        """In HF layout and the compute precision, layer by layer; every rank writes its deal of its
        stage's tensors (`services.trainer.weight_export`)."""
        writer = ShardWriter(out_dir, max_file_bytes, ranks=self.layout.world)
        for name, tensor in deal(self._hf_tensors(model), self.dtype, self.layout.stage):
            writer.add(name, tensor)
        if self.layout.world.is_root:
            for name, tensor in self._untrained():
                writer.add(name, tensor)
        writer.close()
        if self.layout.world.is_root:
            (out_dir / "config.json").write_text(json.dumps(self.checkpoint_config, indent=2))
            src = Path(self.policy.model_name)
            for name in _BESIDE_WEIGHTS:
                if (src / name).is_file():
                    (out_dir / name).write_bytes((src / name).read_bytes())
        return writer.manifest

    def _untrained(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The starting checkpoint's tensors outside the language model the model builds (its
        decoder, embedding and output layer: ``model.*``, or a multimodal checkpoint's
        ``model.language_model.*``, and ``lm_head.*``): Qwen3.5's ``mtp.*``, and a multimodal
        checkpoint's vision tower ``model.visual.*``, as stored there."""
        files = checkpoint_files(self.policy.model_name)
        if files is None:
            return iter(())
        built = (self.prefix, "lm_head.")
        return read_tensors(files, sorted(n for n in files if not n.startswith(built)))


def packed_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] attention mask (True: may not attend) for rows packed into one sequence, each
    starting at position 0: causal within a row, nothing across rows."""
    pos = position_ids[0]
    row = torch.cumsum((pos == 0).to(torch.int64), 0)
    t = pos.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool, device=pos.device).tril()
    allowed = causal & (row[:, None] == row[None, :])
    return (~allowed)[None, None]
