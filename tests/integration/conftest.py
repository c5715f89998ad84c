"""Fixtures of the integration tier (the session's Valkey, services in-process); the code behind
them is in tests/support.

* ``serve_app``: ``async with serve_app(app, port) as url`` serves an ASGI app with uvicorn on a
  loopback port, lifespan included, and stops it on exit.
* ``gateway_stack``: ``async with gateway_stack(...) as stack`` starts generator(s) (transformers
  engine, weights v0 confirmed) and a gateway over the session's Valkey, on a fresh run id
  (`tests.support.gateway.gateway_stacks`).
* ``scripted_gateway``: ``async with scripted_gateway(policies, **sections) as stack``, a gateway
  whose only generator is a scripted one (`tests.support.fakes.generator`): no model.
* ``registered_env``: ``with registered_env(env): ...`` makes an environment object resolvable by
  its name for the duration of a test.
* ``hf_generator``: ``async with hf_generator(**generation) as gen``, the generator app with the
  transformers engine in-process on a fresh run id; ``until_generating`` waits until its engine
  generates a request's first tokens.
* ``generator_config_tree``, ``scripted_model``: `tests.support.generator.config_tree` and
  `fine_tune_to_answer`.
* ``openhands_venv``: fails a test of the OpenHands SDK when its virtualenv is missing.
"""

from __future__ import annotations

import pytest

from tests.support import gateway, generator
from tests.support.services import ROOT


@pytest.fixture
def serve_app():
    return gateway.serve


@pytest.fixture
def gateway_stack(tiny_model_dir, redis_url, tmp_path):
    return gateway.gateway_stacks(tiny_model_dir, redis_url, tmp_path)


@pytest.fixture
def scripted_gateway(redis_url, tmp_path):
    return gateway.scripted_gateways(redis_url, tmp_path)


@pytest.fixture
def registered_env():
    from services.gym_gateway.envs import registered

    return registered


@pytest.fixture
def hf_generator(tiny_model_dir, redis_url, write_config):
    """Factory: ``hf_generator(*, with_redis=True, model_dir=None, **generation)``."""

    def make(*, with_redis: bool = True, model_dir=None, **generation):
        _, cfg = write_config(model_dir or tiny_model_dir, redis_url=redis_url if with_redis else None, **generation)
        return generator.in_process_generator(cfg)

    return make


@pytest.fixture(scope="session")
def until_generating():
    return generator.wait_generating


@pytest.fixture(scope="session")
def generator_config_tree():
    return generator.config_tree


@pytest.fixture(scope="session")
def scripted_model():
    return generator.fine_tune_to_answer


@pytest.fixture(scope="module")
def openhands_venv():
    from shared.sections.env_openhands import OpenHandsSection

    python = ROOT / OpenHandsSection().python
    if not python.exists():
        pytest.fail(f"{python} is missing: run scripts/setup_openhands.sh (scripts/test.sh does)")
