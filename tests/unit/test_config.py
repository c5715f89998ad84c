"""Config loading: strict keys, dotted overrides, environment, cross-field checks, shipped files."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.config import load
from shared.config_error import ConfigError
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


@pytest.mark.parametrize(
    "key, unknown, nearest",
    [
        # a typo: the closest sibling
        ("trainer.colective_timeout_s", "trainer.colective_timeout_s", "trainer.collective_timeout_s"),
        ("grop.max_num_steps", "grop", "grpo"),
        ("policy.generaton.top_p", "policy.generaton", "policy.generation"),
        # the right name in the wrong section, or a section left out
        ("grpo.ratio_clip_min", "grpo.ratio_clip_min", "loss_fn.ratio_clip_min"),
        ("generator.max_new_tokens", "generator.max_new_tokens", "policy.generation.max_new_tokens"),
        ("policy.lr", "policy.lr", "policy.optimizer.lr"),
        ("vllm_cfg.max_model_len", "vllm_cfg", "policy.generation.vllm_cfg"),
    ],
)
def test_unknown_key_names_the_nearest_known_key(tmp_path, key, unknown, nearest):
    expected = "^" + re.escape(f"unknown config key '{unknown}' (did you mean '{nearest}'?)") + "$"
    with pytest.raises(ConfigError, match=expected):  # as a dotted override
        load(RunConfig, None, [*REQUIRED, f"{key}=1"], env={})
    tree: object = 1
    for part in reversed(key.split(".")):
        tree = {part: tree}
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=expected):  # in a file
        load(RunConfig, f, REQUIRED, env={})


@pytest.mark.parametrize("key", ["trainer.no_such_key", "loss_fn.kl_penalty", "foo"])
def test_an_unknown_key_close_to_none_gets_no_guess(key):
    with pytest.raises(ConfigError, match=rf"^unknown config key '{key}'$"):
        load(RunConfig, None, REQUIRED + [f"{key}=1"], env={})


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
    cfg = load(
        RunConfig,
        None,
        REQUIRED + ["loss_fn.use_importance_sampling_correction=false", "grpo.async_grpo.max_trajectory_age_steps=0"],
    )
    assert not cfg.loss_fn.use_importance_sampling_correction


def test_only_the_trainer_requires_the_datasets():
    cfg = load(RunConfig, None, ["policy.model_name=m", "grpo.val_period=5"], env={})  # neither dataset
    cfg.check_service("generator")
    cfg.check_service("gym_gateway")
    no_model = load(RunConfig, None, ["grpo.val_period=5"], env={})
    no_model.check_service("gym_gateway")  # a gateway loads no model
    with pytest.raises(ConfigError, match=r"^policy.model_name is required$"):
        no_model.check_service("generator")
    with pytest.raises(ConfigError, match=r"^data.train_path is required"):
        cfg.check_service("trainer")
    with_train = load(RunConfig, None, REQUIRED + ["grpo.val_period=5"], env={})
    with pytest.raises(ConfigError, match=r"^data.val_path is required when grpo.val_period > 0"):
        with_train.check_service("trainer")
    load(RunConfig, None, REQUIRED, env={}).check_service("trainer")


def test_a_job_and_config_check_require_what_every_service_of_the_run_reads(tmp_path):
    from streamrl.supervisor import Supervisor

    cfg = tmp_path / "run.yaml"
    cfg.write_text("policy:\n  model_name: m\n")  # no dataset: a generator's config, not a run's
    with pytest.raises(ConfigError, match=r"^data.train_path is required"):
        Supervisor(str(cfg), [], progress=False)  # refused before any process starts

    def check(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "streamrl.cli", "config", "check", str(cfg), *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)

    refused = check()
    assert refused.returncode == 2 and "config error: data.train_path is required" in refused.stderr
    assert check("--service", "generator").returncode == 0
    assert check("data.train_path=t.jsonl").returncode == 0


BASE = "policy:\n  model_name: m\ndata:\n  train_path: t.jsonl\n"


def test_streamrl_up_waits_for_its_workers_as_long_as_the_config_says(tmp_path):
    from streamrl.supervisor import Supervisor

    cfg = tmp_path / "run.yaml"
    cfg.write_text(BASE)
    default = Supervisor(str(cfg), [], progress=False)
    assert default.pools["generator"].ready_timeout_s == 600.0
    assert default.pools["gym-gateway"].ready_timeout_s == 120.0
    overrides = ["supervisor.generator_ready_timeout_s=1800", "supervisor.gateway_ready_timeout_s=30"]
    tuned = Supervisor(str(cfg), overrides, progress=False)
    assert tuned.pools["generator"].ready_timeout_s == 1800.0
    assert tuned.pools["gym-gateway"].ready_timeout_s == 30.0


@pytest.mark.parametrize(
    "text, message",
    [
        # YAML syntax: the file, line and column, on one line
        ("policy:\n  model_name: m\n data: [\n", r"is not valid YAML at line 3, column 2: expected <block end>"),
        ("policy:\n\tmodel_name: m\n", r"is not valid YAML at line 2, column 1: found character '\\t'"),
        ("- policy\n- data\n", "must hold a mapping at the top level"),
        # unknown key deep in the tree
        (
            BASE.replace("model_name: m", "model_name: m\n  generation:\n    vllm_cfg:\n      max_modle_len: 9"),
            r"^unknown config key 'policy.generation.vllm_cfg.max_modle_len' "
            r"\(did you mean 'policy.generation.vllm_cfg.max_model_len'\?\)$",
        ),
        # wrong types, for a value and for a whole section
        (
            BASE + "grpo:\n  num_prompts_per_step: 2.5\n",
            r"^config key 'grpo.num_prompts_per_step': Expected `int`, got `float`$",
        ),
        (BASE + "grpo: 5\n", r"^config key 'grpo': Expected `object`, got `int`$"),
        (
            BASE + "env:\n  nemo_gym:\n    agent_servers: [a, b]\n",
            r"^config key 'env.nemo_gym.agent_servers': Expected `object`, got `array`$",
        ),
        # a bad choice names the allowed values
        (
            BASE + "trainer:\n  backend: jax\n",
            r"^config key 'trainer.backend': Invalid enum value 'jax' \(one of 'megatron', 'torch'\)$",
        ),
        (
            BASE + "env:\n  failure_policy: ignore\n",
            r"^config key 'env.failure_policy': Invalid enum value 'ignore' "
            r"\(one of 'backfill', 'fail_fast', 'retry'\)$",
        ),
        # missing or null required values, out-of-range values
        ("data:\n  train_path: t.jsonl\n", r"^policy.model_name is required$"),
        ("", r"^policy.model_name is required$"),
        (
            BASE.replace("model_name: m", "model_name: null"),
            r"^config key 'policy.model_name': Expected `str`, got `null`$",
        ),
        (BASE + "trainer:\n  stream_retention_s: -1\n", r"^trainer.stream_retention_s must be >= 0$"),
    ],
    ids=[
        "syntax",
        "tab",
        "top-level-list",
        "unknown-deep",
        "type",
        "section-type",
        "nested-type",
        "enum",
        "enum-policy",
        "missing",
        "empty-file",
        "null",
        "range",
    ],
)
def test_broken_config_files_give_one_clear_error_naming_the_key(tmp_path, text, message):
    f = tmp_path / "broken.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load(RunConfig, f, env={}).check_service("trainer")  # as `streamrl up` checks a run's config
    assert "\n" not in str(err.value)


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
    from shared.sections.env_nemo_gym import NemoGymSection
    from shared.sections.gateway import EnvSection, backfills_failures

    assert not backfills_failures(EnvSection())
    assert not backfills_failures(EnvSection(failure_policy="retry"))
    assert backfills_failures(EnvSection(failure_policy="backfill"))
    assert backfills_failures(EnvSection(nemo_gym=NemoGymSection(backfill_failed_rollouts=True)))
