"""The transformers engine samples from the same processed distribution as vLLM: its top-p mask
equals vLLM's on the same logits, and its logprobs are log softmax of the masked, scaled logits."""

import pytest

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_mask_matches_vllm(top_p):
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    from services.generator.hf_engine import _top_p_mask

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 900, generator=gen) * 3
    ours = _top_p_mask(logits.clone(), top_p)
    theirs = topk_topp.apply_top_k_top_p_pytorch(logits.clone(), None, torch.full((4,), top_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert 0 < int(torch.isinf(ours).sum()) < ours.numel()


def test_sampled_logprobs_are_under_the_processed_distribution():
    from services.generator.hf_engine import _sample

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = _sample(logits, 0.5, 0.8, torch.Generator().manual_seed(2))
    kept = ~torch.isinf(logprobs)
    assert kept[torch.arange(2), tokens].all()  # never samples a masked token
    expected = torch.log_softmax((logits / 0.5).masked_fill(~kept, float("-inf")), dim=-1)
    assert torch.allclose(logprobs[kept], expected[kept])
    assert torch.allclose(logprobs.exp().sum(-1), torch.ones(2))
    greedy_tokens, greedy_lp = _sample(logits, 0.0, 1.0, None)
    assert torch.equal(greedy_tokens, logits.argmax(-1))
    assert torch.allclose(greedy_lp, torch.log_softmax(logits, -1))
