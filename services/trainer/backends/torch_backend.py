"""The torch training backend: a transformers causal LM trained with the clipped GRPO loss, on one
rank or sharded over many with FSDP2.

Loads the policy with ``AutoModelForCausalLM.from_pretrained`` (the same code loads the tiny demo
model and a real checkpoint) with float32 master weights, computes per-token logprobs under the
distribution the generator sampled from (see `TorchBackend._gather`), and runs
``len(rows) / train_global_batch_size`` optimizer updates per step, each accumulated over
micro-batches. ``policy.precision: bfloat16`` computes in bfloat16 (autocast on one rank, FSDP2's
mixed-precision policy on many) while gradients are reduced, and the optimizer steps, in float32.

Many ranks (`services.trainer.ranks`): each decoder layer, then the root, is ``fully_shard``-ed
over a one-dimensional device mesh of every rank (``policy.dtensor_cfg``: activation
checkpointing, CPU offload). Rank 0 splits each update's rows across the ranks, balanced by tokens
(`plan_step`); every rank runs its share in micro-batches, padding with a masked filler pass when
it has fewer than another rank so that every rank joins the same collectives. Gradients are summed
across ranks, then divided by the update's global valid-token count, so the update equals the
one-rank update on the same rows; the loss, the norm that gradients are clipped by and every
logged figure are global too. Checkpoints are torch Distributed Checkpoint folders (every rank
writes its shard, and any world size reads them back); published weights are gathered one tensor at
a time, each rank writing its share of the files (`services.trainer.weight_export`). With one
update per step the pre-update ("old") logprobs equal the current ones in value, so they are taken
from the same forward pass instead of a second one.

Normalisation is applied after the micro-batches of an update: each micro-batch's loss is a sum,
and the gradients are divided by the update's valid-token (or valid-sequence) count once it is
known. That count is only known after the sequence-level logprob-error mask
(`services.trainer.mismatch`), which needs each row's pre-update logprobs, computed in the same
forward pass. Weights are exported with ``save_pretrained`` as safetensors, which the
generators load in place.

With a reference policy (``loss_fn.reference_policy_kl_penalty`` > 0) a frozen copy of the initial
policy scores every micro-batch for the loss's KL term; with ``loss_fn.use_kl_in_reward`` it
scores the step's rows once before the updates instead, and the rows train on the advantages of
the KL-shaped rewards (`services.trainer.kl_reward`). Mixed in: the micro-batches and logprobs
(`torch_inputs`), the weights and checkpoints (`torch_state`), the step's figures (`torch_metrics`)
and the KL-shaped rewards (`torch_kl_reward`);
at many ranks the policy is read shard by shard (`services.trainer.sharded_load`).

Called by the trainer loop (in a worker thread, so the event loop keeps serving REST and streams).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Self

import torch

from services.trainer import mismatch
from services.trainer.backends.torch_inputs import TorchInputs
from services.trainer.backends.torch_kl_reward import KLRewardShaping
from services.trainer.backends.torch_metrics import StepTotals, TorchStepMetrics
from services.trainer.backends.torch_state import TorchState
from services.trainer.batch import Row, StepBatch
from services.trainer.loss import LossNormalizer, clipped_pg_loss
from services.trainer.ranks import SINGLE, Ranks
from services.trainer.sharded_load import load_sharded, shard_readable
from services.trainer.sharding import shard_model
from services.trainer.step_plan import RankShare, lr_schedule, plan_step
from shared.records import LearnerMetrics
from shared.run_config import RunConfig
from shared.sections.grpo import GrpoSection, LossSection
from shared.sections.policy import PolicySection

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


# Each micro-batch's loss is a sum; the update divides the gradients once its count is known.
_SUMS = LossNormalizer(valid_tokens=1.0, valid_sequences=1.0)


def _load_model(path: str, dtype: torch.dtype) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


class TorchBackend(TorchInputs, TorchState, TorchStepMetrics, KLRewardShaping):
    def __init__(
        self,
        policy: PolicySection,
        loss: LossSection,
        *,
        seed: int,
        threads: int | None = None,
        total_updates: int = 0,
        seq_logprob_error_threshold: float | None = None,
        grpo: GrpoSection | None = None,
        ranks: Ranks = SINGLE,
        async_save: bool = False,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.seed = seed
        self.policy = policy
        self.loss_cfg = loss
        self.ranks = ranks
        self.async_save = async_save
        self.seq_error_threshold = seq_logprob_error_threshold
        self.grpo = grpo or GrpoSection()  # the advantage estimator's settings (loss_fn.use_kl_in_reward)
        self.dtype = torch.float32 if policy.precision == "float32" else torch.bfloat16  # compute and publish
        self.device = ranks.device
        self.checkpoint_bytes_read: int | None = None  # by this rank when it read only its shards
        # The ranks that share out each step's rows, and each rank's place among them: every rank
        # here; the megatron backend's data-parallel ranks, whose tensor-parallel peers see the
        # same rows (set by its `_build_model`).
        self.data_ranks = ranks
        self.data_rank_of = list(range(ranks.world_size))
        self.model = self._build_model()
        self.model.train()
        self.pad_id = self._pad_token_id()
        self.temperature = policy.generation.temperature
        self.top_p = policy.generation.top_p
        opt = policy.optimizer
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_schedule(opt, total_updates))
        self.ref_model = None
        if loss.reference_policy_kl_penalty > 0:
            self.ref_model = self._build_model().eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.updates = 0
        self._pending_save: Any = None  # the future of an asynchronous checkpoint write
        log.info(
            "%s backend: %s, %.2fM params, %s compute on %s%s",
            self.name,
            policy.model_name,
            sum(p.numel() for p in self.model.parameters()) / 1e6,  # a DTensor counts its global shape
            self.dtype,
            self.device,
            f", FSDP2 over {ranks.world_size} ranks" if ranks.sharded else "",
        )

    name = "torch"
    # At many ranks each rank reads only its shards of the checkpoint when it can; the trainer
    # benchmark turns it off to compare with loading the whole checkpoint on every rank.
    read_own_shards = True

    @classmethod
    def from_config(cls, cfg: RunConfig, ranks: Ranks = SINGLE) -> Self:
        rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        updates_per_step = rows // (cfg.policy.train_global_batch_size or rows)
        return cls(
            cfg.policy,
            cfg.loss_fn,
            seed=cfg.run.seed,
            threads=cfg.trainer.torch_threads,
            total_updates=cfg.grpo.max_num_steps * updates_per_step,
            seq_logprob_error_threshold=cfg.grpo.seq_logprob_error_threshold,
            grpo=cfg.grpo,
            ranks=ranks,
            async_save=cfg.checkpointing.async_save,
        )

    # ---- what other backends override ----------------------------------------------------------

    def _build_model(self) -> torch.nn.Module:
        """The policy as a trainable module on ``self.device`` (float32 master weights), sharded
        over the ranks when there are several."""
        path, dtensor = self.policy.model_name, self.policy.dtensor_cfg
        files = shard_readable(path) if self.ranks.sharded and self.read_own_shards else None
        if files is not None:
            model, self.checkpoint_bytes_read = load_sharded(
                path,
                files,
                self.ranks,
                self.dtype,
                activation_checkpointing=dtensor.activation_checkpointing,
                cpu_offload=dtensor.cpu_offload,
            )
            return model
        model = _load_model(path, torch.float32)
        if dtensor.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self.ranks.sharded:
            return model.to(self.device)
        return shard_model(model.to(self.device), self.ranks, self.dtype, cpu_offload=dtensor.cpu_offload)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over every parameter with the schedule's settings (``policy.optimizer``)."""
        return torch.optim.AdamW(self.model.parameters(), **adamw_settings(self.policy))

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bfloat16 compute over float32 weights on one rank (FSDP2 casts on its own)."""
        if self.dtype == torch.float32 or self.ranks.sharded:
            return contextlib.nullcontext()
        autocast: contextlib.AbstractContextManager[Any] = torch.autocast(self.device.type, dtype=self.dtype)
        return autocast

    def _pad_token_id(self) -> int:
        return int(self.model.config.pad_token_id or 0)

    def _forward_logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, T, V] logits. Packed inputs come with position ids and no attention mask."""
        with self._autocast():
            if position_ids is not None:
                return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _grads_ready(self) -> None:
        """Called after the last backward of an update, before normalising and clipping."""

    # ---- training -----------------------------------------------------------------------------

    def train_step(self, batch: StepBatch) -> LearnerMetrics:
        """One step on one rank (the whole batch is this rank's share)."""
        shares = plan_step(batch, 1, self.policy.train_global_batch_size, reward_kl=self.loss_cfg.use_kl_in_reward)
        return self.train_share(shares[0] if shares else None)

    def train_share(self, share: RankShare | None) -> LearnerMetrics:
        """This rank's part of a step (every rank calls it together); the step's global metrics.
        ``None``: the step has no trainable row (every rank gets None)."""
        t0 = time.perf_counter()
        if share is None:
            return LearnerMetrics(
                loss=0.0, grad_norm=0.0, num_updates=0, train_tokens=0, lr=self._lr(), train_time_s=0.0
            )
        num_updates = len(share.updates)
        acc = StepTotals()
        if self.loss_cfg.use_kl_in_reward:
            share = self._shape_rewards(share, acc)
        needs_prev = num_updates > 1 and not self.loss_cfg.force_on_policy_ratio
        prev = self._rows_logprobs(self.model, share.rows, share.filler) if needs_prev else None
        for upd in share.updates:
            self._update(upd, prev, acc, share.filler)
        acc = self._global_totals(acc)
        if mismatch.debug_enabled() and self.ranks.is_root:
            line = mismatch.debug_line(acc.records, self.seq_error_threshold)
            if line is not None:
                log.warning("%s", line)
        return self._step_metrics(acc, num_updates, time.perf_counter() - t0)

    def _update(self, rows: list[Row], prev: dict[str, torch.Tensor] | None, acc: StepTotals, filler: Row) -> None:
        """One optimizer update over ``rows`` (this rank's share of it), accumulated over
        micro-batches; the gradients, summed over ranks, are normalised once the update's global
        valid-token (or sequence) count is known."""
        self._zero_grads()
        local = self._accumulate(rows, prev, acc, filler)
        self._grads_ready()
        loss_sum, valid_tokens, valid_sequences = self._sum_over_data(local)
        denom = valid_tokens if self.loss_cfg.token_level_loss else valid_sequences
        if denom == 0:
            if self.ranks.is_root:
                log.warning("update %d has no valid token after masking; skipped", self.updates)
            acc.losses.append(0.0)
            acc.grad_norms.append(0.0)
            return
        # FSDP2 (and Megatron's DDP) average gradients over the data ranks; the update wants their
        # sum over its global count.
        scale = denom / self.data_ranks.world_size
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(scale)
        grad_norm = self._clip_grads()
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} at update {self.updates}")
        self.optimizer.step()
        self.scheduler.step()
        self.updates += 1
        acc.losses.append(loss_sum / denom)
        acc.grad_norms.append(grad_norm)

    def _accumulate(
        self, rows: list[Row], prev: dict[str, torch.Tensor] | None, acc: StepTotals, filler: Row
    ) -> list[float]:
        """Forward and backward over this rank's micro-batches of an update; its loss sum, valid
        tokens and valid sequences."""
        sums = [0.0, 0.0, 0.0]
        for mb_rows in self._in_step(self._micro_batches(rows, self.policy.train_micro_batch_size)):
            if mb_rows is None:
                self._backward(self._filler_loss(filler))
                continue
            mb = self._inputs(mb_rows)
            plain: list[torch.Tensor] | None = [] if self.top_p < 1.0 else None
            curr = self._token_logprobs(self.model, mb, plain)
            ref_lp = None
            if self._kl_in_loss:
                with torch.no_grad():
                    ref_lp = self._token_logprobs(self.ref_model, mb)
            self._backward(self._micro_batch_loss(mb_rows, mb, curr, plain, prev, ref_lp, acc, sums))
        return sums

    def _sum_over_data(self, values: list[float]) -> list[float]:
        """An update's figures summed over the ranks that share out its rows."""
        return self.data_ranks.all_sum(values)

    def _clip_grads(self) -> float:
        """Clip the gradients to ``policy.max_grad_norm`` by their global norm; that norm."""
        return _as_float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.policy.max_grad_norm))

    def _filler_loss(self, filler: Row) -> torch.Tensor:
        """A pass that adds nothing to any gradient or figure, run by a rank with fewer
        micro-batches than another so that its collectives line up with theirs."""
        mb = self._inputs([filler])
        curr = self._token_logprobs(self.model, mb)
        if self._kl_in_loss:
            with torch.no_grad():
                self._token_logprobs(self.ref_model, mb)
        return curr.sum() * 0.0

    @property
    def _kl_in_loss(self) -> bool:
        """The loss has a KL term (a reference model, and the KL not moved into the rewards)."""
        return self.ref_model is not None and not self.loss_cfg.use_kl_in_reward

    def _micro_batch_loss(
        self,
        rows: list[Row],
        mb: dict[str, torch.Tensor],
        curr: torch.Tensor,
        plain: list[torch.Tensor] | None,
        prev: dict[str, torch.Tensor] | None,
        ref_lp: torch.Tensor | None,
        acc: StepTotals,
        sums: list[float],
    ) -> torch.Tensor:
        """The micro-batch's summed loss from its current logprobs ``curr`` (``plain``: without the
        top-p truncation); its figures go to ``acc``, and its loss, valid tokens and valid
        sequences (after sequence masking) are added to ``sums``."""
        acc.shapes.append([len(r.input_ids) for r in rows])
        prev_lp = curr.detach() if prev is None else self._stack(prev, rows, curr.shape)
        sample_mask = self._mask_by_seq_error(prev_lp, mb, acc.records)
        mask = mb["token_mask"] * sample_mask[:, None]
        loss, m = clipped_pg_loss(
            curr_lp=curr,
            prev_lp=prev_lp,
            gen_lp=mb["gen_lp"],
            advantages=mb["advantages"],
            token_mask=mb["token_mask"],
            sample_mask=sample_mask,
            cfg=self.loss_cfg,
            norm=_SUMS,
            ref_lp=ref_lp,
        )
        if plain:  # the old policy's logprobs without the truncation, taken at this pass's weights
            m.update(mismatch.untruncated_sums(prev_lp + (plain[0] - curr).detach(), mb["gen_lp"], mask))
        # Before the sequence-error threshold: rows a bad refit ruins are the ones it masks.
        fresh = torch.tensor([r.fresh for r in rows], device=curr.device)
        m.update(mismatch.fresh_sums(prev_lp, mb["gen_lp"], mb["token_mask"] * mb["sample_mask"][:, None], fresh))
        for k, v in m.items():
            acc.sums[k] = max(acc.sums.get(k, 0.0), v) if k.startswith("max_") else acc.sums.get(k, 0.0) + v
        row_tokens = mask.sum(dim=1)
        sums[0] += float(loss.detach())
        sums[1] += float(row_tokens.sum())
        sums[2] += float((row_tokens > 0).sum())
        return loss

    def _mask_by_seq_error(
        self, prev_lp: torch.Tensor, mb: dict[str, torch.Tensor], records: list[mismatch.SeqRecord]
    ) -> torch.Tensor:
        """The micro-batch's sample mask after the sequence-level logprob-error threshold."""
        err, n = mismatch.seq_errors(prev_lp, mb["gen_lp"], mb["token_mask"], mb["sample_mask"])
        new = mismatch.apply_threshold(err, mb["sample_mask"], self.seq_error_threshold)
        for i in range(len(err)):
            masked = bool(mb["sample_mask"][i] > 0 and new[i] == 0)
            records.append(mismatch.SeqRecord(float(n[i]), float(err[i]), float(mb["rewards"][i]), masked))
        return new


def adamw_settings(policy: PolicySection) -> dict[str, Any]:
    """torch AdamW's arguments from ``policy.optimizer``."""
    opt = policy.optimizer
    return {"lr": opt.lr, "betas": tuple(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}


def _as_float(norm: torch.Tensor) -> float:
    """A gradient norm as a float (a DTensor's is gathered first)."""
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
