"""A tiny calculator library."""

from calc.ops import add, divide, multiply, subtract

__all__ = ["add", "divide", "multiply", "subtract"]
