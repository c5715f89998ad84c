from dates import days_in_year


def test_common_year():
    assert days_in_year(2023) == 365
