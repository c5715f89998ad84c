"""Clipped PG loss with importance-sampling correction."""

import math

import pytest
import torch

from services.trainer.loss import LossNormalizer, clipped_pg_loss, divergence_sums, ratio_sums
from shared.sections.grpo import LossSection

pytestmark = pytest.mark.unit


def run(curr, prev, gen, adv, mask=None, smask=None, cfg=None, norm=None):
    curr = torch.tensor(curr, dtype=torch.float32, requires_grad=True)
    prev = torch.tensor(prev, dtype=torch.float32)
    gen = torch.tensor(gen, dtype=torch.float32)
    mask = torch.ones_like(prev) if mask is None else torch.tensor(mask, dtype=torch.float32)
    smask = torch.ones(prev.shape[0]) if smask is None else torch.tensor(smask, dtype=torch.float32)
    norm = norm or LossNormalizer(float((mask * smask[:, None]).sum()), float(smask.sum()))
    loss, m = clipped_pg_loss(
        curr_lp=curr,
        prev_lp=prev,
        gen_lp=gen,
        advantages=torch.tensor(adv, dtype=torch.float32),
        token_mask=mask,
        sample_mask=smask,
        cfg=cfg or LossSection(),
        norm=norm,
    )
    loss.backward()
    return loss, curr.grad, m


def test_on_policy_loss_is_minus_mean_advantage_and_pushes_logprob_up_for_positive_advantage():
    lp = [[-1.0, -2.0]]
    loss, grad, m = run(lp, lp, lp, [2.0])
    assert loss.item() == pytest.approx(-2.0)
    assert (grad < 0).all()  # descending the loss raises logp of positively advantaged tokens
    assert m["token_mult_prob_error_sum"] / m["tokens"] == pytest.approx(1.0)


def test_importance_weight_scales_tokens_and_is_truncated():
    cfg = LossSection(truncated_importance_sampling_ratio=2.0)
    # w = exp(prev - gen): token 0 -> e^0.5 = 1.65, token 1 -> e^3 clipped to 2.0
    loss, _, m = run([[-1.0, -1.0]], [[-1.0, -1.0]], [[-1.5, -4.0]], [1.0], cfg=cfg)
    assert loss.item() == pytest.approx(-(math.exp(0.5) + 2.0) / 2, rel=1e-5)
    assert m["is_oob_sum"] == 1.0


def test_icepop_drops_out_of_bound_tokens():
    cfg = LossSection(
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=2.0,
        truncated_importance_sampling_ratio_min=0.5,
    )
    loss, grad, _ = run([[-1.0, -1.0]], [[-1.0, -1.0]], [[-1.1, -4.0]], [1.0], cfg=cfg)
    assert grad[0, 1].item() == 0.0 and grad[0, 0].item() != 0.0


def test_ratio_clipping_stops_gradient_past_the_trust_region():
    # curr moved far above old with A > 0: clipped, no gradient
    _, grad, m = run([[-0.1]], [[-1.0]], [[-1.0]], [1.0])
    assert grad.abs().sum().item() == 0.0
    assert m["clip_fraction_sum"] == 1.0


def test_dual_clip_caps_negative_advantage_terms():
    cfg = LossSection(ratio_clip_c=3.0)
    # ratio = e^2 = 7.4 > c with A = -1: term capped at c * |A| = 3
    loss, grad, _ = run([[1.0]], [[-1.0]], [[-1.0]], [-1.0], cfg=cfg)
    assert loss.item() == pytest.approx(3.0)
    assert grad.abs().sum().item() == 0.0


def test_masked_tokens_and_samples_contribute_nothing():
    _, grad, m = run(
        [[-1.0, -1.0], [-1.0, -1.0]],
        [[-1.0, -1.0]] * 2,
        [[-1.0, -1.0]] * 2,
        [1.0, 1.0],
        mask=[[1, 0], [1, 1]],
        smask=[1, 0],
    )
    assert grad[0, 1].item() == 0.0 and grad[1].abs().sum().item() == 0.0 and grad[0, 0].item() != 0.0
    assert m["tokens"] == 1.0


def test_token_level_normalisation_is_global_across_micro_batches():
    cfg = LossSection()
    curr = [[-1.0, -2.0], [-0.5, -0.7]]
    adv = [1.0, -2.0]
    full, _, _ = run(curr, curr, curr, adv, cfg=cfg)
    norm = LossNormalizer(valid_tokens=4.0, valid_sequences=2.0)
    a, _, _ = run(curr[:1], curr[:1], curr[:1], adv[:1], cfg=cfg, norm=norm)
    b, _, _ = run(curr[1:], curr[1:], curr[1:], adv[1:], cfg=cfg, norm=norm)
    assert (a + b).item() == pytest.approx(full.item())


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    from services.trainer.step_plan import lr_schedule
    from shared.sections.policy import OptimizerSection

    f = lr_schedule(OptimizerSection(scheduler="cosine", warmup_steps=2, min_lr_ratio=0.1), total_updates=12)
    assert [round(f(n), 3) for n in (0, 1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(7) == pytest.approx(0.55) and f(12) == pytest.approx(0.1)
    lin = lr_schedule(OptimizerSection(scheduler="linear"), total_updates=10)
    assert lin(5) == pytest.approx(0.5)
    assert lr_schedule(OptimizerSection(), total_updates=10)(9) == 1.0


def test_seq_mask_tis_drops_whole_sequences_by_their_geometric_mean_weight():
    cfg = LossSection(
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=2.0,
        truncated_importance_sampling_ratio_min=0.5,
    )
    # Row 0: log w = (+0.1, -0.1) -> geometric mean 1, kept with its raw token weights.
    # Row 1: log w = (+2, +0.2) -> geometric mean e^1.1 = 3.0 > 2: the whole row is dropped, even
    # its in-bounds token. Row 2: one token at e^2 but a masked second token: mean over valid only.
    curr = prev = [[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]]
    gen = [[-1.1, -0.9], [-3.0, -1.2], [-3.0, -9.0]]
    mask = [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]
    loss, grad, m = run(curr, prev, gen, [1.0, 1.0, 1.0], mask=mask, cfg=cfg)
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.1)) / 5, rel=1e-5)
    assert grad[1].abs().sum() == 0 and grad[2].abs().sum() == 0 and (grad[0] != 0).all()
    assert m["is_oob_sum"] == 3.0  # the tokens of the two dropped sequences


def test_seq_mask_tis_needs_a_lower_bound():
    from shared.config import load
    from shared.config_error import ConfigError
    from shared.run_config import RunConfig

    base = ["policy.model_name=m", "data.train_path=t.jsonl", "loss_fn.truncated_importance_sampling_type=seq-mask-tis"]
    with pytest.raises(ConfigError, match="truncated_importance_sampling_ratio_min"):
        load(RunConfig, None, base, env={})
    assert load(RunConfig, None, base + ["loss_fn.truncated_importance_sampling_ratio_min=0.5"], env={})


def _pair(seed: int, vocab: int = 12, spread: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Two nearby categorical distributions over ``vocab`` tokens, as log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(vocab, generator=g, dtype=torch.float64)
    return torch.log_softmax(base, -1), torch.log_softmax(
        base + spread * torch.randn(vocab, generator=g, dtype=torch.float64), -1
    )


def test_the_divergences_are_their_definitions_in_expectation_over_the_generators_samples():
    """Every token of the vocabulary scored once, weighted by its probability under the generator
    (the expectation the per-token estimates are averaged towards): the importance-weighted
    entropy is the policy's entropy exactly, the Jensen-Shannon and reverse-KL estimates agree
    with their closed forms to second order in the distance, and all three vanish when trainer
    and generator agree."""
    for seed in range(3):
        p, q = _pair(seed, spread=0.03)  # trainer (prev and current), generator
        weights = q.exp()[None, :]  # one row, every token, each weighted by q
        sums = divergence_sums(p[None, :], p[None, :], q[None, :], weights)
        entropy = float(-(p.exp() * p).sum())
        assert sums["approx_entropy_sum"] == pytest.approx(entropy, rel=1e-9)
        m = torch.logaddexp(p, q) - math.log(2.0)
        js = float(0.5 * (p.exp() * (p - m)).sum() + 0.5 * (q.exp() * (q - m)).sum())
        assert sums["js_divergence_error_sum"] == pytest.approx(js, rel=0.1)
        reverse = float((p.exp() * (p - q)).sum())  # KL(P_train || P_gen)
        assert sums["policy_kl_error_sum"] == pytest.approx(reverse, rel=0.1)
        same = divergence_sums(q[None, :], q[None, :], q[None, :], weights)
        assert same["policy_kl_error_sum"] == pytest.approx(0.0, abs=1e-12)
        assert same["js_divergence_error_sum"] == pytest.approx(0.0, abs=1e-12)


def test_probs_ratio_extremes_are_over_the_loss_tokens_only():
    ratio = torch.tensor([[0.5, 1.0, 9.0], [1.5, 1.2, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    sums = ratio_sums(ratio, ratio.clamp(0.8, 1.2), mask)
    assert (sums["min_probs_ratio"], sums["max_probs_ratio"]) == (0.5, 1.5)
    assert sums["probs_ratio_sum"] == pytest.approx(3.0) and sums["probs_ratio_clamped_sum"] == pytest.approx(3.0)
    assert "min_probs_ratio" not in ratio_sums(ratio, ratio, torch.zeros_like(mask))
