"""A shop's stock."""

from shop.inventory import Inventory

__all__ = ["Inventory"]
