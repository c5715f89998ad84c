"""Pure parts of the session proxy and the gateway worker: prefix comparison, failure
classification."""

import random

import pytest

from services.gym_gateway.envs import UnknownEnvironment
from services.gym_gateway.envs.base import ModelRequestError, SandboxError, TransportError
from services.gym_gateway.proxy import NoGenerator, common_prefix_len
from services.gym_gateway.worker import classify

pytestmark = pytest.mark.unit


def _slow_prefix(a, b):
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def test_common_prefix_len_matches_a_token_by_token_scan():
    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 40))]
        b = a[: rng.randint(0, len(a))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        assert common_prefix_len(a, b) == _slow_prefix(a, b)
        assert common_prefix_len(b, a) == _slow_prefix(b, a)


@pytest.mark.parametrize(
    ("exc", "reason", "kind", "retryable"),
    [
        (TimeoutError(), "timeout", "infra", True),
        (NoGenerator("none"), "no_generator", "infra", True),
        (TransportError("reset"), "transport", "infra", True),
        (SandboxError("no container"), "sandbox", "infra", True),
        (UnknownEnvironment("x"), "unknown_env", "infra", False),
        (ModelRequestError("context full"), "model_refused", "policy", False),
        (KeyError("light"), "env_error", "infra", True),
    ],
)
def test_failures_are_told_apart(exc, reason, kind, retryable):
    f = classify(exc)
    assert (f.reason, f.kind, f.retryable) == (reason, kind, retryable)
    assert f.fallback_reason.startswith(reason)
