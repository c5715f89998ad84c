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
