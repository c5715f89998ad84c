"""Items in stock with their unit price and quantity."""


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, price, quantity=1):
        """Add ``quantity`` units of ``name`` at ``price`` each."""
        _, have = self.items.get(name, (price, 0))
        self.items[name] = (price, have + quantity)

    def remove(self, name):
        del self.items[name]

    def total_value(self):
        """The value of everything in stock: unit price times quantity, summed."""
        return sum(price for price, _ in self.items.values())
