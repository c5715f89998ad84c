"""The refit fidelity check (``refit.max_gen_kl_error``) and the engine-checksum agreement."""

import pytest

from services.trainer.refit import RefitError, _check_engine_checksums, check_refit_fidelity
from shared.protocol import WeightAck

pytestmark = pytest.mark.unit


def test_noise_passes_and_garbage_fails_naming_the_version():
    check_refit_fidelity(3, 0.0007, 0.01)  # same weights on both sides: numerical noise
    check_refit_fidelity(3, None, 0.01)  # a step without valid tokens has no error to check
    with pytest.raises(RefitError, match=r"gen_kl_error 0\.55 on the rows weight version 7 .*max_gen_kl_error 0\.01"):
        check_refit_fidelity(7, 0.55, 0.01)


def _ack(worker: str, engine_checksum: str | None) -> WeightAck:
    return WeightAck(worker_id=worker, version=2, ok=True, engine_checksum=engine_checksum)


def test_generators_holding_different_weights_fail_by_name():
    _check_engine_checksums(2, {"a": _ack("a", "x"), "b": _ack("b", "x"), "c": _ack("c", None)})
    with pytest.raises(RefitError, match=r"version 2 \(a, c: x; b: y\)"):
        _check_engine_checksums(2, {"a": _ack("a", "x"), "b": _ack("b", "y"), "c": _ack("c", "x")})
