"""(being written) Hugging Face family builder: see docs/adding-a-family.md."""

from __future__ import annotations

from typing import Any

__all__ = ["DISPATCH"]

DISPATCH: dict[str, Any] = {}
