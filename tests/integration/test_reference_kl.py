"""The KL to the reference policy on the tiny model, through the torch backend: zero while the
policy equals its reference; once the policy moved, the reported ``kl_penalty`` and the change of
the loss and of the gradient equal a hand computation from the two models' logprobs; and with
``use_kl_in_reward`` the step trains on the advantages of the KL-shaped rewards, with no KL term
in the loss."""

import numpy as np
import pytest
import torch

from services.trainer.advantages import group_advantages
from services.trainer.backends import build_backend
from services.trainer.backends.backend import Backend
from services.trainer.batch import Row, StepBatch
from shared.config import load
from shared.run_config import RunConfig

pytestmark = pytest.mark.integration


def _backend(model_dir, beta: float, *extra: str, moved: bool = True) -> Backend:
    """A backend whose reference is the tiny model and whose policy (``moved``) is the tiny model
    with every weight nudged by the same seeded noise (as after some training)."""
    overrides = [
        f"policy.model_name={model_dir}",
        "data.train_path=t.jsonl",
        "policy.max_grad_norm=1e9",  # gradients are compared before any clipping
        f"loss_fn.reference_policy_kl_penalty={beta}",
        "grpo.num_generations_per_prompt=3",
        "run.seed=0",
        "trainer.torch_threads=1",
        *extra,
    ]
    backend = build_backend(load(RunConfig, None, overrides, env={}))
    if moved:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in backend.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return backend


def _rows(backend: Backend, advantages=(1.0, -1.0, 0.5)) -> list[Row]:
    """One group of rows whose generator logprobs equal the policy's (importance weights 1)."""
    rng = np.random.default_rng(0)
    rows = []
    for i, adv in enumerate(advantages):
        n = 12 + 2 * i
        tmask = np.zeros(n, np.float32)
        tmask[5:] = 1.0
        ids = rng.integers(10, 800, size=n).astype(np.int64)
        rows.append(Row(f"t{i}", "g0", ids, tmask, np.zeros(n, np.float32), reward=1.0, advantage=adv))
    with torch.no_grad():
        for row in rows:
            lp = backend.logprobs([row])[0].numpy()
            row.gen_logprobs = (lp * row.token_mask).astype(np.float32)
    return rows


def _k3(backend: Backend, ref: Backend, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token k3 of ``backend``'s policy to ``ref``'s reference model, with autograd through the
    policy, and the loss mask ([rows, T] each)."""
    assert ref.ref_model is not None
    lp = backend.logprobs(rows)
    with torch.no_grad():
        ref_lp = ref.logprobs(rows, reference=True)
    log_r = ref_lp - lp
    weight = torch.exp(lp - lp.detach())  # 1, with the score-function gradient
    return weight * (torch.exp(log_r) - 1.0 - log_r), backend.inputs(rows).token_mask


def _grads(backend: Backend) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten() for p in backend.model.parameters()]
    )


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-3, atol=1e-4 * float(b.abs().max()))


def test_a_reference_equal_to_the_policy_adds_nothing(tiny_model_dir):
    with_kl = _backend(tiny_model_dir, 0.5, moved=False)
    without = _backend(tiny_model_dir, 0.0, moved=False)
    m = with_kl.train_step(StepBatch(_rows(with_kl)))
    m0 = without.train_step(StepBatch(_rows(without)))
    assert m.kl_penalty == pytest.approx(0.0, abs=1e-7) and m0.kl_penalty is None
    assert m.loss == pytest.approx(m0.loss, abs=1e-6)
    assert _close(_grads(with_kl), _grads(without))


def test_the_kl_metric_loss_and_gradient_match_a_hand_computation(tiny_model_dir):
    beta = 0.5
    with_kl = _backend(tiny_model_dir, beta)
    without = _backend(tiny_model_dir, 0.0)
    rows = _rows(with_kl)
    # By hand, on the policy as it is before the step: the mean k3 over the loss tokens, and the
    # gradient of beta x that mean (taken on the copy without a reference, before its own step).
    k3, mask = _k3(without, with_kl, rows)
    mean_kl = (k3 * mask).sum() / mask.sum()
    without.model.zero_grad()
    (beta * mean_kl).backward()
    kl_grad = _grads(without).clone()
    kl_value = float(mean_kl.detach())
    assert kl_value > 1e-3  # the nudge moved the policy measurably

    m = with_kl.train_step(StepBatch(rows))
    m0 = without.train_step(StepBatch(_rows(without)))
    assert m.kl_penalty == pytest.approx(kl_value, rel=1e-4)
    assert m.loss - m0.loss == pytest.approx(beta * kl_value, rel=1e-3)
    assert _close(_grads(with_kl) - _grads(without), kl_grad)
    assert float(kl_grad.norm()) > 0.05 * float(_grads(without).norm())  # a change worth checking


def test_kl_in_reward_trains_on_the_advantages_of_the_shaped_rewards(tiny_model_dir):
    beta = 2.0
    shaped = _backend(tiny_model_dir, beta, "loss_fn.use_kl_in_reward=true")
    plain = _backend(tiny_model_dir, 0.0)
    # Equal rewards: the control plane's advantages are all 0. The third row is masked out of the
    # loss (env-flagged) but still counts in the group's baseline, with its own KL.
    rows = _rows(shaped, advantages=(0.0, 0.0, 0.0))
    rows[2].sample_mask, rows[2].env_flagged = 0.0, True
    with torch.no_grad():
        k3, mask = _k3(plain, shaped, rows)
    seq_kl = (k3 * mask).sum(dim=1).numpy()
    expected = group_advantages(1.0 - beta * seq_kl)  # leave-one-out, normalised: grpo's defaults
    assert np.abs(expected[:2]).min() > 0.1

    m = shaped.train_step(StepBatch(rows))
    assert m.kl_penalty == pytest.approx(float((k3 * mask).sum() / mask.sum()), rel=1e-4)
    # The same step as training the KL-free backend on those advantages: no KL term in the loss.
    by_hand = _rows(plain, advantages=tuple(float(a) for a in expected))
    by_hand[2].sample_mask = 0.0
    m_hand = plain.train_step(StepBatch(by_hand))
    assert m.loss == pytest.approx(m_hand.loss, rel=1e-4)
    assert _close(_grads(shaped), _grads(plain))
    assert float(_grads(shaped).norm()) > 0.0
