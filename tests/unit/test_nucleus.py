"""vLLM's top-p rule, as the transformers engine samples with it and the trainer scores with it."""

import math

import pytest
import torch

from shared.nucleus import top_p_mask

pytestmark = pytest.mark.unit


def test_the_nucleus_follows_vllms_ascending_rule():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # ascending cumulative mass: 0.05, 0.20, 0.50, 1.00; dropped where <= 1 - top_p
    kept = top_p_mask(logits, 0.8).isfinite().tolist()
    assert kept == [True, True, False, False]  # 0.20 <= 0.2 drops the third token too
    assert top_p_mask(logits, 0.9).isfinite().tolist() == [True, True, True, False]
    assert top_p_mask(logits, 1.0) is logits
    assert top_p_mask(logits, 0.01).isfinite().tolist() == [True, False, False, False]  # the top token stays


def test_a_sampled_token_stays_in_and_gradients_flow_to_the_kept_logits():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().requires_grad_()
    masked = top_p_mask(logits, 0.8, keep=torch.tensor([3]))
    assert masked.isfinite().tolist() == [[True, True, False, True]]
    lp = torch.log_softmax(masked, dim=-1)[0, 3]
    assert float(lp.detach()) == pytest.approx(math.log(0.05 / 0.85), rel=1e-5)
    lp.backward()
    assert logits.grad is not None and float(logits.grad[0, 2]) == 0.0 and float(logits.grad[0, 0]) != 0.0
