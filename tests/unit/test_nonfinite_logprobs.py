"""Generation logprobs that are not numbers, as the session proxy sees a generator's answer: JSON
``null`` (msgspec's encoding of NaN), the bare words ``NaN``/``Infinity`` (Python's json), and a
finite double that is infinite once stored as float32. Such an answer is refused (a 502 of type
``nan_generation_logprobs``) and counted on its session; any other answer is decoded, or fails
to decode, as before."""

from __future__ import annotations

import msgspec
import pytest

from services.gym_gateway.nonfinite_logprobs import finite, undecodable_nonfinite
from services.gym_gateway.proxy import Session, SessionProxy
from shared.http import HTTPError
from shared.protocol import SamplingParams

pytestmark = pytest.mark.unit


def _completion(logprobs: str) -> bytes:
    return (
        '{"id": "c", "created": 0, "model": "m", "prompt_token_ids": [1], "weight_version": 0, '
        '"weight_version_end": 0, "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, '
        '"choices": [{"index": 0, "text": "hi", "finish_reason": "stop", "generation_token_ids": [5, 6], '
        f'"generation_log_probs": {logprobs}}}]}}'
    ).encode()


def _chat(logprobs: str) -> bytes:
    return (
        '{"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", '
        f'"content": "go", "generation_log_probs": {logprobs}}}}}]}}'
    ).encode()


def test_finite_is_judged_as_the_trajectory_stores_logprobs():
    assert finite([-0.5, 0.0, -30.0]) and finite([])
    assert not finite([-0.5, float("nan")]) and not finite([float("-inf")])
    assert not finite([-1e39])  # finite as a double, -inf as the float32 a turn packs


@pytest.mark.parametrize("logprobs", ["[-0.5, null]", "[NaN]", "[-Infinity, -0.1]", "[Infinity]"])
def test_an_answer_the_decoder_refused_for_a_nan_logprob_is_recognised(logprobs):
    assert undecodable_nonfinite(_completion(logprobs)) and undecodable_nonfinite(_chat(logprobs))


@pytest.mark.parametrize(
    "body", [_completion("[-0.5, -0.25]"), _completion('"oops"'), b"not json", b"[1, 2]", b'{"choices": 3}']
)
def test_an_answer_refused_for_anything_else_is_not_blamed_on_logprobs(body):
    assert not undecodable_nonfinite(body)


def _proxy_and_session() -> tuple[SessionProxy, Session]:
    proxy = SessionProxy(pool=None, http=None, request_timeout_s=1.0)  # type: ignore[arg-type]
    return proxy, Session("s-1", "train", SamplingParams(), "gen-0", "http://gen", 0)


@pytest.mark.parametrize("logprobs", ["[-0.5, null]", "[NaN, -0.1]", "[-1e39, -0.1]"])
def test_the_proxy_refuses_and_counts_an_answer_with_nan_logprobs(logprobs):
    proxy, s = _proxy_and_session()
    with pytest.raises(HTTPError) as err:
        proxy._decode(s, _completion(logprobs), proxy._completion_decoder)
    assert err.value.status == 502 and err.value.type == "nan_generation_logprobs"
    assert s.nan_logprob_calls == 1


def test_the_proxy_decodes_finite_answers_and_reraises_other_errors():
    proxy, s = _proxy_and_session()
    out = proxy._decode(s, _completion("[-0.5, -0.25]"), proxy._completion_decoder)
    assert out.choices[0].generation_log_probs == [-0.5, -0.25]
    with pytest.raises(msgspec.ValidationError):
        proxy._decode(s, _completion('"oops"'), proxy._completion_decoder)
    assert s.nan_logprob_calls == 0
