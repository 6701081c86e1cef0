"""Argument checks shared by every public entry point (one wording for the whole library).

Each check raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a value out
of range, naming the argument (and, with ``owner``, the function or class it was given to), the
value received and what was expected.
"""

from __future__ import annotations

import argparse
import math

import torch

__all__ = ["Window", "check_bool", "check_cu_seqlens_tensor", "check_float", "check_int", "check_number_above",
           "check_positive_float", "check_tensor_ranks", "nonempty_name_arg", "nonnegative_int_arg", "normalize_window", "positive_float_arg",
           "positive_int_arg"]

#: A normalised attention window: ``(left, right)``, ``None`` = unbounded side.
Window = tuple[int | None, int | None]


def check_tensor_ranks(rank: int, layout: str, **tensors: object) -> None:
    """Each keyword a ``torch.Tensor`` of rank ``rank`` (``layout`` names its dims in the message)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be rank {rank} {layout}, got shape {tuple(t.shape)}")


def check_cu_seqlens_tensor(owner: str, cu_seqlens: object) -> torch.Tensor:
    """``cu_seqlens`` of packed sequences as an int32 tensor ``[S+1]`` with ``S >= 1`` (``TypeError`` /
    ``ValueError`` naming ``owner`` and it otherwise); its values are the caller's to check."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{owner}: cu_seqlens must be an int32 tensor [S+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{owner}: cu_seqlens must have dtype torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{owner}: cu_seqlens must be 1-d [S+1] with S >= 1, got shape {tuple(cu_seqlens.shape)}")
    return cu_seqlens


def check_int(x: object, name: str, minimum: int | None = 1, owner: str | None = None,
              allow_tensor: bool = False) -> int:
    """``x`` as an ``int`` (``bool`` refused) that is at least ``minimum`` (``None``: no bound).

    With ``allow_tensor`` a one-element integer tensor is accepted too (read with ``.item()``)."""
    where = f"{owner}: " if owner else ""
    if allow_tensor and isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point() \
            and x.dtype != torch.bool:
        x = int(x.item())
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{where}{name} must be an int, got {type(x).__name__} ({x!r})")
    if minimum is not None and x < minimum:
        raise ValueError(f"{where}{name} must be >= {minimum}, got {x}")
    return x


def check_bool(x: object, name: str, owner: str | None = None) -> bool:
    """``x`` if it is a ``bool``, else ``TypeError`` naming ``name``."""
    if not isinstance(x, bool):
        where = f"{owner}: " if owner else ""
        raise TypeError(f"{where}{name} must be a bool, got {type(x).__name__}")
    return x


def check_float(x: object, name: str, owner: str | None = None, expected: str = "a float") -> float:
    """``x`` as a ``float`` (ints accepted, ``bool`` refused; no range check), else ``TypeError``
    saying ``name`` must be ``expected``."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        where = f"{owner}: " if owner else ""
        raise TypeError(f"{where}{name} must be {expected}, got {type(x).__name__}")
    return float(x)


def check_positive_float(x: object, name: str, owner: str | None = None) -> float:
    """``x`` as a finite, positive ``float`` (ints accepted, ``bool`` refused)."""
    value = check_float(x, name, owner)
    if not math.isfinite(value) or value <= 0:
        where = f"{owner}: " if owner else ""
        raise ValueError(f"{where}{name} must be a finite positive number, got {x}")
    return value


def check_number_above(x: object, name: str, lower: float, owner: str | None = None) -> float:
    """``x`` as a finite ``float`` strictly above ``lower`` (ints accepted, ``bool`` refused)."""
    value = check_float(x, name, owner, expected="a number")
    if not math.isfinite(value) or value <= lower:
        where = f"{owner}: " if owner else ""
        raise ValueError(f"{where}{name} must be a finite number > {lower:g}, got {x}")
    return value


def normalize_window(window: object) -> Window | None:
    """``None`` | ``w`` | ``(left, right)`` -> ``(left, right)`` with ``None`` = unbounded side
    (``docs/conventions.md``); sides must be ints ``>= 0``."""
    if window is None:
        return None
    if isinstance(window, int) and not isinstance(window, bool):
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        return (window, window)
    if isinstance(window, (tuple, list)) and len(window) == 2:
        sides: list[int | None] = []
        for name, side in zip(("left", "right"), window, strict=True):
            if side is None:
                sides.append(None)
                continue
            if isinstance(side, bool) or not isinstance(side, int):
                raise TypeError(f"window {name} side must be an int or None, got {type(side).__name__} ({side!r})")
            if side < 0:
                raise ValueError(f"window {name} side must be >= 0, got {side} (window={tuple(window)})")
            sides.append(side)
        return (sides[0], sides[1])
    raise TypeError(f"window must be None, an int or a (left, right) pair, got {window!r}")


def _number_arg(text: str, kind: type, what: str, allow_zero: bool = False) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (value >= 0 if allow_zero else value > 0) or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int_arg(text: str) -> int:
    """``argparse`` type for options that take a positive integer."""
    return int(_number_arg(text, int, "a positive integer"))


def nonnegative_int_arg(text: str) -> int:
    """``argparse`` type for options that take an integer ``>= 0`` (a count that may be zero)."""
    return int(_number_arg(text, int, "an integer >= 0", allow_zero=True))


def nonempty_name_arg(text: str) -> str:
    """``argparse`` type for a name used as one file name: not empty, no path separator, not ``.``/``..``."""
    if not text.strip() or "/" in text or "\\" in text or text in (".", "..") or "\0" in text:
        raise argparse.ArgumentTypeError(f"expected a non-empty name without '/' (it names a file), got {text!r}")
    return text


def positive_float_arg(text: str) -> float:
    """``argparse`` type for options that take a positive, finite number."""
    return float(_number_arg(text, float, "a positive number"))
