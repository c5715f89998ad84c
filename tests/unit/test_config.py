"""Config loading: strict keys, dotted overrides, environment, cross-field checks, shipped files."""

from pathlib import Path

import pytest

from shared.config import ConfigError, load
from shared.run_config import RunConfig, explain

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ["policy.model_name=m", "data.train_path=t.jsonl"]


def test_unknown_key_names_the_full_path():
    with pytest.raises(ConfigError, match="unknown config key 'grpo.async_grpo.max_trajectory_age'"):
        load(RunConfig, None, REQUIRED + ["grpo.async_grpo.max_trajectory_age=2"])


def test_unknown_key_in_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("policy:\n  model_name: m\n  generaton:\n    temperature: 1.0\n")
    with pytest.raises(ConfigError, match="unknown config key 'policy.generaton'"):
        load(RunConfig, f)


def test_type_error_names_key():
    with pytest.raises(ConfigError, match="grpo.num_prompts_per_step.*Expected `int`"):
        load(RunConfig, None, REQUIRED + ["grpo.num_prompts_per_step=many"])


def test_overrides_beat_file_and_env_sets_redis_url(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("policy:\n  model_name: m\ndata:\n  train_path: x\ngrpo:\n  num_prompts_per_step: 4\n")
    cfg = load(RunConfig, f, ["grpo.num_prompts_per_step=8"], env={"REDIS_URL": "redis://example:6379/0"})
    assert cfg.grpo.num_prompts_per_step == 8
    assert cfg.redis.url == "redis://example:6379/0"
    assert cfg.grpo.async_grpo.max_trajectory_age_steps == 1


def test_async_requires_importance_sampling_correction():
    with pytest.raises(ConfigError, match="loss_fn.use_importance_sampling_correction"):
        load(RunConfig, None, REQUIRED + ["loss_fn.use_importance_sampling_correction=false"])
    cfg = load(RunConfig, None, REQUIRED + ["loss_fn.use_importance_sampling_correction=false",
                                            "grpo.async_grpo.max_trajectory_age_steps=0"])
    assert not cfg.loss_fn.use_importance_sampling_correction


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(RunConfig, tmp_path / "nope.yaml")


def test_every_field_is_documented():
    undocumented = [key for key, _, desc in explain() if not desc]
    assert undocumented == []


# Every run config under deploy/configs, recipes included (kustomization.yaml files there only turn
# run configs into Kubernetes ConfigMaps).
SHIPPED = sorted(p for p in (ROOT / "deploy" / "configs").rglob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT / "deploy" / "configs")))
def test_every_shipped_config_loads(path):
    cfg = load(RunConfig, path, env={})
    assert cfg.grpo.num_generations_per_prompt >= 2


def test_backfill_comes_from_the_policy_or_nemo_rls_flag():
    from shared.run_config import EnvSection, NemoGymSection, backfills_failures

    assert not backfills_failures(EnvSection())
    assert not backfills_failures(EnvSection(failure_policy="retry"))
    assert backfills_failures(EnvSection(failure_policy="backfill"))
    assert backfills_failures(EnvSection(nemo_gym=NemoGymSection(backfill_failed_rollouts=True)))
