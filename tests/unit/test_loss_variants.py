"""The policy-ratio variants of the loss against hand-computed values (loss and gradient with
respect to the current logprobs): GSPO's sequence-level ratios and weights, CISPO, REINFORCE
(``disable_ppo_ratio``) and ``force_on_policy_ratio``; and the config errors for the combinations
that contradict each other."""

import math

import pytest
import torch

from services.trainer.loss import LossNormalizer, clipped_pg_loss
from shared.config import load
from shared.config_error import ConfigError
from shared.run_config import RunConfig
from shared.sections.grpo import LossSection

pytestmark = pytest.mark.unit


def run(cfg, curr, prev, adv, gen=None, mask=None):
    curr_t = torch.tensor(curr, requires_grad=True)
    prev_t = torch.tensor(prev)
    mask_t = torch.ones_like(prev_t) if mask is None else torch.tensor(mask)
    loss, m = clipped_pg_loss(
        curr_lp=curr_t,
        prev_lp=prev_t,
        gen_lp=prev_t if gen is None else torch.tensor(gen),
        advantages=torch.tensor(adv),
        token_mask=mask_t,
        sample_mask=torch.ones(len(curr)),
        cfg=cfg,
        norm=LossNormalizer(float(mask_t.sum()), float(len(curr))),
    )
    loss.backward()
    return loss.item(), curr_t.grad.tolist(), m


def test_gspo_uses_one_clipped_ratio_per_sequence_over_its_valid_tokens():
    cfg = LossSection(sequence_level_importance_ratios=True, token_level_loss=False)
    # Row 0 (A=1): token log-ratios (0.1, -0.2), r = e^-0.05 inside the clip: term -r, gradient
    #   -A r / n on each token (per token, e^0.1 and e^-0.2 would differ).
    # Row 1 (A=1): r = e^0.5 > 1.2: clipped, no gradient.
    # Row 2 (A=-1): the masked token (log-ratio -5) is left out of the mean: r = e^-0.1.
    curr = [[-1.0, -1.2], [-0.5, -0.5], [-1.0, -5.0]]
    prev = [[-1.1, -1.0], [-1.0, -1.0], [-0.9, 0.0]]
    mask = [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]
    r0, r2 = math.exp(-0.05), math.exp(-0.1)
    loss, grad, m = run(cfg, curr, prev, [1.0, 1.0, -1.0], mask=mask)
    assert loss == pytest.approx((-r0 - 1.2 + r2) / 3, rel=1e-5)
    assert grad[0] == pytest.approx([-r0 / 2 / 3] * 2, rel=1e-5)
    assert grad[1] == [0.0, 0.0]
    assert grad[2] == pytest.approx([r2 / 3, 0.0], rel=1e-5)
    assert m["clip_fraction_sum"] == 2.0  # both tokens of the clipped sequence


def test_gspo_importance_weight_is_one_per_sequence_and_truncated_per_sequence():
    # On-policy (r = 1), A = 1, generator log-weights (0.1, 0.2): w = e^0.3 for the whole row
    # (token weights would be e^0.1 and e^0.2); tis at 1.2 clamps it to 1.2.
    curr = prev = [[-1.0, -1.0]]
    gen = [[-1.1, -1.2]]
    seq = dict(sequence_level_importance_ratios=True, token_level_loss=False)
    loss, _, _ = run(LossSection(**seq, truncated_importance_sampling_ratio=None), curr, prev, [1.0], gen=gen)
    assert loss == pytest.approx(-math.exp(0.3), rel=1e-5)
    loss, _, m = run(LossSection(**seq, truncated_importance_sampling_ratio=1.2), curr, prev, [1.0], gen=gen)
    assert loss == pytest.approx(-1.2, rel=1e-5)
    assert m["is_oob_sum"] == 2.0


def test_cispo_weights_the_logprob_gradient_by_the_detached_clipped_ratio():
    # r = (e^0.5 -> 1.2, 1, e^-0.5 -> 0.8), A = 1: term -A sg(clip r) logp, gradient -A clip(r) / 3.
    # Token 0 is past the trust region: PPO would give it no gradient, CISPO still does.
    cfg = LossSection(use_cispo=True)
    curr, prev = [[-0.5, -1.0, -2.0]], [[-1.0, -1.0, -1.5]]
    loss, grad, m = run(cfg, curr, prev, [1.0])
    assert loss == pytest.approx((1.2 * 0.5 + 1.0 + 0.8 * 2.0) / 3, rel=1e-5)
    assert grad[0] == pytest.approx([-1.2 / 3, -1.0 / 3, -0.8 / 3], rel=1e-5)
    assert m["clip_fraction_sum"] == 2.0
    _, ppo_grad, _ = run(LossSection(), curr, prev, [1.0])
    assert ppo_grad[0][0] == 0.0


def test_cispo_with_a_negative_advantage():
    # A = -2, r = e^-0.5 clipped to 0.8: term 2 * 0.8 * logp, gradient 1.6.
    loss, grad, _ = run(LossSection(use_cispo=True), [[-2.0]], [[-1.5]], [-2.0])
    assert loss == pytest.approx(2.0 * 0.8 * -2.0, rel=1e-5)
    assert grad[0] == pytest.approx([1.6], rel=1e-5)


def test_disable_ppo_ratio_is_reinforce_on_the_logprob():
    # -A logp whatever the old policy (prev far away would clip a PPO ratio), gradient -A / n.
    loss, grad, m = run(LossSection(disable_ppo_ratio=True), [[-0.5, -2.0]], [[-3.0, -0.1]], [1.5])
    assert loss == pytest.approx(1.5 * 2.5 / 2, rel=1e-6)
    assert grad[0] == pytest.approx([-0.75, -0.75], rel=1e-6)
    assert m["clip_fraction_sum"] == 0.0


def test_force_on_policy_ratio_is_one_with_its_gradient_and_the_old_policy_is_the_current():
    # r = 1 with dr/dlogp = 1, so the term is -A w and the gradient -A w / n; the old logprobs
    # given are ignored (the current ones stand in), so w = exp(logp - logp_gen) = (e^0.2, 1).
    cfg = LossSection(force_on_policy_ratio=True)
    w = [math.exp(0.2), 1.0]
    loss, grad, m = run(cfg, [[-0.5, -2.0]], [[-3.0, -0.1]], [1.5], gen=[[-0.7, -2.0]])
    assert loss == pytest.approx(-1.5 * sum(w) / 2, rel=1e-5)
    assert grad[0] == pytest.approx([-1.5 * w[0] / 2, -1.5 * w[1] / 2], rel=1e-5)
    assert m["sampling_importance_ratio_sum"] == pytest.approx(sum(w), rel=1e-5)


BASE = ["policy.model_name=m", "data.train_path=t.jsonl"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["loss_fn.use_cispo=true", "loss_fn.disable_ppo_ratio=true"],
            "loss_fn.use_cispo and loss_fn.disable_ppo_ratio",
        ),
        (["loss_fn.use_cispo=true", "loss_fn.force_on_policy_ratio=true"], "loss_fn.use_cispo and loss_fn.force_on_p"),
        (
            [
                "loss_fn.use_cispo=true",
                "loss_fn.sequence_level_importance_ratios=true",
                "loss_fn.token_level_loss=false",
            ],
            "loss_fn.use_cispo and loss_fn.sequence_level_importance_ratios",
        ),
        (["loss_fn.use_cispo=true", "loss_fn.ratio_clip_c=3.0"], "loss_fn.ratio_clip_c"),
        (
            ["loss_fn.force_on_policy_ratio=true", "loss_fn.disable_ppo_ratio=true"],
            "loss_fn.force_on_policy_ratio and loss_fn.disable_ppo_ratio",
        ),
        (["loss_fn.sequence_level_importance_ratios=true"], "loss_fn.token_level_loss: false"),
        (
            [
                "loss_fn.sequence_level_importance_ratios=true",
                "loss_fn.token_level_loss=false",
                "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
                "loss_fn.truncated_importance_sampling_ratio_min=0.5",
            ],
            "seq-mask-tis cannot be combined with loss_fn.sequence_level_importance_ratios",
        ),
        (
            ["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=64"],
            "policy.train_global_batch_size",
        ),
        (["loss_fn.use_kl_in_reward=true"], "loss_fn.reference_policy_kl_penalty > 0"),
        (["loss_fn.reference_policy_kl_penalty=-0.1"], "loss_fn.reference_policy_kl_penalty must be >= 0"),
        (["loss_fn.kl_input_clamp_value=0"], "loss_fn.kl_input_clamp_value"),
        (["loss_fn.kl_output_clamp_value=-1"], "loss_fn.kl_output_clamp_value"),
        (["loss_fn.reference_policy_kl_type=k4"], "reference_policy_kl_type"),
    ],
)
def test_contradicting_loss_options_fail_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(RunConfig, None, BASE + overrides, env={})


def test_each_variant_loads_on_its_own():
    for overrides in (
        ["loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false"],
        ["loss_fn.use_cispo=true", "loss_fn.ratio_clip_min=1.0", "loss_fn.ratio_clip_max=4.0"],
        ["loss_fn.disable_ppo_ratio=true"],
        ["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=512"],  # 32 x 16 rows: one update
        ["loss_fn.reference_policy_kl_penalty=0.01", "loss_fn.use_kl_in_reward=true"],
        [
            "loss_fn.reference_policy_kl_type=k1",
            "loss_fn.kl_input_clamp_value=null",
            "loss_fn.kl_output_clamp_value=null",
        ],
    ):
        assert load(RunConfig, None, BASE + overrides, env={})
