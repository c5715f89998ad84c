"""`shared.keys`: every key of a run lives under its hash tag, a scan pattern matches that key of
every run, and the run id reads back from a key found that way."""

from __future__ import annotations

import fnmatch

import pytest

from shared import keys as K

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("run_id", ["r1", "demo-2026", "odd}:id"])
def test_a_run_key_matches_the_pattern_of_every_run_and_gives_its_run_back(run_id):
    keys, every_run = K.RunKeys(run_id), K.RunKeys.pattern()
    assert keys.tasks == f"streamrl:{{{run_id}}}:tasks"
    assert every_run.registry == "streamrl:{*}:registry"
    for name in ("tasks", "registry", "trainer_step"):
        key = getattr(keys, name)
        assert fnmatch.fnmatchcase(key, getattr(every_run, name)) and K.run_id_of(key) == run_id
    assert not fnmatch.fnmatchcase(keys.registry_info, every_run.registry)


def test_an_environment_keeps_its_own_keys_under_the_run():
    key = K.RunKeys("r1").env_key("bench_chat", "round-0", "sessions")
    assert key == "streamrl:{r1}:env:bench_chat:round-0:sessions" and K.run_id_of(key) == "r1"


@pytest.mark.parametrize("key", ["bench:r1:sessions", "streamrl:r1:tasks", "other:{r1}:tasks"])
def test_a_key_of_no_run_is_refused(key):
    with pytest.raises(ValueError, match="not a key of a streamrl run"):
        K.run_id_of(key)
