import pytest

from structs import Stack


class TestStack:
    def test_push_pop_order(self):
        s = Stack()
        for i in range(3):
            s.push(i)
        assert [s.pop(), s.pop(), s.pop()] == [2, 1, 0]

    def test_peek_returns_top(self):
        s = Stack()
        s.push("a")
        s.push("b")
        assert s.peek() == "b" and len(s) == 2

    def test_peek_empty_raises(self):
        with pytest.raises(IndexError, match="empty stack"):
            Stack().peek()
