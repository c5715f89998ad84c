"""The training backend: the step runner composed with one model adapter, on one rank or many.

`Backend` implements `services.trainer.backends.base.TrainingBackend` for any
`services.trainer.backends.adapter.ModelAdapter` (a transformers causal LM sharded with FSDP2, or
megatron-core's GPTModel over tensor, pipeline, expert and data ranks). It owns what every engine
family trains the same way; the adapter owns what depends on the engine. One step:

    plan_step (rank 0)                 the step's rows -> optimizer updates -> each data rank's share
    train_share (every rank at once)   [KL-shaped rewards] -> [old logprobs] -> per update:
      zero_grads -> adapter.run(micro-batches, score) -> grads_ready
      -> sum over the data ranks -> divide the gradients by the update's global count
      -> clip -> optimizer and schedule step
    -> the step's totals over the ranks -> LearnerMetrics

``len(rows) / train_global_batch_size`` optimizer updates run per step, each accumulated over
micro-batches (`micro_batch.split`; packed with ``policy.sequence_packing``). Each micro-batch's
loss is a sum (`step.micro_batch_loss`); the gradients are divided by the update's valid-token
(or valid-sequence) count once it is known, which is only after the sequence-level logprob-error
mask (`services.trainer.mismatch`) saw every row's pre-update logprobs. With one update a step
those equal the current ones in value and are taken from the same forward pass; with several
they are scored once before the updates. Every rank runs as many micro-batches as the busiest
(a masked filler pass makes up the difference), so collectives line up; gradients are summed over
the data ranks and divided by the global count, so an update equals the one-rank update on the
same rows, and every logged figure is global. On a pipeline only the last stage scores rows; its
figures reach the other stages through the `Layout`'s reductions.

With a reference policy (``loss_fn.reference_policy_kl_penalty`` > 0) the adapter builds a frozen
second copy: it scores the update's rows for the loss's KL term, or with
``loss_fn.use_kl_in_reward`` the step's rows once before the updates, and the rows train on the
advantages of the KL-shaped rewards (`kl_shaping`). Checkpoints: `dcp.LearnerCheckpoint`; weights:
the adapter's, in files of at most ``max_weight_file_bytes``. Built by
`services.trainer.backends.build_backend`; called by the learner (in a worker thread, so the
control plane's event loop keeps serving REST and streams).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.trainer import mismatch
from services.trainer.backends import kl_shaping
from services.trainer.backends.adapter import ModelAdapter
from services.trainer.backends.base import NonFiniteGradient, describe_nonfinite, nonfinite_grads
from services.trainer.backends.dcp import LearnerCheckpoint
from services.trainer.backends.layout import Layout
from services.trainer.backends.micro_batch import MicroBatch, micro_batch, padded_to_most, split, stacked
from services.trainer.backends.step import UpdateSums, micro_batch_loss
from services.trainer.backends.step_metrics import StepTotals, global_totals, kl_penalty, learner_metrics
from services.trainer.batch import Row, StepBatch
from services.trainer.step_plan import RankShare, lr_schedule, plan_step
from services.trainer.weight_export import DEFAULT_MAX_SHARD_BYTES
from shared.records import LearnerMetrics
from shared.run_config import RunConfig

log = logging.getLogger(__name__)


class Backend:
    def __init__(self, adapter: ModelAdapter, cfg: RunConfig, *, max_weight_file_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.adapter = adapter
        self.policy = cfg.policy
        self.loss_cfg = cfg.loss_fn
        self.grpo = cfg.grpo
        self.seq_error_threshold = cfg.grpo.seq_logprob_error_threshold
        self.max_weight_file_bytes = max_weight_file_bytes
        loaded = adapter.build()
        self.model = loaded.module.train()
        self.checkpoint_bytes_read = loaded.bytes_read  # by this rank, when it read only its shards
        self.pad_id = adapter.pad_token_id(self.model)
        self.optimizer = adapter.build_optimizer(self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_schedule(cfg.policy.optimizer, total_updates(cfg))
        )
        self.ref_model = _frozen(adapter.build().module) if cfg.loss_fn.reference_policy_kl_penalty > 0 else None
        self.updates = 0
        self.checkpoint = LearnerCheckpoint(adapter.layout.world, async_save=cfg.checkpointing.async_save)
        log.info(
            "%s backend: %s, %.2fM params, %s compute on %s, %s",
            self.name,
            self.policy.model_name,
            sum(p.numel() for p in self.model.parameters()) / 1e6,  # a DTensor counts its global shape
            self.dtype,
            self.layout.world.device,
            _describe(self.layout),
        )

    @property
    def name(self) -> str:
        return self.adapter.name

    @property
    def layout(self) -> Layout:
        return self.adapter.layout

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.dtype

    # ---- a step -----------------------------------------------------------------------------

    def plan(self, batch: StepBatch) -> list[RankShare]:
        """The step's rows as each data rank's share (empty: nothing trainable)."""
        reward_kl = self.loss_cfg.use_kl_in_reward
        return plan_step(batch, self.layout.data.world_size, self.policy.train_global_batch_size, reward_kl=reward_kl)

    def train_step(self, batch: StepBatch) -> LearnerMetrics:
        """One step on one rank (the whole batch is this rank's share)."""
        shares = self.plan(batch)
        return self.train_share(shares[0] if shares else None)

    def train_share(self, share: RankShare | None) -> LearnerMetrics:
        """This rank's part of a step (every rank calls it together); the step's global metrics.
        ``None``: the step has no trainable row (every rank gets None)."""
        t0 = time.perf_counter()
        if share is None:
            return LearnerMetrics(
                loss=0.0, grad_norm=0.0, num_updates=0, train_tokens=0, lr=self._lr(), train_time_s=0.0
            )
        acc = StepTotals()
        if self.loss_cfg.use_kl_in_reward:
            mine = self._sequence_kl(share.rows + share.baseline_rows, share.filler)
            share = kl_shaping.shaped_share(share, mine, self.layout, self.loss_cfg, self.grpo, acc)
        needs_prev = len(share.updates) > 1 and not self.loss_cfg.force_on_policy_ratio
        prev = self.rows_logprobs(share.rows, share.filler) if needs_prev else None
        for i, rows in enumerate(share.updates):
            self._update(rows, prev, acc, share.filler, f"update {i + 1} of {len(share.updates)} of this step")
        acc = global_totals(acc, self.layout)
        if mismatch.debug_enabled() and self.layout.world.is_root:
            line = mismatch.debug_line(acc.records, self.seq_error_threshold)
            if line is not None:
                log.warning("%s", line)
        return learner_metrics(
            acc,
            num_updates=len(share.updates),
            lr=self._lr(),
            train_time_s=time.perf_counter() - t0,
            kl=kl_penalty(acc.sums, reference=self.ref_model is not None, in_reward=self.loss_cfg.use_kl_in_reward),
            seq_error_threshold=self.seq_error_threshold,
            packing_cfg=self.policy.sequence_packing,
        )

    def _update(
        self, rows: list[Row], prev: dict[str, torch.Tensor] | None, acc: StepTotals, filler: Row, which: str
    ) -> None:
        """One optimizer update over ``rows`` (this rank's share of it), accumulated over
        micro-batches; the gradients, summed over ranks, are normalised once the update's global
        valid-token (or sequence) count is known. A non-finite gradient norm (the same on every
        rank: it is global) fails or skips the update (``policy.on_nonfinite_grad``)."""
        self.adapter.zero_grads(self.model, self.optimizer)
        local = self._accumulate(rows, prev, acc, filler)
        self.adapter.grads_ready(self.model)
        loss_sum, valid_tokens, valid_sequences = self.layout.sum_over_data(local.as_list())
        denom = valid_tokens if self.loss_cfg.token_level_loss else valid_sequences
        if denom == 0:
            if self.layout.world.is_root:
                log.warning("update %d has no valid token after masking; skipped", self.updates)
            acc.losses.append(0.0)
            acc.grad_norms.append(0.0)
            return
        # FSDP2 (and Megatron's DDP) average gradients over the data ranks; the update wants their
        # sum over its global count.
        scale = denom / self.layout.data.world_size
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(scale)
        grad_norm = self.adapter.clip_grads(self.model, self.policy.max_grad_norm)
        if not math.isfinite(grad_norm):
            names = nonfinite_grads((n, p.grad) for n, p in self.model.named_parameters())
            what = f"gradient norm {grad_norm} in {which}: {describe_nonfinite(names, self.layout.world.rank)}"
            if self.policy.on_nonfinite_grad == "fail":
                raise NonFiniteGradient(what)
            log.warning("skipped (policy.on_nonfinite_grad: skip) the %s", what)
            acc.skipped_updates += 1
            return
        self.optimizer.step()
        self.scheduler.step()
        self.updates += 1
        acc.losses.append(loss_sum / denom)
        acc.grad_norms.append(grad_norm)

    def _accumulate(
        self, rows: list[Row], prev: dict[str, torch.Tensor] | None, acc: StepTotals, filler: Row
    ) -> UpdateSums:
        """Forward and backward over this rank's micro-batches of an update (the last stage scores
        them); its loss sum, valid tokens and valid sequences."""
        mbs = self._micro_batches(rows)
        ref = self.rows_logprobs(rows, filler, model=self.ref_model) if self._kl_in_loss else None
        sums = UpdateSums()
        untruncated = self.policy.generation.top_p < 1.0

        def score(i: int, mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            mb_rows = mbs[i]
            if mb_rows is None:  # a filler pass: in every collective, in no gradient or figure
                return self.adapter.logprobs(logits, mb).sum() * 0.0
            plain: list[torch.Tensor] | None = [] if untruncated else None
            curr = self.adapter.logprobs(logits, mb, plain)
            return micro_batch_loss(
                mb_rows,
                mb,
                curr,
                plain=plain,
                prev=prev,
                ref_lp=None if ref is None else stacked(ref, mb_rows, curr.detach()),
                loss_cfg=self.loss_cfg,
                seq_error_threshold=self.seq_error_threshold,
                acc=acc,
                sums=sums,
            )

        self.adapter.run(self.model, [self.inputs(r or [filler]) for r in mbs], score, forward_only=False)
        return sums

    @property
    def _kl_in_loss(self) -> bool:
        """The loss has a KL term (a reference model, and the KL not moved into the rewards)."""
        return self.ref_model is not None and not self.loss_cfg.use_kl_in_reward

    def _micro_batches(self, rows: list[Row]) -> list[list[Row] | None]:
        mbs = split(rows, self.policy.train_micro_batch_size, self.policy.sequence_packing)
        return padded_to_most(mbs, self.layout.world)

    def _sequence_kl(self, rows: list[Row], filler: Row) -> kl_shaping.KLSums:
        """The KL sums of ``rows`` under the policy before this step's updates, taken on the last
        stage and shared with the others."""
        assert self.ref_model is not None
        lp = self.rows_logprobs(rows, filler)
        ref = self.rows_logprobs(rows, filler, model=self.ref_model)
        mine = kl_shaping.kl_sums(rows, lp, ref, self.loss_cfg) if self.layout.last_stage else None
        found = self.layout.from_last_stage(mine)
        assert found is not None
        return found

    # ---- inputs and logprobs ------------------------------------------------------------------

    def inputs(self, rows: list[Row]) -> MicroBatch:
        """``rows`` as one forward pass's tensors (packed with ``policy.sequence_packing``)."""
        packed = self.policy.sequence_packing.enabled
        return micro_batch(rows, self.pad_id, self.layout.world.device, packed=packed)

    def rows_logprobs(
        self, rows: list[Row], filler: Row, *, model: torch.nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        """Each row's token logprobs under ``model`` (the policy by default) without gradients, in
        an update's micro-batches, by row key ([len] each; on a pipeline only the last stage has
        them). Every rank calls it together."""
        mbs = self._micro_batches(rows)
        out: dict[str, torch.Tensor] = {}

        def keep(i: int, mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            lp = self.adapter.logprobs(logits, mb)
            for r, row_lp in zip(mbs[i] or [], lp, strict=False):
                out[r.key] = row_lp[: len(r.input_ids)].clone()
            return lp.sum() * 0.0

        inputs = [self.inputs(r or [filler]) for r in mbs]
        self.adapter.run(self.model if model is None else model, inputs, keep, forward_only=True)
        return out

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Each token's logprob given those before it under the policy, from the raw logits
        (temperature 1, no nucleus), as an engine's prompt logprobs: a refit's probe. Every rank
        calls it together; every rank gets the last stage's figures."""
        import msgspec
        import numpy as np

        n = len(token_ids)
        row = Row(
            task_id="probe",
            group_id="probe",
            input_ids=np.asarray(token_ids, dtype=np.int64),
            token_mask=np.ones(n, dtype=np.float32),
            gen_logprobs=np.zeros(n, dtype=np.float32),
            reward=0.0,
        )
        policy = self.adapter.policy  # type: ignore[attr-defined]  # both adapters keep theirs here
        raw = msgspec.structs.replace(policy.generation, temperature=1.0, top_p=1.0)
        self.adapter.policy = msgspec.structs.replace(policy, generation=raw)  # type: ignore[attr-defined]
        try:
            got = self.rows_logprobs([row], row)
        finally:
            self.adapter.policy = policy  # type: ignore[attr-defined]
        values = [float(x) for x in got[row.key][1:n]] if row.key in got else None
        found = self.layout.from_last_stage(values)
        assert found is not None, "the last stage scored no probe"
        return found

    def logprobs(self, rows: list[Row], *, reference: bool = False) -> torch.Tensor:
        """[rows, T] token logprobs of ``rows`` as one micro-batch under the policy (or the frozen
        reference), as the loss sees them; on this rank alone (one rank, no pipeline)."""
        model = self.ref_model if reference else self.model
        assert model is not None, "no reference model (loss_fn.reference_policy_kl_penalty is 0)"
        mb = self.inputs(rows)
        return self.adapter.logprobs(self.adapter.logits(model, mb), mb)

    # ---- weights and checkpoints -------------------------------------------------------------

    def save_weights(self, out_dir: Path) -> dict[str, str]:
        return self.adapter.save_weights(self.model, out_dir, self.max_weight_file_bytes)

    def weight_metadata(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.adapter.weight_metadata(self.model)

    def weight_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.adapter.weight_tensors(self.model)

    def weight_shards(self) -> Any:
        return self.adapter.weight_shards(self.model)

    def save_checkpoint(self, path: Path) -> None:
        """Model and optimizer as a Distributed Checkpoint (every rank writes its part; any layout
        reads it back), the schedule and RNG from rank 0 (`dcp.LearnerCheckpoint`)."""
        self.checkpoint.wait()
        state = self.adapter.checkpoint_state(self.model, self.optimizer, copy=self.checkpoint.async_save)
        self.checkpoint.save(state, self._trainer_state(), path)

    def wait_for_save(self) -> None:
        self.checkpoint.wait()

    def load_checkpoint(self, path: Path) -> None:
        state = self.adapter.checkpoint_state(self.model, self.optimizer)
        extra = self.checkpoint.load(state, path)
        self.adapter.restore_state(self.model, self.optimizer, state)
        self._resume_schedule(int(extra["scheduler"]["last_epoch"]))
        self.updates = int(extra["updates"])
        torch.set_rng_state(extra["torch_rng"])

    def _trainer_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "updates": self.updates, "torch_rng": torch.get_rng_state()}

    def _resume_schedule(self, updates_done: int) -> None:
        """The learning-rate schedule at ``updates_done``, computed from this run's groups (their
        number may differ from the saved run's: a sharded optimizer chains two)."""
        sched = self.scheduler
        sched.last_epoch = updates_done
        lrs = [base * fn(updates_done) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        sched._last_lr = lrs

    def _lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])


def total_updates(cfg: RunConfig) -> int:
    """The optimizer updates of the whole run (the learning-rate schedule's length)."""
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    return cfg.grpo.max_num_steps * (rows // (cfg.policy.train_global_batch_size or rows))


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _describe(layout: Layout) -> str:
    world = layout.world.world_size
    if world == 1:
        return "one rank"
    return f"{world} ranks ({layout.data.world_size} data-parallel, {layout.pipeline.world_size} stages)"
