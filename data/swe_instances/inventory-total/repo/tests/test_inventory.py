from shop import Inventory


def test_add_single_item():
    inv = Inventory()
    inv.add("pen", 2.0)
    assert inv.items["pen"] == (2.0, 1)
