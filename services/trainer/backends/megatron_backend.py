"""The megatron-core training backend (``trainer.backend: megatron``; the ``megatron`` extra).

The policy is a megatron-core ``GPTModel`` built from the Hugging Face config of a Qwen2, Qwen3 or
Qwen3-MoE checkpoint (RMSNorm, QK-norm, SwiGLU, RoPE, grouped-query attention, untied
embeddings; routed experts through `megatron_moe`), wrapped in megatron-core's
``DistributedDataParallel``. ``policy.megatron_cfg.distributed_data_parallel_config`` is passed
through to ``DistributedDataParallelConfig`` field by field (an unknown field is an error naming
it); ``check_for_nan_in_grad`` stays on unless the config sets it to false.

Ranks (``trainer.nproc_per_node``, torchrun): ``tensor_model_parallel_size`` ranks split every
attention and MLP matrix, the vocabulary embedding and the output layer (logits are gathered
whole); ``pipeline_model_parallel_size`` stages each hold a run of layers, megatron-core's
schedule moving micro-batches through them (`services.trainer.backends.megatron_pipeline`);
``expert_model_parallel_size`` ranks split the experts; the rest is data parallel. Rank 0
shares out each step's rows over the data-parallel ranks only (tensor-parallel peers train the
same rows: `TorchBackend.data_ranks`), so token-level normalisation and every figure stay global.
Gradients: DDP's buffers are reduced over the data ranks and the replicated QK-norm gradients
summed over the tensor ranks (megatron's ``finalize_model_grads``); the clipping norm counts each
tensor-parallel part once and every expert once (`MegatronBackend._clip_grads`). Weights are kept
in float32 and computed in ``policy.precision`` under autocast; AdamW steps on each rank's part.
Layouts that cannot fit the ranks or the checkpoint are refused by name (`check_supported`).

Weights move between the two layouts with `hf_to_megatron` / `megatron_to_hf` (per layer:
`hf_layer_to_megatron`, `megatron_layer_to_hf`): Megatron fuses Q, K and V into one
``linear_qkv`` matrix ordered by query group ([q heads of the group, k, v] per group) and gate/up
into one ``linear_fc1``; the vocabulary is padded to a multiple of 128 rows. Loading reads the
HF safetensors a layer at a time, each rank keeping its part (`megatron_tp.local_part`);
``save_weights`` gathers a layer at a time and every rank writes its deal of the HF safetensors
files (`services.trainer.weight_export`), so generators load Megatron-trained weights unchanged.
Checkpoints are Distributed Checkpoints in a layout independent of the parallel sizes
(`megatron_tp.CheckpointLayout`), resumable at other tensor-, pipeline-, expert- and data-parallel
sizes.

Everything else (micro-batching, packing, the loss, sequence-error masking, normalisation after
masking, metrics) is the torch backend's; packed rows attend within their row through a
block-causal mask (`packed_mask`). It runs on CPU too (`services.trainer.backends.megatron_cpu`:
megatron-core's CUDA-only calls), where the tests train at tensor, data, expert and pipeline
parallelism 2 against one rank; scripts/gpu_check_megatron.sh checks it on GPUs.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.trainer import packing
from services.trainer.backends import megatron_cpu, megatron_export, megatron_moe, megatron_optim, megatron_tp
from services.trainer.backends.megatron_convert import (
    SafetensorsState,
    hf_globals_to_megatron,
    hf_layer_to_megatron,
    padded_vocab,
)
from services.trainer.backends.megatron_model import (
    build_gpt_model,
    check_supported,
    ddp_config,
    init_distributed,
    tp_size,
)
from services.trainer.backends.megatron_pipeline import PipelineStages
from services.trainer.backends.torch_backend import adamw_settings
from shared.config_error import ConfigError

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class MegatronBackend(PipelineStages):
    name = "megatron"

    def _build_model(self) -> torch.nn.Module:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel

        cfg = self.policy.megatron_cfg
        check_supported(self.policy, self.ranks.world_size)
        init_distributed(cfg, self.seed, self.ranks.collective_timeout_s)
        # Tensor-parallel peers train the same rows: the rows are shared out over the data ranks.
        self.data_ranks = self.ranks.over(parallel_state.get_data_parallel_group())
        self.data_rank_of = [int(r) for r in self.ranks.gather(self.data_ranks.rank)]
        self.ep_rank = int(parallel_state.get_expert_model_parallel_rank())
        self.ep_size = int(parallel_state.get_expert_model_parallel_world_size())
        self.hf_config = json.loads((Path(self.policy.model_name) / "config.json").read_text())
        if not hasattr(self, "pipeline_ranks"):  # not again for the reference model
            self._join_stages(self.hf_config["num_hidden_layers"])
        self.vocab, vocab = int(self.hf_config["vocab_size"]), padded_vocab(self.hf_config)
        if vocab % cfg.tensor_model_parallel_size:
            raise ConfigError(
                f"policy.megatron_cfg.tensor_model_parallel_size is {cfg.tensor_model_parallel_size}; it must divide "
                f"the padded vocabulary ({vocab} rows)"
            )
        # float32 master weights; bfloat16 compute under autocast (`_autocast`)
        model = build_gpt_model(
            self.hf_config, torch.float32, expert_parallel=self.ep_size, vocab_size=vocab, compute_dtype=self.dtype
        )
        model = model.to(self.device)
        self._load_hf(model)
        self._ddp_config = ddp_config(cfg)
        ddp = DistributedDataParallel(config=model.config, ddp_config=self._ddp_config, module=model)
        # Set after DDP has chosen to average gradients over the data ranks (as FSDP2 does, which the
        # update's normalisation expects): the pipeline schedule then keeps our summed losses as
        # they are instead of dividing them by the micro-batch count.
        model.config.calculate_per_token_loss = True
        return ddp

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW on this rank's parts; its state sharded over the data ranks with
        ``policy.megatron_cfg.optimizer.use_distributed_optimizer`` (`megatron_optim`)."""
        from megatron.core import parallel_state

        return megatron_optim.build(
            list(self.model.parameters()),
            adamw_settings(self.policy),
            distributed=self.policy.megatron_cfg.optimizer.use_distributed_optimizer and self.ranks.sharded,
            dense_group=parallel_state.get_data_parallel_group(),
            expert_group=parallel_state.get_expert_data_parallel_group(),
        )

    @functools.cached_property
    def layout(self) -> megatron_tp.CheckpointLayout:
        """The policy's checkpoint layout (made on first use: `_build_model` also builds the
        frozen reference model, whose parameters checkpoints leave out)."""
        return megatron_tp.CheckpointLayout(
            self.model.module, self._first_expert(), self.device.type, layer_offset=self.layer_offset
        )

    def _first_expert(self) -> int:
        if not megatron_moe.is_moe(self.hf_config):
            return 0
        return self.ep_rank * megatron_moe.num_experts(self.hf_config) // self.ep_size

    def _load_hf(self, model: torch.nn.Module) -> None:
        """The HF checkpoint into ``model``, one layer at a time, each rank reading only its stage's
        layers and keeping its part of each."""
        params = dict(model.named_parameters())
        state, hf = SafetensorsState(self.policy.model_name), self.hf_config
        loaded: set[str] = set()
        ep = {"ep_rank": self.ep_rank, "ep_size": self.ep_size}
        first, count = self.layer_offset, hf["num_hidden_layers"] // self.pipeline_ranks.world_size
        layers = (hf_layer_to_megatron(state, hf, i, **ep) for i in range(first, first + count))
        stage_globals = hf_globals_to_megatron(state, hf, first=self.first_stage, last=self.last_stage)
        for part in itertools.chain([stage_globals], layers):  # a layer at a time
            for global_name, full in part.items():
                name = megatron_tp.renumber(global_name, -first)
                if name not in params:
                    raise ValueError(f"checkpoint does not fit the Megatron model: unexpected {global_name}")
                if name in megatron_export.VOCAB_ROWS:  # zero rows up to the padded vocabulary (sliced off the logits)
                    full = F.pad(full, (0, 0, 0, padded_vocab(hf) - full.shape[0]))
                with torch.no_grad():
                    params[name].copy_(megatron_tp.local_part(full, params[name], name))
                loaded.add(name)
        missing = sorted(params.keys() - loaded)
        if missing:
            raise ValueError(f"checkpoint does not fit the Megatron model: missing {missing[:5]}")

    def _pad_token_id(self) -> int:
        return int(self.hf_config.get("pad_token_id") or 0)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bfloat16 compute over the float32 master weights (any number of ranks)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        autocast: contextlib.AbstractContextManager[Any] = torch.autocast(self.device.type, dtype=self.dtype)
        return autocast

    def _forward_logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        whole: bool = True,
    ) -> torch.Tensor:
        """[B, T, V] logits over the padded vocabulary, gathered over the tensor-parallel ranks
        (``whole=False``: this rank's columns); on a stage before the last, its output activations.
        Right padding only follows real tokens, so the causal mask alone keeps real tokens exact;
        packed rows (position ids restarting at each row) attend within their row only (a
        block-causal mask)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
            mask = megatron_cpu.causal_mask(input_ids.shape[1], input_ids.device)
        else:
            mask = packed_mask(position_ids)
        with self._autocast():
            logits: torch.Tensor = model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=mask, runtime_gather_output=whole
            )
        return logits

    def _backward(self, loss: torch.Tensor) -> None:
        with self._backward_autocast():
            loss.backward()

    def _backward_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """CPU autocast again for the backward pass: megatron-core's linear layers are autograd
        functions that restore the forward's autocast state in their backward for CUDA only
        (``custom_bwd(device_type="cuda")``), so on CPU their bfloat16 output gradients would meet
        float32 weights."""
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        return self._autocast()

    @property
    def _vocab_parallel(self) -> bool:
        """Logprobs from each tensor-parallel rank's vocabulary columns (top_p 1: megatron's
        vocabulary-parallel cross entropy combines the ranks' softmax sums) instead of gathered
        logits: the logits of a 150K+ vocabulary, whole on every rank, would outweigh the
        activations. A top-p nucleus needs the whole row."""
        return self.top_p == 1.0 and tp_size() > 1

    def _mb_logits(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        packed = "pack" in mb
        ids, pos = (mb["pack"][0], mb["pack"][1]) if packed else (mb["input_ids"], None)
        attn = None if packed else mb["attention_mask"]
        return self._forward_logits(model, ids, attn, pos, whole=not self._vocab_parallel)

    def _logprobs_of(
        self, logits: torch.Tensor, mb: dict[str, torch.Tensor], untruncated: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """As the torch backend's from whole logits (padded columns dropped), or from this rank's
        vocabulary columns (`_vocab_parallel`)."""
        if not self._vocab_parallel:
            return super()._logprobs_of(logits[..., : self.vocab], mb, untruncated)
        from megatron.core import parallel_state, tensor_parallel

        packed = "pack" in mb
        ids = mb["pack"][0] if packed else mb["input_ids"]
        logits = logits[:, :-1].float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        # columns past the checkpoint's vocabulary (padding, on the last ranks) take no probability
        first = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
        columns = torch.arange(first, first + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(columns >= self.vocab, float("-inf"))
        lp = F.pad(-tensor_parallel.vocab_parallel_cross_entropy(logits, ids[:, 1:]), (1, 0))
        if packed:
            return packing.unpack_logprobs(lp[0], mb["pack"][2], mb["lengths"], mb["input_ids"].shape[1])
        return lp

    def _zero_grads(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def _grads_ready(self) -> None:
        """DDP accumulated into main_grad buffers: reduce them over the data ranks, sum the QK-norm
        gradients over the tensor-parallel ranks (megatron's finalize_model_grads), and hand them
        to the optimizer as .grad."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        for p in self.model.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad.to(p.dtype)

    def _clip_grads(self) -> float:
        """Clip by the global norm: tensor-parallel parts summed over their group (replicated
        parameters counted once), experts over the expert-parallel ranks."""
        from megatron.core import parallel_state, tensor_parallel

        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for p in self.model.parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            if not getattr(p, "allreduce", True):
                experts += p.grad.double().pow(2).sum()
            elif tensor_parallel.param_is_not_tensor_parallel_duplicate(p):
                dense += p.grad.double().pow(2).sum()
        if self.ranks.sharded:
            torch.distributed.all_reduce(dense, group=parallel_state.get_model_parallel_group())
            torch.distributed.all_reduce(
                experts, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group()
            )
        norm = float((dense + experts).sqrt())
        coef = self.policy.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    # ---- weights and checkpoints ----------------------------------------------------------------

    def _hf_tensors(self, *, meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's part of the policy in HF naming, one layer at a time, each tensor whole
        (`megatron_export.stage_tensors`: collective over the stage; ``meta``: shapes only)."""
        return megatron_export.stage_tensors(
            self.model.module,
            self.hf_config,
            layer_offset=self.layer_offset,
            num_layers=self.hf_config["num_hidden_layers"] // self.pipeline_ranks.world_size,
            vocab=self.vocab,
            ep_size=self.ep_size,
            meta=meta,
        )

    @functools.cached_property
    def _stage_metadata(self) -> list[megatron_export.Meta]:
        return megatron_export.stage_metadata(self._hf_tensors(meta=True), self.pipeline_ranks)

    def weight_metadata(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every HF tensor of the policy (name, shape) in the order `weight_tensors` gives them, on
        every rank (the first call is collective: every rank makes it)."""
        return [item for stage in self._stage_metadata for item in stage]

    def weight_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """For a collective refit: the policy's HF tensors in the compute precision, whole, one at
        a time, on rank 0 (nothing elsewhere; `megatron_export.to_first_rank`). Collective: every
        rank must drain it."""
        from megatron.core import parallel_state

        pipeline_group = parallel_state.get_pipeline_model_parallel_group()
        stages = self._stage_metadata
        return megatron_export.to_first_rank(
            self._hf_tensors(),
            stages,
            self.pipeline_ranks,
            self.dtype,
            is_first_rank=self.ranks.is_root,
            in_first_ranks_pipeline=not self.ranks.sharded or 0 in dist.get_process_group_ranks(pipeline_group),
        )

    def save_weights(self, out_dir: Path) -> dict[str, str]:
        """Publish the policy in HF layout and the compute precision, layer by layer; every rank
        calls it and writes its deal of its stage's tensors (`services.trainer.weight_export`)."""
        from services.trainer.weight_export import ShardWriter, deal

        out_dir = Path(out_dir)
        writer = ShardWriter(out_dir, self.max_weight_file_bytes, ranks=self.ranks)
        for name, tensor in deal(self._hf_tensors(), self.dtype, self.stage_ranks):
            writer.add(name, tensor)
        writer.close()
        if self.ranks.is_root:
            (out_dir / "config.json").write_text(json.dumps(self.hf_config, indent=2))
            src = Path(self.policy.model_name)
            for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if (src / name).is_file():
                    (out_dir / name).write_bytes((src / name).read_bytes())
        return writer.manifest

    def _dcp_state(self) -> dict[str, Any]:
        """Parameters and optimizer moments as views in the ranks-independent layout
        (`megatron_tp`): written by every rank, loaded in place at any parallel sizes."""
        return megatron_tp.checkpoint_tensors(self.model.module, self.optimizer, self.layout)

    def _state_to_save(self) -> dict[str, Any]:
        """Copies for an asynchronous write (torch's staging cannot copy the views' storage, and
        training would change it under the write), the views themselves for a synchronous one."""
        return megatron_tp.checkpoint_tensors(self.model.module, self.optimizer, self.layout, copy=self.async_save)

    def _restore_state(self, state: dict[str, Any]) -> None:
        """The load wrote into the views of the parameters and moments; nothing to copy."""


def packed_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] attention mask (True: may not attend) for rows packed into one sequence, each
    starting at position 0: causal within a row, nothing across rows."""
    pos = position_ids[0]
    row = torch.cumsum((pos == 0).to(torch.int64), 0)
    t = pos.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool, device=pos.device).tril()
    allowed = causal & (row[:, None] == row[None, :])
    return (~allowed)[None, None]
