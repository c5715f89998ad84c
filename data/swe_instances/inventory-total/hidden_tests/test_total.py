from shop import Inventory


def test_total_value_uses_quantity():
    inv = Inventory()
    inv.add("pen", 2.0, quantity=3)
    inv.add("pad", 5.0)
    assert inv.total_value() == 11.0


def test_adding_twice_accumulates_quantity():
    inv = Inventory()
    inv.add("pen", 2.0)
    inv.add("pen", 2.0, quantity=2)
    assert inv.total_value() == 6.0


def test_empty_inventory_is_worth_nothing():
    assert Inventory().total_value() == 0
