from textkit import slugify


def test_single_word():
    assert slugify("Hello") == "hello"


def test_two_words():
    assert slugify("Hello World") == "hello-world"


def test_collapses_runs_of_separators():
    assert slugify("Hello,   World!!  Again") == "hello-world-again"


def test_strips_leading_and_trailing_separators():
    assert slugify("  --Hello--  ") == "hello"
