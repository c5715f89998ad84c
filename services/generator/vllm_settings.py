"""The vLLM engine settings that depend on the model and the platform: dtype, prefix caching and
chunked prefill. Called as `services.generator.vllm_engine.VllmEngine` starts, with what vLLM's own
model config reports (`model_facts`), before any engine process starts; each choice made for the
model is logged.

Models with recurrent-state layers (vLLM's ``is_hybrid``: Gated DeltaNet or Mamba layers beside
attention, as in Qwen3.5 and Qwen3-Next; or attention-free Mamba models) differ from attention-only
models in two ways that matter here:

* **Prefix caching needs chunked prefill.** vLLM caches such a model's recurrent state only at
  block boundaries (its mamba cache mode ``align``, which it selects whenever prefix caching is on)
  and asserts that chunked prefill is on, because it prefills a long prompt in chunks that end on
  those boundaries. On CPU a seeded request prefilled in chunks kills the engine ("CPU Generator
  does not use offset" when vLLM rewinds the sampler), so with chunked prefill on the engine has
  to ignore per-request seeds. Measured with the tiny Qwen3.5-MoE on vLLM 0.32 (CPU): with prefix
  caching and chunked prefill on, a seeded 12-token prompt samples the same twice, a seeded
  400-token prompt (block size 256) kills the engine even with a token budget larger than the
  prompt. So on CPU, unless prefix caching (or chunked prefill) is asked for, it is off for these
  models and seeds are kept (same seed, same samples, as the engine contract requires); asked
  for, chunked prefill is on with it and seeds are ignored (`VllmEngine` logs it). On GPUs vLLM's
  defaults stand (prefix caching and chunked prefill on). Prefix caching asked for with chunked
  prefill turned off is refused, naming both keys.
* **On CPU, Gated DeltaNet layers run in bfloat16 only** (vLLM's CPU kernels assert it). With
  ``dtype: auto`` (the default) such a model runs in bfloat16 on CPU; any other configured dtype
  that is not bfloat16 is refused with the key to change.

Attention-only models are unchanged: chunked prefill off by default on CPU, everything else as
configured or vLLM's default.

**MoE routing replay** (``policy.moe_routing_replay``): vLLM returns the experts every token was
routed to (``enable_return_routed_experts``) only for an MoE model, only with prefix caching on
(it keeps a cached prefix's routes with its blocks) and only with its Model Runner V2, which needs
Triton: not on CPU, where the transformers engine returns routes instead. So with replay on,
prefix caching is on (turned on when unset, refused when configured off) and a CPU platform or a
model without experts is refused at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from shared.config_error import ConfigError
from shared.sections.generator import VllmSection

_WHERE = "policy.generation.vllm_cfg"
# What vLLM's CPU Gated DeltaNet kernels run in (vllm/model_executor/layers/mamba/ops/cpu).
CPU_GATED_DELTANET_DTYPE = "bfloat16"


@dataclass(frozen=True)
class ModelFacts:
    """What vLLM's model config says about the model, as far as the settings depend on it."""

    name: str
    recurrent: bool  # layers with recurrent state (vLLM: is_hybrid, or attention-free)
    gated_deltanet: bool  # some layers are Gated DeltaNet (``layer_types`` lists linear_attention)
    dtype: str  # the configured dtype as vLLM resolves it for this model ("bfloat16", "float32", ...)
    prefix_caching_default: bool  # vLLM's default for this model
    moe: bool = False  # routed experts (vLLM: is_moe)


@dataclass(frozen=True)
class EngineSettings:
    dtype: str
    enable_prefix_caching: bool | None  # None: vLLM's default
    enable_chunked_prefill: bool | None
    notes: tuple[str, ...] = ()  # one log line per setting chosen for the model
    return_routes: bool = False  # enable_return_routed_experts (policy.moe_routing_replay)


def model_facts(model_config: Any) -> ModelFacts:
    """`ModelFacts` from a vLLM ``ModelConfig`` (``AsyncEngineArgs.create_model_config()``)."""
    layer_types = getattr(model_config.hf_text_config, "layer_types", None) or ()
    return ModelFacts(
        name=str(model_config.model),
        recurrent=bool(model_config.is_hybrid or model_config.is_attention_free),
        gated_deltanet="linear_attention" in layer_types,
        dtype=str(model_config.dtype).removeprefix("torch."),
        prefix_caching_default=bool(model_config.is_prefix_caching_supported),
        moe=bool(getattr(model_config, "is_moe", False)),
    )


def settle(v: VllmSection, facts: ModelFacts, *, on_cpu: bool, replay_routes: bool = False) -> EngineSettings:
    """The engine's dtype, prefix caching and chunked prefill for ``facts``' model (and whether it
    returns routes); ConfigError for a configured combination the model cannot run, naming the key."""
    notes: list[str] = []
    if replay_routes:
        v = _for_routes(v, facts, on_cpu, notes)
    dtype = v.dtype
    if on_cpu and facts.gated_deltanet:
        if v.dtype == "auto":
            dtype = CPU_GATED_DELTANET_DTYPE
            notes.append(f"{facts.name} has Gated DeltaNet layers: dtype {dtype} on CPU (vLLM's CPU kernels)")
        elif facts.dtype != CPU_GATED_DELTANET_DTYPE:
            raise ConfigError(
                f"{_WHERE}.dtype: {v.dtype!r} cannot run the Gated DeltaNet layers of {facts.name} on CPU "
                f"(vLLM's CPU kernels take {CPU_GATED_DELTANET_DTYPE} only): set it to {CPU_GATED_DELTANET_DTYPE} "
                "(or auto)"
            )
    prefix_caching, chunked_prefill = v.enable_prefix_caching, v.enable_chunked_prefill
    if facts.recurrent:
        if prefix_caching and chunked_prefill is False:
            raise ConfigError(
                f"{_WHERE}.enable_prefix_caching: vLLM caches the prefix of {facts.name} (recurrent-state layers) "
                "only with chunked prefill: set enable_chunked_prefill to true (or null), or enable_prefix_caching "
                "to false"
            )
        # Chunked prefill off as configured, or by default on CPU: no prefix cache either.
        no_chunks = chunked_prefill is False or (on_cpu and chunked_prefill is None)
        if prefix_caching is None and facts.prefix_caching_default and no_chunks:
            prefix_caching = False
            why = (
                "which on CPU would ignore per-request seeds (set enable_prefix_caching: true to trade them for it)"
                if on_cpu and chunked_prefill is None
                else "which is off"
            )
            notes.append(
                f"prefix caching off for {facts.name}: vLLM caches a recurrent-state model's prefix only with "
                f"chunked prefill, {why}"
            )
        if prefix_caching and chunked_prefill is None:
            chunked_prefill = True
            notes.append(f"chunked prefill on for {facts.name}: vLLM caches its prefix only with it")
    if on_cpu and chunked_prefill is None:
        # On CPU a seeded request whose prompt is prefilled in chunks kills the engine.
        chunked_prefill = False
    return EngineSettings(
        dtype=dtype,
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked_prefill,
        notes=tuple(notes),
        return_routes=replay_routes,
    )


def _for_routes(v: VllmSection, facts: ModelFacts, on_cpu: bool, notes: list[str]) -> VllmSection:
    """``v`` as routing replay needs it: prefix caching on; the refusals of the module's docstring."""
    if on_cpu:
        raise ConfigError(
            "policy.moe_routing_replay: vLLM returns routed experts only with its Model Runner V2, which needs "
            "Triton (GPUs); on CPU the transformers engine (policy.generation.backend: transformers) returns them"
        )
    if not facts.moe:
        raise ConfigError(f"policy.moe_routing_replay: {facts.name} has no routed experts")
    if v.enable_prefix_caching is False:
        raise ConfigError(
            f"{_WHERE}.enable_prefix_caching: false, but vLLM returns routed experts (policy.moe_routing_replay) "
            "only with prefix caching on"
        )
    if v.enable_prefix_caching is None:
        notes.append(f"prefix caching on for {facts.name}: vLLM returns routed experts only with it")
    return msgspec.structs.replace(v, enable_prefix_caching=True)
