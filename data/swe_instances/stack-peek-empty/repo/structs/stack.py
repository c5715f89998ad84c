"""A LIFO stack."""


class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        """Remove and return the top item; IndexError when the stack is empty."""
        return self._items.pop()

    def peek(self):
        """Return the top item without removing it; IndexError when the stack is empty."""
        if self._items:
            return self._items[-1]
        return None

    def __len__(self):
        return len(self._items)
