"""Hybrid stacks in the arena: a ``/`` pattern of registry names, one per layer, cycled to the depth.

``attnzoo arena --variants "gated_deltanet/gated_deltanet/gated_deltanet/mha"`` enters a stack of
three Gated DeltaNet layers per softmax one (:func:`attnzoo.variants.layer_pattern`); ``--variants
a,b`` stays comma-separated, so a pattern is one entry. A hybrid's decode state is the sum of its
layers' (each from the variant's cost function, :func:`attnzoo.cost.estimate`).
"""

from __future__ import annotations

from typing import Any

from attnzoo.arena.longctx import layer_settings
from attnzoo.cost import estimate
from attnzoo.variants import VARIANTS, layer_pattern

__all__ = ["check_entry", "entry_kwargs", "is_hybrid", "stack_cache_bytes"]


def is_hybrid(entry: str) -> bool:
    """Whether a ``--variants`` entry is a per-layer pattern (``"a/b"``) rather than one name."""
    return "/" in entry


def check_entry(entry: str) -> str:
    """``entry`` stripped, or ``ValueError`` naming the unknown layer name (via ``layer_pattern``)."""
    entry = entry.strip()
    try:
        layer_pattern(entry, 1)
    except (ValueError, KeyError) as e:
        raise ValueError(f"--variants: {entry!r} is not a registry name or a '/' pattern of them ({e})") from None
    return entry


def entry_kwargs(entry: str, width: int, heads: int, window: int | None) -> dict[str, Any]:
    """The attention builder arguments of ``entry`` at the arena's width and heads: one variant's
    arena settings; for a pattern, the settings every layer's variant takes with the same value.
    A window is not among them (``DecoderLM`` takes no per-layer window in a mixed stack): a
    windowed layer of a hybrid keeps its registry default window."""
    if not is_hybrid(entry):
        return VARIANTS[entry].arena_settings(width, heads, window)
    names = sorted({n.strip() for n in entry.split("/")})
    per = [VARIANTS[n].arena_settings(width, heads, window) for n in names]
    keys = set.intersection(*(set(p) for p in per)) - {"window"}
    return {k: per[0][k] for k in sorted(keys) if all(p[k] == per[0][k] for p in per)}


def stack_cache_bytes(entry: str, seq_len: int, width: int, heads: int, depth: int, window: int | None) -> float:
    """Decode-state bytes of the whole stack after ``seq_len`` tokens, batch 1, float32: the sum of
    every layer's cost-function cache."""
    win = None if is_hybrid(entry) else window  # a hybrid's windowed layers keep the registry default
    return float(sum(estimate(n, seq_len, width, heads, dtype="float32",
                              **layer_settings(n, width, heads, win)).kv_cache_bytes
                     for n in layer_pattern(entry, depth)))
