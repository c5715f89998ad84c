"""A step's rows as the tensors a forward pass takes, and the logprobs that come back: the
first part of the step runner (`services.trainer.backends.step`), plain functions over tensors.

* `split`: an update's rows in micro-batches, ``policy.train_micro_batch_size`` rows each, or
  packs up to ``policy.sequence_packing.train_mb_tokens`` tokens (`services.trainer.packing`);
* `padded_to_most`: this rank's micro-batches, padded with ``None`` (a masked filler pass) up to
  the most any rank runs, so that every rank joins the same collectives;
* `micro_batch`: rows right-padded into [rows, T] tensors (`MicroBatch`), and with packing the
  same rows laid end to end as one sequence whose position ids restart at every row;
* `sampled_logprobs_of`: each token's logprob under the distribution the generator sampled it
  from (temperature, then the top-p nucleus: `shared_torch.nucleus`), from whole logits, as
  [rows, T] (position 0 gets 0; a pack's are cut back into rows).

Used by the backend and by both model adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.trainer import packing
from services.trainer.batch import Row
from services.trainer.ranks import Ranks
from shared.sections.policy import SequencePackingSection
from shared_torch.nucleus import sampled_logprobs


@dataclass(frozen=True)
class Pack:
    """Rows laid end to end as one sequence: ids and position ids [1, L], each row's offset."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: list[int]


@dataclass(frozen=True)
class MicroBatch:
    """One forward pass's rows, right-padded to the longest ([rows, T] each)."""

    input_ids: torch.Tensor  # int64
    attention_mask: torch.Tensor  # int64: 1 on real tokens
    token_mask: torch.Tensor  # float32: 1 on the tokens the policy generated
    gen_lp: torch.Tensor  # float32: the generator's logprob of each generated token
    advantages: torch.Tensor  # float32 [rows]
    sample_mask: torch.Tensor  # float32 [rows]
    rewards: list[float]
    lengths: list[int]  # each row's tokens
    pack: Pack | None = None  # the same rows packed (``policy.sequence_packing.enabled``)
    # The generator's MoE routes in the forward pass's token order (rows' padded positions, or the
    # pack's): [tokens, layers, top_k] expert ids and [tokens] whether each is known
    # (policy.moe_routing_replay; None when no row carries routes).
    routes: torch.Tensor | None = None
    routes_known: torch.Tensor | None = None

    @property
    def ids(self) -> torch.Tensor:
        """The token ids the forward pass reads: the pack's, or the padded rows'."""
        return self.pack.input_ids if self.pack is not None else self.input_ids


def split(rows: list[Row], micro_batch_size: int, packing_cfg: SequencePackingSection) -> list[list[Row]]:
    """Consecutive rows ``micro_batch_size`` at a time, or packs up to the token budget."""
    if not packing_cfg.enabled:
        return [rows[s : s + micro_batch_size] for s in range(0, len(rows), micro_batch_size)]
    packs = packing.first_fit_decreasing([len(r.input_ids) for r in rows], packing_cfg.train_mb_tokens)
    return [[rows[i] for i in p] for p in packs]


def padded_to_most(mbs: list[list[Row]], world: Ranks) -> list[list[Row] | None]:
    """``mbs`` padded with ``None`` (a masked filler pass) up to the most any rank runs."""
    most = int(world.all_max([float(len(mbs))])[0])
    return [*mbs, *[None] * (most - len(mbs))]


def micro_batch(rows: list[Row], pad_id: int, device: torch.device, *, packed: bool = False) -> MicroBatch:
    """``rows`` as one forward pass's tensors on ``device``; ``packed``: with the pack too."""
    width = max(len(r.input_ids) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    attn = np.zeros((len(rows), width), dtype=np.int64)
    tmask = np.zeros((len(rows), width), dtype=np.float32)
    glp = np.zeros((len(rows), width), dtype=np.float32)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n], attn[i, :n], tmask[i, :n], glp[i, :n] = r.input_ids, 1, r.token_mask, r.gen_logprobs

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    pack = None
    if packed:
        pack = Pack(*packing.packed_inputs([torch.from_numpy(r.input_ids).to(device) for r in rows]))
    routes, known = _routes(rows, width, packed, device)
    return MicroBatch(
        input_ids=t(ids),
        attention_mask=t(attn),
        token_mask=t(tmask),
        gen_lp=t(glp),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
        sample_mask=torch.tensor([r.sample_mask for r in rows], dtype=torch.float32, device=device),
        rewards=[r.reward for r in rows],
        lengths=[len(r.input_ids) for r in rows],
        pack=pack,
        routes=routes,
        routes_known=known,
    )


def _routes(
    rows: list[Row], width: int, packed: bool, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows' routes flattened as the forward pass orders its tokens (see `MicroBatch.routes`)."""
    shapes = [r.routes.shape[1:] for r in rows if r.routes is not None]
    if not shapes:
        return None, None
    per_row = []
    for r in rows:
        n = len(r.input_ids) if packed else width
        ids = np.zeros((n, *shapes[0]), dtype=np.int64)
        known = np.zeros(n, dtype=bool)
        if r.routes is not None:
            ids[: len(r.routes)], known[: len(r.routes)] = r.routes, True
        per_row.append((ids, known))
    ids = np.concatenate([i for i, _ in per_row])
    known = np.concatenate([k for _, k in per_row])
    return torch.from_numpy(ids).to(device), torch.from_numpy(known).to(device)


def unpacked(lp: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Logprobs over ``mb``'s forward pass ([1, L] for a pack) as [rows, T]."""
    if mb.pack is None:
        return lp
    return packing.unpack_logprobs(lp[0], mb.pack.starts, mb.lengths, mb.input_ids.shape[1])


def sampled_logprobs_of(
    logits: torch.Tensor,
    mb: MicroBatch,
    temperature: float,
    top_p: float,
    untruncated: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The micro-batch's token logprobs from its whole logits, under ``temperature`` and the top-p
    nucleus (`shared_torch.nucleus.sampled_logprobs`). With top_p < 1, ``untruncated`` receives
    the same figures under the temperature-only softmax."""
    both = sampled_logprobs(
        logits[:, :-1].float(), mb.ids[:, 1:], temperature, top_p, untruncated=untruncated is not None
    )
    lps = [unpacked(F.pad(lp, (1, 0)), mb) for lp in both if lp is not None]
    if untruncated is not None:
        untruncated += lps[1:]
    return lps[0]


def stacked(by_key: dict[str, torch.Tensor], rows: list[Row], base: torch.Tensor) -> torch.Tensor:
    """Rows' logprobs kept by row key (`Row.key`) as one [rows, T] tensor: ``base`` (a tensor of
    that shape) with each row's own positions replaced."""
    t = base.clone()
    for i, r in enumerate(rows):
        t[i, : len(r.input_ids)] = by_key[r.key]
    return t
