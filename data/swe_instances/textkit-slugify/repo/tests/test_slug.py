from textkit import slugify


def test_single_word():
    assert slugify("Hello") == "hello"
