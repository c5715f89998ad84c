"""`streamrl scale` arguments: SERVICE=COUNT pairs with the compose/Kubernetes service names (and
the registry's spelling gym_gateway), each error naming the argument at fault."""

import pytest

from streamrl.scale import ScaleError, ScaleResult, parse_targets

pytestmark = pytest.mark.unit


def test_pairs_are_parsed_with_aliases():
    assert parse_targets(["generator=2", "gym-gateway=3"]) == {"generator": 2, "gym-gateway": 3}
    assert parse_targets(["gym_gateway=1"]) == {"gym-gateway": 1}
    assert parse_targets(["Generators=4"]) == {"generator": 4}


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "nothing to scale"),
        (["trainer=2"], "'trainer=2': expected SERVICE=COUNT"),
        (["generator"], "'generator': expected SERVICE=COUNT"),
        (["generator=two"], "'generator=two': the count must be a whole number"),
        (["generator=0"], "at least one generator"),
        (["generator=1", "generators=2"], "generator is given twice"),
    ],
)
def test_bad_arguments_are_named(args, message):
    with pytest.raises(ScaleError, match=message):
        parse_targets(args)


def test_the_result_prints_before_and_after_per_service():
    r = ScaleResult({"generator": 1, "gym-gateway": 1}, {"generator": 2, "gym-gateway": 1})
    assert r.describe() == "generator: 1 -> 2, gym-gateway: 1 -> 1"
