"""The registry of named attention variants: name -> how to build it, its costs and abilities.

One table serves the CLI (``attnzoo list``), the benchmark, the cost model and the arena. Every
builder takes the same arguments, so any variant can be the mixer of a ``TransformerBlock``::

    attn = build_attention("gqa", dim=256, num_heads=8, causal=True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["VARIANTS", "VariantSpec", "build_attention", "variant_names"]


@dataclass(frozen=True)
class VariantSpec:
    """What a named variant is and how to build it."""

    name: str
    family: str  # "softmax" | "feature-map" | "compressive"
    exact: bool  # exact softmax attention (possibly restricted by a mask) vs an approximation
    time: str  # time complexity of one forward over N tokens (C = width, W = window, F = features)
    memory: str  # extra activation memory of the attention itself
    decoding: str  # what the decode cache holds
    build: Callable[..., nn.Module]
    defaults: dict[str, Any] = field(default_factory=dict)
    masks: str = "causal"


def _mha(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    from attnzoo.nn.attention import MultiHeadAttention

    return MultiHeadAttention(dim, num_heads, causal=causal, **kw)


def _mqa(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    from attnzoo.nn.attention import MultiQueryAttention

    return MultiQueryAttention(dim, num_heads, causal=causal, **kw)


def _gqa(dim: int, num_heads: int, *, causal: bool = True, num_kv_heads: int | None = None, **kw: Any) -> nn.Module:
    from attnzoo.nn.attention import GroupedQueryAttention

    kv = num_kv_heads if num_kv_heads is not None else max(1, num_heads // 4)
    while num_heads % kv:
        kv -= 1
    return GroupedQueryAttention(dim, num_heads, num_kv_heads=kv, causal=causal, **kw)


def _sliding(dim: int, num_heads: int, *, causal: bool = True, window: int = 64, **kw: Any) -> nn.Module:
    from attnzoo.nn.attention import SlidingWindowAttention

    return SlidingWindowAttention(dim, num_heads, window=window, causal=causal, **kw)


def _local_global(dim: int, num_heads: int, *, causal: bool = True, window: int = 64,
                  global_tokens: tuple[int, ...] = (0,), **kw: Any) -> nn.Module:
    from attnzoo.nn.local_global import LocalGlobalAttention

    return LocalGlobalAttention(dim, num_heads, window=window, global_tokens=global_tokens, causal=causal, **kw)


def _linear(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    from attnzoo.nn.feature_attention import LinearAttention

    return LinearAttention(dim, num_heads, causal=causal, **kw)


def _performer(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    from attnzoo.nn.feature_attention import PerformerAttention

    return PerformerAttention(dim, num_heads, causal=causal, **kw)


def _infini(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    from attnzoo.nn.infini import InfiniAttention

    if not causal:
        raise ValueError("infini: InfiniAttention is causal by construction (causal=False is not supported)")
    return InfiniAttention(dim, num_heads, **kw)


VARIANTS: dict[str, VariantSpec] = {
    s.name: s
    for s in [
        VariantSpec("mha", "softmax", True, "O(N C^2 + N^2 C)", "O(N) (fused/tiled)", "K,V of every head", _mha,
                    masks="any"),
        VariantSpec("mqa", "softmax", True, "O(N C^2 + N^2 C)", "O(N) (fused/tiled)", "K,V of one shared head",
                    _mqa, masks="any"),
        VariantSpec("gqa", "softmax", True, "O(N C^2 + N^2 C)", "O(N) (fused/tiled)", "K,V of each KV group",
                    _gqa, masks="any"),
        VariantSpec("sliding", "softmax", True, "O(N C^2 + N W C)", "O(N W) tiled", "last W keys (ring buffer)",
                    _sliding, masks="causal, window, padding"),
        VariantSpec("local_global", "softmax", True, "O(N C^2 + N (W + G) C)", "O(N (W + G)) tiled",
                    "K,V of every token", _local_global, masks="causal, window, global tokens, padding"),
        VariantSpec("linear", "feature-map", False, "O(N C^2 + N F C)", "O(N F) chunked",
                    "state S [F, Dv] + z [F] per head", _linear, masks="causal, key padding"),
        VariantSpec("performer", "feature-map", False, "O(N C^2 + N F C)", "O(N F) chunked",
                    "state S [F, Dv] + z [F] per head", _performer, masks="causal, key padding"),
        VariantSpec("infini", "compressive", False, "O(N C^2 + N S C)", "O(N S)",
                    "memory M [D, Dv] + z [D] per head, plus the current segment", _infini, masks="causal"),
    ]
}


def variant_names() -> list[str]:
    """Registered variant names, in the registry's order."""
    return list(VARIANTS)


def build_attention(name: str, dim: int, num_heads: int, **kwargs: Any) -> nn.Module:
    """Build the attention module registered as ``name`` (``[B, N, C] -> [B, N, C]``).

    Args:
        name: one of :func:`variant_names`.
        dim: model width ``C``.
        num_heads: query heads ``H``.
        **kwargs: forwarded to the module (``causal``, ``window``, ``num_kv_heads``, ``rope``, ...).
    """
    if not isinstance(name, str) or name not in VARIANTS:
        raise ValueError(f"unknown attention variant {name!r}; expected one of {variant_names()}")
    spec = VARIANTS[name]
    return spec.build(dim, num_heads, **{**spec.defaults, **kwargs})
