"""The torch backend's inputs and logprobs: rows padded (or packed) into micro-batches, each
micro-batch's forward pass and its token logprobs under the distribution the generator sampled
from, and each row's logprobs without gradients. Mixed into
`services.trainer.backends.torch_backend.TorchBackend` (the megatron backend overrides the forward
pass and the logprobs of its vocabulary-parallel logits); the backend owns the attributes and the
model call (`_forward_logits`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from services.trainer import packing
from services.trainer.batch import Row
from services.trainer.ranks import Ranks
from shared.sections.policy import PolicySection
from shared_torch.nucleus import sampled_logprobs


class TorchInputs:
    policy: PolicySection
    ranks: Ranks
    device: torch.device
    pad_id: int
    temperature: float
    top_p: float

    if TYPE_CHECKING:  # the backend's model call

        def _forward_logits(
            self,
            model: torch.nn.Module,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None,
        ) -> torch.Tensor: ...

    def _pad(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        width = max(len(r.input_ids) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        attn = np.zeros((len(rows), width), dtype=np.int64)
        tmask = np.zeros((len(rows), width), dtype=np.float32)
        glp = np.zeros((len(rows), width), dtype=np.float32)
        for i, r in enumerate(rows):
            n = len(r.input_ids)
            ids[i, :n], attn[i, :n], tmask[i, :n], glp[i, :n] = r.input_ids, 1, r.token_mask, r.gen_logprobs

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device)

        return {
            "input_ids": t(ids),
            "attention_mask": t(attn),
            "token_mask": t(tmask),
            "gen_lp": t(glp),
            "advantages": torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=self.device),
            "sample_mask": torch.tensor([r.sample_mask for r in rows], dtype=torch.float32, device=self.device),
            "rewards": [r.reward for r in rows],
        }

    def _token_logprobs(
        self, model: torch.nn.Module, mb: dict[str, torch.Tensor], untruncated: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """logprob of token t given tokens < t, at position t (position 0 gets 0), as [rows, T], under
        the distribution the generator sampled from (`_logprobs_of`). A packed micro-batch
        (``mb["pack"]``) runs as one sequence."""
        return self._logprobs_of(self._mb_logits(model, mb), mb, untruncated)

    def _mb_logits(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's forward pass: its logits (a packed one's as one sequence)."""
        if "pack" in mb:
            return self._forward_logits(model, mb["pack"][0], position_ids=mb["pack"][1])
        return self._forward_logits(model, mb["input_ids"], attention_mask=mb["attention_mask"])

    def _logprobs_of(
        self, logits: torch.Tensor, mb: dict[str, torch.Tensor], untruncated: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The micro-batch's token logprobs from its logits (`_token_logprobs`), under temperature and
        the top-p nucleus (`shared_torch.nucleus.sampled_logprobs`). With top_p < 1, ``untruncated``
        receives the same figures under the temperature-only softmax."""
        ids = mb["pack"][0] if "pack" in mb else mb["input_ids"]
        both = sampled_logprobs(
            logits[:, :-1].float(), ids[:, 1:], self.temperature, self.top_p, untruncated=untruncated is not None
        )
        lps = [F.pad(lp, (1, 0)) for lp in both if lp is not None]
        if "pack" in mb:
            lps = [packing.unpack_logprobs(lp[0], mb["pack"][2], mb["lengths"], mb["input_ids"].shape[1]) for lp in lps]
        if untruncated is not None:
            untruncated += lps[1:]
        return lps[0]

    def _micro_batches(self, rows: list[Row], micro: int) -> list[list[Row]]:
        """Consecutive rows ``micro`` at a time, or packs up to the token budget."""
        sp = self.policy.sequence_packing
        if not sp.enabled:
            return [rows[s : s + micro] for s in range(0, len(rows), micro)]
        packs = packing.first_fit_decreasing([len(r.input_ids) for r in rows], sp.train_mb_tokens)
        return [[rows[i] for i in p] for p in packs]

    def _inputs(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        mb = self._pad(rows)
        if self.policy.sequence_packing.enabled:
            mb["pack"] = packing.packed_inputs([torch.from_numpy(r.input_ids).to(self.device) for r in rows])
            mb["lengths"] = [len(r.input_ids) for r in rows]
        return mb

    def _in_step(self, mbs: list[list[Row]]) -> list[list[Row] | None]:
        """This rank's micro-batches, padded with ``None`` (a masked filler pass) up to the most any
        rank runs, so that every rank joins the same collectives."""
        most = int(self.ranks.all_max([float(len(mbs))])[0])
        return [*mbs, *[None] * (most - len(mbs))]

    def _rows_logprobs(self, model: torch.nn.Module, rows: list[Row], filler: Row) -> dict[str, torch.Tensor]:
        """Each row's token logprobs under ``model`` (row key -> [len]), without gradients, in the
        update's micro-batches."""
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for mb_rows in self._in_step(self._micro_batches(rows, self.policy.train_micro_batch_size)):
                if mb_rows is None:
                    self._token_logprobs(model, self._inputs([filler]))
                    continue
                lp = self._token_logprobs(model, self._inputs(mb_rows))
                for r, row_lp in zip(mb_rows, lp, strict=True):
                    out[r.key] = row_lp[: len(r.input_ids)].clone()
        return out

    def _stack(self, prev: dict[str, torch.Tensor], rows: list[Row], shape: torch.Size) -> torch.Tensor:
        t = torch.zeros(shape, dtype=torch.float32, device=self.device)
        for i, r in enumerate(rows):
            t[i, : len(r.input_ids)] = prev[r.key]
        return t
