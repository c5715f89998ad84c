import pytest

from dates import days_in_year, is_leap_year


@pytest.mark.parametrize("year,leap", [(2024, True), (2023, False), (1900, False), (2000, True)])
def test_is_leap_year(year, leap):
    assert is_leap_year(year) is leap


def test_days_in_century_year():
    assert days_in_year(2100) == 365
