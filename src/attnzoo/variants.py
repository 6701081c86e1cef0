"""The registry of named attention variants: it collects the specs the module files declare.

Each variant's module file (under :mod:`attnzoo.nn`) defines its class next to a
:class:`~attnzoo.nn.spec.VariantSpec` and calls :func:`~attnzoo.nn.spec.register`; importing this
module imports every module of :mod:`attnzoo.nn`, so ``VARIANTS`` holds them all. This file knows
no variant by name. One table serves the CLI (``attnzoo list``), the benchmark, the cost model,
``attnzoo check`` and the arena. Every builder takes the same arguments, so any variant can be the
mixer of a ``TransformerBlock``::

    attn = build_attention("gqa", dim=256, num_heads=8, causal=True)
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from typing import Any

from torch import nn

import attnzoo.nn as _nn_package
from attnzoo.nn.attention import default_kv_heads
from attnzoo.nn.spec import REGISTRY, CostShape, VariantConfig, VariantSpec, register
from attnzoo.nn.spec import resolve_config as _resolve_spec

__all__ = [
    "VARIANTS",
    "VariantConfig",
    "VariantSpec",
    "build_attention",
    "default_kv_heads",
    "kv_cache_bytes_per_token",
    "layer_pattern",
    "register",
    "resolve_config",
    "variant_names",
]


def _collect() -> dict[str, VariantSpec]:
    """Import every module of :mod:`attnzoo.nn` (each registers its variants), then order the
    registry by the specs' ``order`` (stable: ties keep registration order)."""
    for info in pkgutil.iter_modules(_nn_package.__path__):
        importlib.import_module(f"{_nn_package.__name__}.{info.name}")
    ordered = sorted(REGISTRY.values(), key=lambda s: s.order)
    REGISTRY.clear()
    REGISTRY.update((s.name, s) for s in ordered)
    return REGISTRY


#: name -> :class:`VariantSpec` of every registered variant (the live registry: a spec registered
#: later, e.g. by a plug-in or a test, appears here too).
VARIANTS: dict[str, VariantSpec] = _collect()


def variant_names() -> list[str]:
    """Registered variant names, in the registry's order."""
    return list(VARIANTS)


def _spec(name: object) -> VariantSpec:
    if not isinstance(name, str) or name not in VARIANTS:
        raise ValueError(f"unknown attention variant {name!r}; expected one of {variant_names()}")
    return VARIANTS[name]


def build_attention(name: str, dim: int, num_heads: int, **kwargs: Any) -> nn.Module:
    """Build the attention module registered as ``name`` (``[B, N, C] -> [B, N, C]``).

    Args:
        name: one of :func:`variant_names`.
        dim: model width ``C``.
        num_heads: query heads ``H``.
        **kwargs: forwarded to the module (``causal``, ``window``, ``num_kv_heads``, ``rope``, ...),
            over the spec's ``defaults``.
    """
    spec = _spec(name)
    if not spec.backends and "backend" in kwargs:
        backend = kwargs.pop("backend")
        if backend != "auto":
            takes = [n for n, s in VARIANTS.items() if s.backends]
            raise ValueError(f"build_attention({name!r}): backend={backend!r}, but {name} computes with its own "
                             f"kernels and forms and takes no attention backend (only 'auto', the default); "
                             f"variants that take one: {takes}")
    return spec.build(dim, num_heads, **{**spec.defaults, **kwargs})


def resolve_config(name: str, dim: int, num_heads: int, **kwargs: Any) -> VariantConfig:
    """Fill in a variant's defaults exactly as :func:`build_attention` would build it.

    Args:
        name: one of :func:`variant_names`.
        dim: model width ``C``.
        num_heads: query heads ``H`` (must divide ``dim`` unless ``head_dim`` is given).
        **kwargs: ``num_kv_heads``, ``head_dim``, ``causal``, ``window`` (int or ``(left, right)``),
            ``global_tokens``, ``num_features``, ``segment_len``, ``chunk_size`` (``None`` = not
            given). A setting that does not apply to the variant raises ``ValueError``.
    """
    return _resolve_spec(_spec(name), dim, num_heads, **kwargs)


def kv_cache_bytes_per_token(name: str, dim: int, num_heads: int, dtype_bytes: int = 2, **kwargs: Any) -> int:
    """Decode-cache bytes one more token adds to one layer (0 for fixed-size states).

    Softmax variants store ``2 * Hkv * D`` numbers per token (a sliding window stops growing at
    ``W`` tokens); feature-map and compressive variants keep a state whose size does not grow.
    See :func:`attnzoo.cost.estimate` for the full cache size at a given length.
    """
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be an int >= 1, got {dtype_bytes!r}")
    spec = _spec(name)
    cfg = _resolve_spec(spec, dim, num_heads, **kwargs)
    shape = CostShape(batch=1, seq_len=1, elem_bytes=dtype_bytes, acc_bytes=max(4, dtype_bytes), backend="ideal")
    return spec.cost(cfg, shape).kv_cache_bytes_per_token


def layer_pattern(pattern: str | Sequence[str], depth: int) -> tuple[str, ...]:
    """One registry name per layer of a ``depth``-layer stack.

    ``pattern`` is a name (``"mha"``: every layer), a ``/``-separated pattern cycled to the depth
    (``"gated_deltanet/gated_deltanet/gated_deltanet/mha"``: three linear layers per softmax one,
    the CLI's way to write a hybrid stack) or a sequence of names (cycled the same way). Every name
    must be registered.

    Returns: a tuple of ``depth`` names.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"layer_pattern: depth must be an int >= 1, got {depth!r}")
    if isinstance(pattern, str):
        names = [p.strip() for p in pattern.split("/")]
    elif isinstance(pattern, Sequence) and all(isinstance(p, str) for p in pattern):
        names = [p.strip() for p in pattern]
    else:
        raise TypeError(f"layer_pattern: pattern must be a registry name, a 'a/b/c' pattern or a sequence of "
                        f"names, got {type(pattern).__name__}")
    if not names or any(not n for n in names):
        raise ValueError(f"layer_pattern: pattern {pattern!r} has an empty entry; expected names separated by '/'")
    for n in names:
        _spec(n)
    return tuple(names[i % len(names)] for i in range(depth))
