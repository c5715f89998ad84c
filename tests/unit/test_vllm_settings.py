"""What the vLLM engine settles for a model and platform (`services.generator.vllm_settings`):
dtype, prefix caching and chunked prefill for recurrent-state (hybrid) models, on CPU and GPUs;
configured values kept, impossible ones refused naming the key."""

import pytest

from services.generator.vllm_settings import ModelFacts, settle
from shared.config_error import ConfigError
from shared.sections.generator import VllmSection

pytestmark = pytest.mark.unit

QWEN3_5 = ModelFacts(name="q35", recurrent=True, gated_deltanet=True, dtype="bfloat16", prefix_caching_default=True)
DENSE = ModelFacts(name="dense", recurrent=False, gated_deltanet=False, dtype="float32", prefix_caching_default=True)


def settled(facts: ModelFacts = QWEN3_5, *, on_cpu: bool = True, **configured):
    return settle(VllmSection(**configured), facts, on_cpu=on_cpu)


def test_a_hybrid_model_on_cpu_keeps_seeds_unless_prefix_caching_is_asked_for():
    s = settled()
    assert (s.dtype, s.enable_prefix_caching, s.enable_chunked_prefill) == ("bfloat16", False, False)
    assert any("prefix caching off" in note and "seeds" in note for note in s.notes)
    asked = settled(enable_prefix_caching=True)  # vLLM needs chunked prefill for it
    assert (asked.enable_prefix_caching, asked.enable_chunked_prefill) == (True, True)
    assert settled(enable_chunked_prefill=True).enable_prefix_caching is None  # vLLM's default (on)


def test_a_hybrid_model_on_gpus_keeps_vllms_defaults():
    s = settled(on_cpu=False)
    assert (s.dtype, s.enable_prefix_caching, s.enable_chunked_prefill, s.notes) == ("auto", None, None, ())
    off = settled(on_cpu=False, enable_chunked_prefill=False)  # no chunked prefill: no prefix cache either
    assert (off.enable_prefix_caching, off.enable_chunked_prefill) == (False, False)


def test_prefix_caching_without_chunked_prefill_is_refused_for_a_hybrid_model():
    for on_cpu in (True, False):
        with pytest.raises(ConfigError, match=r"enable_prefix_caching: .*enable_chunked_prefill"):
            settled(on_cpu=on_cpu, enable_prefix_caching=True, enable_chunked_prefill=False)


def test_gated_deltanet_on_cpu_runs_in_bfloat16_chosen_for_auto_refused_otherwise():
    assert settled(dtype="bfloat16").dtype == "bfloat16"
    float32 = ModelFacts(**{**QWEN3_5.__dict__, "dtype": "float32"})  # what vLLM resolves float32 to
    with pytest.raises(ConfigError, match=r"policy\.generation\.vllm_cfg\.dtype: 'float32' .* set it to bfloat16"):
        settled(float32, dtype="float32")
    assert settled(float32, on_cpu=False, dtype="float32").dtype == "float32"  # GPUs run it


def test_an_attention_only_model_is_as_configured():
    s = settled(DENSE, dtype="float32", enable_prefix_caching=True)
    assert (s.dtype, s.enable_prefix_caching, s.enable_chunked_prefill, s.notes) == ("float32", True, False, ())
    gpu = settled(DENSE, on_cpu=False, enable_prefix_caching=True, enable_chunked_prefill=False)
    assert (gpu.enable_prefix_caching, gpu.enable_chunked_prefill) == (True, False)


MOE = ModelFacts(
    name="moe", recurrent=True, gated_deltanet=True, dtype="bfloat16", prefix_caching_default=True, moe=True
)


def test_routing_replay_turns_prefix_caching_on_and_is_refused_where_vllm_cannot_return_routes():
    s = settle(VllmSection(), MOE, on_cpu=False, replay_routes=True)
    assert s.return_routes and (s.enable_prefix_caching, s.enable_chunked_prefill) == (True, True)
    assert any("routed experts" in note for note in s.notes)
    with pytest.raises(ConfigError, match="Model Runner V2.*backend: transformers"):
        settle(VllmSection(), MOE, on_cpu=True, replay_routes=True)
    with pytest.raises(ConfigError, match="no routed experts"):
        settle(VllmSection(), DENSE, on_cpu=False, replay_routes=True)
    with pytest.raises(ConfigError, match=r"enable_prefix_caching: false.*moe_routing_replay"):
        settle(VllmSection(enable_prefix_caching=False), MOE, on_cpu=False, replay_routes=True)
    assert not settle(VllmSection(), MOE, on_cpu=False).return_routes


def test_a_vllm_completion_s_routed_experts_become_the_choice_s_routes():
    from types import SimpleNamespace

    import numpy as np

    from services.generator.vllm_engine import _choice
    from shared.routes import RouteShape

    shape = RouteShape(layers=4, top_k=2, num_experts=8)
    lp = {5: SimpleNamespace(logprob=-0.5, rank=1)}
    done = SimpleNamespace(index=0, token_ids=[5], logprobs=[lp], finish_reason="stop", stop_reason=None)
    routed = np.arange(3 * 4 * 2).reshape(3, 4, 2) % 8
    c = _choice(SimpleNamespace(**done.__dict__, routed_experts=routed), 0, 7, shape)
    assert c.routes_start == 7 and np.array_equal(c.routes, routed)
    assert _choice(SimpleNamespace(**done.__dict__, routed_experts=None), 0, 7, shape).routes is None  # preempted
    assert _choice(SimpleNamespace(**done.__dict__, routed_experts=routed[:, :3]), 0, 7, shape).routes is None
    assert _choice(SimpleNamespace(**done.__dict__, routed_experts=routed), 0).routes is None  # not asked
