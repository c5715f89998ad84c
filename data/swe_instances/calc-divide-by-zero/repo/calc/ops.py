"""Arithmetic on two numbers."""


def add(a, b):
    return a + b


def subtract(a, b):
    return a - b


def multiply(a, b):
    return a * b


def divide(a, b):
    """Divide ``a`` by ``b``."""
    return a / b
