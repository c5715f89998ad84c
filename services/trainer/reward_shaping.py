"""Overlong handling (DAPO): which rollouts ran out of tokens, and the soft overlong punishment.

* ``hit_token_budget``: a rollout ran out of tokens without a natural end when its last model
  call stopped at its token limit (``finish_reason`` ``length``) or its sequence was cut at
  ``policy.max_total_sequence_length``. With ``grpo.overlong_filtering`` such a rollout is masked
  out of the loss (its reward is noise: it was cut, not judged on an answer), but it keeps its
  place in its group's baseline, as NeMo-RL's ``loss_multiplier`` does. A rollout the environment
  ended at a turn cap, or a refused request, is not one: its last call ended on its own.
* ``OverlongPenalty`` (``grpo.reward_shaping``): with ``L = max_response_length`` and ``B =
  overlong_buffer_length``, a rollout of ``n`` generated tokens (all its turns) gets
  ``0`` for ``n <= L - B``, ``-(n - (L - B)) / B * overlong_buffer_penalty`` in between, and
  ``-overlong_buffer_penalty`` beyond ``L`` (DAPO's section 3.4). It is added to the reward used
  for advantages; the environment's reward stays what the records and the dynamic-sampling filter
  see (NeMo-RL filters on the unshaped reward too).

Called by the batch builder; the control plane builds the penalty from the run config.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import Trajectory
from shared.run_config import RunConfig


def hit_token_budget(traj: Trajectory, *, cut: bool) -> bool:
    """True when the rollout ran out of tokens without a natural end (``cut``: its sequence was
    cut at ``policy.max_total_sequence_length``)."""
    return cut or (bool(traj.turns) and traj.turns[-1].finish_reason == "length")


@dataclass(frozen=True)
class OverlongPenalty:
    max_response_length: int
    buffer_length: int
    penalty: float

    @classmethod
    def from_config(cls, cfg: RunConfig) -> OverlongPenalty | None:
        """The configured penalty; None when ``grpo.reward_shaping.enabled`` is off."""
        rs = cfg.grpo.reward_shaping
        if not rs.enabled:
            return None
        return cls(
            max_response_length=rs.max_response_length or cfg.policy.max_total_sequence_length,
            buffer_length=rs.overlong_buffer_length,
            penalty=rs.overlong_buffer_penalty,
        )

    def __call__(self, response_tokens: int) -> float:
        """The penalty (<= 0) of a response of ``response_tokens`` generated tokens."""
        expected = self.max_response_length - self.buffer_length
        excess = min(response_tokens, self.max_response_length) - expected
        return 0.0 if excess <= 0 else -excess / self.buffer_length * self.penalty
