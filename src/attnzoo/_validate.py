"""Argument checks shared by every public entry point (one wording for the whole library).

Each check raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a value out
of range, naming the argument (and, with ``owner``, the function or class it was given to), the
value received and what was expected.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["check_int", "positive_float_arg", "positive_int_arg"]


def check_int(x: object, name: str, minimum: int | None = 1, owner: str | None = None) -> int:
    """``x`` as an ``int`` (``bool`` refused) that is at least ``minimum`` (``None``: no bound)."""
    where = f"{owner}: " if owner else ""
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{where}{name} must be an int, got {type(x).__name__} ({x!r})")
    if minimum is not None and x < minimum:
        raise ValueError(f"{where}{name} must be >= {minimum}, got {x}")
    return x


def _number_arg(text: str, kind: type, what: str) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int_arg(text: str) -> int:
    """``argparse`` type for options that take a positive integer."""
    return int(_number_arg(text, int, "a positive integer"))


def positive_float_arg(text: str) -> float:
    """``argparse`` type for options that take a positive, finite number."""
    return float(_number_arg(text, float, "a positive number"))
