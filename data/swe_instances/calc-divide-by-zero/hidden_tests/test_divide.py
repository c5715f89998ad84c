import pytest

from calc import divide


def test_divide_exact():
    assert divide(6, 3) == 2


def test_divide_fraction():
    assert divide(1, 4) == 0.25


def test_divide_by_zero_raises_value_error():
    with pytest.raises(ValueError, match="cannot divide by zero"):
        divide(1, 0)
