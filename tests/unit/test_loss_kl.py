"""The KL to the reference policy: the k1/k2/k3 estimators and their clamps against hand-computed
values, and the KL term of the loss (value, gradient, metric, and its absence with
``use_kl_in_reward``)."""

import math

import pytest
import torch

from services.trainer.loss import LossNormalizer, clipped_pg_loss, kl_estimate
from shared.sections.grpo import LossSection

pytestmark = pytest.mark.unit

LP = [-1.0, -2.0, -0.5]
REF = [-1.5, -1.0, -0.5]  # log rho = ref - lp = (-0.5, 1.0, 0.0)


def _kl(lp, ref, cfg, weights=None):
    lp_t = torch.tensor(lp, requires_grad=True)
    w = None if weights is None else weights(lp_t)
    kl = kl_estimate(lp_t, torch.tensor(ref), cfg, weights=w)
    kl.sum().backward()
    return kl.detach().tolist(), lp_t.grad.tolist()


@pytest.mark.parametrize(
    ("kl_type", "value", "grad"),
    [
        ("k1", [0.5, -1.0, 0.0], [1.0, 1.0, 1.0]),  # -log rho; d/dlp = 1
        ("k2", [0.125, 0.5, 0.0], [0.5, -1.0, 0.0]),  # (log rho)^2 / 2; d/dlp = -log rho
        (
            "k3",  # rho - 1 - log rho; d/dlp = 1 - rho
            [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0],
            [1.0 - math.exp(-0.5), 1.0 - math.e, 0.0],
        ),
    ],
)
def test_each_estimator_matches_its_formula_and_gradient(kl_type, value, grad):
    got, got_grad = _kl(LP, REF, LossSection(reference_policy_kl_type=kl_type))
    assert got == pytest.approx(value, abs=1e-6)
    assert got_grad == pytest.approx(grad, abs=1e-6)


def test_input_clamp_bounds_the_log_ratio_and_stops_its_gradient():
    # log rho = -3: clamped to -1, k3 = e^-1 - 1 + 1 = e^-1 (unclamped: e^-3 + 2), no gradient.
    cfg = LossSection(kl_input_clamp_value=1.0)
    got, grad = _kl([0.0], [-3.0], cfg)
    assert got == pytest.approx([math.exp(-1.0)], abs=1e-6) and grad == [0.0]
    unclamped, grad = _kl([0.0], [-3.0], LossSection(kl_input_clamp_value=None))
    assert unclamped == pytest.approx([math.exp(-3.0) + 2.0], abs=1e-6) and grad[0] != 0.0


def test_output_clamp_bounds_the_estimate_both_ways():
    # log rho = 3: k3 = e^3 - 4 = 16.1 -> 1; k1 = -3 -> -1; no gradient where the clamp binds.
    got, grad = _kl([-3.0], [0.0], LossSection(kl_output_clamp_value=1.0))
    assert got == pytest.approx([1.0]) and grad == [0.0]
    got, _ = _kl([-3.0], [0.0], LossSection(reference_policy_kl_type="k1", kl_output_clamp_value=1.0))
    assert got == pytest.approx([-1.0])
    # The defaults (20, 10): log rho = 25 is first clamped to 20, then the estimate to 10.
    got, _ = _kl([-25.0], [0.0], LossSection())
    assert got == pytest.approx([10.0])
    assert LossSection().kl_input_clamp_value == 20.0 and LossSection().kl_output_clamp_value == 10.0


def test_a_weight_keeps_its_gradient_except_where_the_input_clamp_binds():
    # weight exp(lp - sg(lp)) = 1: d(w k3)/dlp = k3 + 1 - rho = -log rho. Token 0: log rho = 0.5.
    # Token 1: log rho = -3 clamped to -1: both the estimate and the weight lose their gradient.
    cfg = LossSection(kl_input_clamp_value=1.0)
    got, grad = _kl([-1.0, 0.0], [-0.5, -3.0], cfg, weights=lambda lp: torch.exp(lp - lp.detach()))
    assert got == pytest.approx([math.exp(0.5) - 1.5, math.exp(-1.0)], abs=1e-6)
    assert grad == pytest.approx([-0.5, 0.0], abs=1e-6)


def _loss(cfg, curr, ref, gen=None, adv=0.0):
    curr_t = torch.tensor([curr], requires_grad=True)
    gen_t = torch.tensor([gen if gen is not None else curr])
    mask = torch.ones_like(gen_t)
    loss, m = clipped_pg_loss(
        curr_lp=curr_t,
        prev_lp=curr_t.detach(),
        gen_lp=gen_t,
        advantages=torch.tensor([adv]),
        token_mask=mask,
        sample_mask=torch.ones(1),
        cfg=cfg,
        norm=LossNormalizer(float(mask.sum()), 1.0),
        ref_lp=torch.tensor([ref]),
    )
    loss.backward()
    return loss.item(), curr_t.grad[0].tolist(), m


def test_the_loss_adds_beta_times_the_mean_kl_with_its_score_function_gradient():
    # A = 0: the loss is the KL term alone. log rho = (-0.5, 1.0): loss = beta * mean k3, and the
    # gradient per token beta * (-log rho) / 2 (k3's own gradient 1 - rho plus the score term k3).
    cfg = LossSection(reference_policy_kl_penalty=0.5)
    k3 = [math.exp(-0.5) - 0.5, math.e - 2.0]
    loss, grad, m = _loss(cfg, [-1.0, -2.0], [-1.5, -1.0])
    assert loss == pytest.approx(0.5 * sum(k3) / 2, rel=1e-6)
    assert grad == pytest.approx([0.5 * 0.5 / 2, 0.5 * -1.0 / 2], rel=1e-6)
    assert m["kl_penalty_sum"] / m["tokens"] == pytest.approx(sum(k3) / 2, rel=1e-6)  # before beta


def test_on_policy_kl_approximation_weights_each_token_by_pi_over_pi_gen():
    # gen = curr - 0.2: v = e^0.2 on both tokens, and d(v k3)/dlp = v (k3 + 1 - rho) = -v log rho.
    cfg = LossSection(reference_policy_kl_penalty=0.5, use_on_policy_kl_approximation=True)
    v = math.exp(0.2)
    k3 = [math.exp(-0.5) - 0.5, math.e - 2.0]
    loss, grad, m = _loss(cfg, [-1.0, -2.0], [-1.5, -1.0], gen=[-1.2, -2.2])
    assert loss == pytest.approx(0.5 * v * sum(k3) / 2, rel=1e-5)
    assert grad == pytest.approx([0.5 * v * 0.5 / 2, 0.5 * v * -1.0 / 2], rel=1e-5)
    assert m["kl_penalty_sum"] == pytest.approx(v * sum(k3), rel=1e-5)


def test_kl_in_reward_leaves_the_kl_out_of_the_loss():
    cfg = LossSection(reference_policy_kl_penalty=0.5, use_kl_in_reward=True)
    loss, grad, m = _loss(cfg, [-1.0, -2.0], [-1.5, -1.0], adv=1.0)
    assert loss == pytest.approx(-1.0) and grad == pytest.approx([-0.5, -0.5])  # the PG term alone
    assert m["kl_penalty_sum"] == 0.0
