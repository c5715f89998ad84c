from structs import Stack


def test_push_then_pop():
    s = Stack()
    s.push(1)
    assert s.pop() == 1
