"""The on-policy sampling gate and the output budget."""

import pytest

from services.generator.sampling import check_choices, output_budget, requested_max_tokens, resolve_sampling
from services.generator.serving import request_kind
from shared.http import HTTPError
from shared.openai_api import RequestTag
from shared.sections.generator import GenerationSection

pytestmark = pytest.mark.unit

GEN = GenerationSection(temperature=0.8, top_p=0.95, max_new_tokens=64, val_temperature=0.2, val_top_p=1.0)


def test_absent_values_come_from_the_profile():
    r = resolve_sampling(GEN, "train", temperature=None, top_p=None, top_k=None)
    assert (r.temperature, r.top_p) == (0.8, 0.95)
    v = resolve_sampling(GEN, "validation", temperature=None, top_p=None, top_k=-1)
    assert (v.temperature, v.top_p) == (0.2, 1.0)


def test_matching_values_are_accepted():
    assert resolve_sampling(GEN, "train", temperature=0.8, top_p=0.95, top_k=None).temperature == 0.8


@pytest.mark.parametrize(
    "kind, kwargs, param",
    [
        ("train", {"temperature": 0.7}, "temperature"),
        ("train", {"top_p": 1.0}, "top_p"),
        ("train", {"top_k": 50}, "top_k"),
        # the tag decides: a training request with the validation values is refused
        ("train", {"temperature": 0.2, "top_p": 1.0}, "temperature"),
        ("validation", {"temperature": 0.8}, "temperature"),
    ],
)
def test_mismatch_is_a_400_naming_the_parameter(kind, kwargs, param):
    args = {"temperature": None, "top_p": None, "top_k": None, **kwargs}
    with pytest.raises(HTTPError) as err:
        resolve_sampling(GEN, kind, **args)
    assert err.value.status == 400 and err.value.param == param


def test_max_tokens_defaults_and_clamps():
    assert requested_max_tokens(GEN, None) == 64
    assert requested_max_tokens(GEN, 10) == 10
    assert requested_max_tokens(GEN, 10_000) == 64
    with pytest.raises(HTTPError) as err:
        requested_max_tokens(GEN, 0)
    assert err.value.param == "max_tokens"


def test_output_budget():
    assert output_budget(64, 100, 1024) == 64
    assert output_budget(64, 1000, 1024) == 24
    with pytest.raises(HTTPError, match="no room for output") as err:
        output_budget(64, 1024, 1024)
    assert err.value.type == "invalid_request_error"
    with pytest.raises(HTTPError, match="maximum context length is 1024") as err:
        output_budget(64, 2000, 1024)
    assert err.value.status == 400 and err.value.type == "invalid_request_error"


def test_choices_and_top_logprobs():
    assert check_choices(2, None) == 0 and check_choices(1, 5) == 5
    with pytest.raises(HTTPError) as err:
        check_choices(0, None)
    assert err.value.param == "n"
    with pytest.raises(HTTPError) as err:
        check_choices(1, 21)
    assert err.value.param == "top_logprobs"
    assert check_choices(128, None) == 0
    with pytest.raises(HTTPError, match="between 1 and 128") as err:  # found by the schema fuzzer: n=37124000
        check_choices(37_124_000, None)  # used to allocate that many choices until the process died
    assert err.value.status == 400 and err.value.param == "n"


def test_request_kind_from_tag_or_template_kwargs():
    assert request_kind(None, None) == "train"
    assert request_kind(RequestTag(kind="validation"), None) == "validation"
    assert request_kind(None, {"streamrl": {"kind": "validation"}}) == "validation"
    with pytest.raises(HTTPError):
        request_kind(None, {"streamrl": {"kind": "eval"}})
