"""Attention modules, positional encodings and KV caches (``[B, N, C]`` in and out)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    name: module
    for name, module in __import__("attnzoo")._EXPORTS.items()
    if module.startswith("attnzoo.nn.")
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnzoo.nn' has no attribute {name!r}")
