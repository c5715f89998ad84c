"""policy.generation.vllm_cfg: any vLLM engine argument passes through, converted and checked
by vLLM's own command-line types; errors name the key."""

import pytest

from services.generator.vllm_args import RESERVED, engine_kwargs
from shared.config import load
from shared.config_error import ConfigError
from shared.run_config import RunConfig


def kwargs(*overrides: str) -> dict:
    return engine_kwargs(load(RunConfig, None, ["policy.model_name=m", *overrides]))


def passthrough(obj: str) -> str:
    return f"policy.generation.vllm_cfg.vllm_kwargs={obj}"


def test_load_format_is_dummy_only_where_the_first_weights_arrive_by_transfer():
    assert kwargs()["load_format"] == "auto"
    assert kwargs("refit.transport=collective")["load_format"] == "dummy"
    explicit = ["refit.transport=collective", "policy.generation.vllm_cfg.load_format=safetensors"]
    assert kwargs(*explicit)["load_format"] == "safetensors"


def test_engine_arguments_are_converted_by_vllms_types():
    from vllm.config import CompilationConfig

    out = kwargs(
        passthrough(
            '{"moe_backend": "triton", "pipeline_parallel_size": 2, "enable_eplb": true, '
            '"kv_cache_dtype": "fp8", "max_num_scheduled_tokens": "8K", '
            '"compilation_config": {"cudagraph_mode": "NONE"}}'
        )
    )
    assert out["moe_backend"] == "triton" and out["pipeline_parallel_size"] == 2 and out["enable_eplb"] is True
    assert out["max_num_scheduled_tokens"] == 8192  # vLLM's human-readable integers
    assert isinstance(out["compilation_config"], CompilationConfig)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ('{"moe_backend": "tritn"}', "vllm_kwargs.moe_backend: 'tritn' is not one of: "),
        ('{"moe_backen": "triton"}', "vllm_kwargs.moe_backen: not a vLLM engine argument (did you mean moe_backend"),
        ('{"pipeline_parallel_size": "two"}', "vllm_kwargs.pipeline_parallel_size: 'two' is not valid"),
        ('{"enable_eplb": 1}', "vllm_kwargs.enable_eplb: must be true or false"),
        ('{"compilation_config": {"cudagraph_mode": "BOGUS"}}', "vllm_kwargs.compilation_config: "),
        ('{"seed": 3}', "vllm_kwargs.seed: not settable here (set run.seed)"),
        ('{"logprobs_mode": "raw_logprobs"}', "vllm_kwargs.logprobs_mode: not settable here"),
    ],
)
def test_a_bad_engine_argument_is_named(obj, message):
    with pytest.raises(ConfigError) as err:
        kwargs(passthrough(obj))
    assert message in str(err.value)


def test_typed_keys_are_refused_in_the_passthrough_without_vllm():
    with pytest.raises(ConfigError, match=r"vllm_kwargs.dtype: set policy.generation.vllm_cfg.dtype instead"):
        load(RunConfig, None, ["policy.model_name=m", passthrough('{"dtype": "float32"}')])


def test_every_reserved_key_is_a_vllm_argument():
    from services.generator.vllm_args import engine_actions

    assert set(RESERVED) <= set(engine_actions())


def test_devices_per_engine_counts_every_parallel_size():
    cfg = load(
        RunConfig,
        None,
        [
            "policy.model_name=m",
            "policy.generation.vllm_cfg.tensor_parallel_size=4",
            passthrough('{"pipeline_parallel_size": 2, "data_parallel_size": 2}'),
        ],
    )
    assert cfg.policy.generation.vllm_cfg.devices_per_engine() == 16
