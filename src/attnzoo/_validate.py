"""Argument checks shared by every public entry point (one wording for the whole library).

Each check raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a value out
of range, naming the argument (and, with ``owner``, the function or class it was given to), the
value received and what was expected.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Literal, Protocol, cast, overload

import torch

__all__ = [
    "FloatCheck",
    "Window",
    "check_bool",
    "check_choice",
    "check_cu_seqlens",
    "check_finite_float",
    "check_float",
    "check_float_tensor",
    "check_int",
    "check_nonnegative_float",
    "check_number_above",
    "check_optional_int",
    "check_positive_float",
    "check_probability",
    "check_tensor_ranks",
    "is_finite_number",
    "nonempty_name_arg",
    "nonnegative_int_arg",
    "normalize_window",
    "positive_float_arg",
    "positive_int_arg",
]

#: A normalised attention window: ``(left, right)``, ``None`` = unbounded side.
Window = tuple[int | None, int | None]


def _where(owner: str | None) -> str:
    return f"{owner}: " if owner else ""


def _shown(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_error(value: object, name: str, owner: str | None, expected: str) -> TypeError:
    return TypeError(f"{_where(owner)}{name} must be {expected}, got {type(value).__name__} ({_shown(value)})")


def _range_error(value: object, name: str, owner: str | None, expected: str) -> ValueError:
    return ValueError(f"{_where(owner)}{name} must be {expected}, got {_shown(value)}")


def check_tensor_ranks(rank: int, layout: str, *, floating: bool = False, **tensors: object) -> None:
    """Each keyword a ``torch.Tensor`` of rank ``rank`` (``layout`` names its dims in the message),
    of a floating dtype when ``floating``."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if floating and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor {layout}, got dtype {t.dtype}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be rank {rank} {layout}, got shape {tuple(t.shape)}")


def check_float_tensor(value: object, name: str, owner: str, layout: str, *, nonempty: int | None = None
                       ) -> torch.Tensor:
    """A floating-point tensor of rank ``layout.count(",") + 1`` (``layout`` such as ``"[B, N, C]"``
    names its dims in the message) whose dim ``nonempty`` (if given) is at least 1."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a floating-point tensor {layout}, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{owner}: {name} must be a floating-point tensor {layout}, got dtype {value.dtype}")
    if value.dim() != layout.count(",") + 1 or (nonempty is not None and value.shape[nonempty] == 0):
        dim = "" if nonempty is None else f" with {layout.strip('[]').split(', ')[nonempty]} >= 1"
        raise ValueError(f"{owner}: {name} must have shape {layout}{dim}, got {tuple(value.shape)}")
    return value


def check_cu_seqlens(value: object, name: str = "cu_seqlens", owner: str | None = None, *, total: int | None = None,
                     int32: bool = True, values: bool = True) -> torch.Tensor:
    """Cumulative lengths of packed sequences: a 1-d integer tensor ``[S+1]`` with ``S >= 1`` (``int32``
    unless ``int32=False``) whose values start at 0, never decrease and end at ``total`` (when given).

    ``values=False`` skips the value checks (they read the tensor on the host, e.g. not while tracing)."""
    if not isinstance(value, torch.Tensor):
        raise _type_error(value, name, owner, f"an {'int32' if int32 else 'int'} tensor [S+1]")
    if int32 and value.dtype != torch.int32:
        raise TypeError(f"{_where(owner)}{name} must have dtype torch.int32 (as flash-attn's varlen API), "
                        f"got {value.dtype}; use .to(torch.int32)")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{_where(owner)}{name} must be an int tensor [S+1], got dtype {value.dtype}")
    if value.dim() != 1 or value.numel() < 2:
        raise ValueError(f"{_where(owner)}{name} must be 1-d [S+1] with S >= 1, got shape {tuple(value.shape)}")
    if values:
        bounds = [int(c) for c in value.tolist()]
        if bounds[0] != 0 or any(b < a for a, b in itertools.pairwise(bounds)) \
                or (total is not None and bounds[-1] != total):
            shown: list[object] = bounds if len(bounds) <= 12 else [*bounds[:6], "...", *bounds[-5:]]
            end = "" if total is None else f" and end at {total} (the number of packed tokens)"
            raise ValueError(f"{_where(owner)}{name} must start at 0, be non-decreasing{end}, got {shown}")
    return value


def check_int(value: object, name: str, owner: str | None = None, *, minimum: int | None = 1,
              allow_tensor: bool = False) -> int:
    """``value`` as an ``int`` (``bool`` refused) that is at least ``minimum`` (``None``: no bound).

    With ``allow_tensor`` a one-element integer tensor is accepted too (read with ``.item()``)."""
    if allow_tensor and isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(value, name, owner, "an int")
    if minimum is not None and value < minimum:
        raise _range_error(value, name, owner, f">= {minimum}")
    return value


def check_optional_int(value: object, name: str, owner: str | None = None, *, minimum: int | None = 1) -> int | None:
    """``None``, or ``value`` as an ``int`` at least ``minimum`` (:func:`check_int`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(value, name, owner, "an int or None")
    return check_int(value, name, owner, minimum=minimum)


def check_bool(value: object, name: str, owner: str | None = None) -> bool:
    """``value`` if it is a ``bool``, else ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise _type_error(value, name, owner, "a bool")
    return value


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is a finite int or float (``bool`` is not): the predicate form of
    :func:`check_finite_float`, for config values that are refused by name rather than raised on."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_float(value: object, name: str, owner: str | None = None, *, expected: str = "a float") -> float:
    """``value`` as a ``float`` (ints accepted, ``bool`` refused; no range check), else ``TypeError``
    saying ``name`` must be ``expected``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(value, name, owner, expected)
    return float(value)


def _float_in_range(value: object, name: str, owner: str | None, optional: bool, ok: Callable[[float], bool],
                    expected: str) -> float:
    none = " or None" if optional else ""
    x = check_float(value, name, owner, expected=f"a float{none}")
    if not math.isfinite(x) or not ok(x):
        raise _range_error(value, name, owner, f"{expected}{none}")
    return x


class FloatCheck(Protocol):
    """The type of :func:`check_finite_float`, :func:`check_positive_float` and
    :func:`check_nonnegative_float`: ``value`` as a ``float`` in the check's range (ints accepted,
    ``bool`` refused); with ``optional=True`` a ``None`` is returned as it is."""

    @overload
    def __call__(self, value: object, name: str, owner: str | None = ..., *,
                 optional: Literal[False] = ...) -> float: ...
    @overload
    def __call__(self, value: object, name: str, owner: str | None = ..., *, optional: bool) -> float | None: ...


def _float_check(fn_name: str, ok: Callable[[float], bool], expected: str, rule: str) -> FloatCheck:
    """A :class:`FloatCheck` accepting the finite floats where ``ok`` holds (``expected`` words them)."""

    def check(value: object, name: str, owner: str | None = None, *, optional: bool = False) -> float | None:
        if value is None and optional:
            return None
        return _float_in_range(value, name, owner, optional, ok, expected)

    check.__name__ = check.__qualname__ = fn_name
    check.__doc__ = f"``value`` as a finite ``float`` {rule}(ints accepted, ``bool`` refused; ``None`` kept with ``optional``)."
    return cast(FloatCheck, check)


check_finite_float = _float_check("check_finite_float", lambda x: True, "a finite number", "")
check_positive_float = _float_check("check_positive_float", lambda x: x > 0, "a finite positive number", "``> 0`` ")
check_nonnegative_float = _float_check("check_nonnegative_float", lambda x: x >= 0, "a finite non-negative number",
                                       "``>= 0`` ")


def check_number_above(value: object, name: str, owner: str | None = None, *, lower: float) -> float:
    """``value`` as a finite ``float`` strictly above ``lower`` (ints accepted, ``bool`` refused)."""
    return _float_in_range(value, name, owner, False, lambda x: x > lower, f"a finite number > {lower:g}")


def check_probability(value: object, name: str, owner: str | None = None) -> float:
    """``value`` as a ``float`` in ``[0, 1)`` (a dropout probability; ints accepted, ``bool`` refused)."""
    x = check_float(value, name, owner)
    if not 0.0 <= x < 1.0:
        raise _range_error(value, name, owner, "a float in [0, 1)")
    return x


def check_choice(value: object, name: str, owner: str | None = None, *, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices`` (``TypeError`` for a non-``str``, ``ValueError`` otherwise)."""
    options = list(choices)
    if not isinstance(value, str):
        raise _type_error(value, name, owner, f"one of {options}")
    if value not in options:
        raise _range_error(value, name, owner, f"one of {options}")
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
