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

__all__ = [
    "VARIANTS",
    "VariantConfig",
    "VariantSpec",
    "build_attention",
    "kv_cache_bytes_per_token",
    "resolve_config",
    "variant_names",
]


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
    #: how the attention part is computed, for the cost model: "dense" | "window" | "local_global"
    #: | "feature" | "compressive"
    pattern: str = "dense"


def _mha(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    from attnzoo.nn.attention import MultiHeadAttention

    return MultiHeadAttention(dim, num_heads, causal=causal, **kw)


def _mqa(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    from attnzoo.nn.attention import MultiQueryAttention

    return MultiQueryAttention(dim, num_heads, causal=causal, **kw)


def default_kv_heads(num_heads: int) -> int:
    """GQA's default number of KV heads: a quarter of the query heads (LLaMA-style), but at least
    two so that ``gqa`` stays distinct from ``mqa`` (one KV head) at small head counts."""
    kv = num_heads // 4 if num_heads // 4 >= 2 else max(1, num_heads // 2)
    while num_heads % kv:
        kv -= 1
    return kv


def _gqa(dim: int, num_heads: int, *, causal: bool = True, num_kv_heads: int | None = None, **kw: Any) -> nn.Module:
    from attnzoo.nn.attention import GroupedQueryAttention

    kv = num_kv_heads if num_kv_heads is not None else default_kv_heads(num_heads)
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
                    _sliding, masks="causal, window, padding", pattern="window"),
        VariantSpec("local_global", "softmax", True, "O(N C^2 + N (W + G) C)", "O(N (W + G)) tiled",
                    "K,V of every token", _local_global, masks="causal, window, global tokens, padding",
                    pattern="local_global"),
        VariantSpec("linear", "feature-map", False, "O(N C^2 + N F C)", "O(N F) chunked",
                    "state S [F, Dv] + z [F] per head", _linear, masks="causal, key padding",
                    pattern="feature"),
        VariantSpec("performer", "feature-map", False, "O(N C^2 + N F C)", "O(N F) chunked",
                    "state S [F, Dv] + z [F] per head", _performer, masks="causal, key padding",
                    pattern="feature"),
        VariantSpec("infini", "compressive", False, "O(N C^2 + N S C)", "O(N S)",
                    "memory M [D, Dv] + z [D] per head, plus the current segment", _infini, masks="causal",
                    pattern="compressive"),
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


@dataclass(frozen=True)
class VariantConfig:
    """The shape-relevant settings of a variant, with the registry's defaults filled in.

    ``window`` follows ``docs/conventions.md`` (``(left, right)``, ``None`` = unbounded side);
    ``num_features`` is ``F`` of the feature-map families; ``segment_len`` is Infini-attention's
    segment ``S``.
    """

    name: str
    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    window: tuple[int | None, int | None] | None = None
    global_tokens: tuple[int, ...] = ()
    num_features: int | None = None
    segment_len: int | None = None


#: Defaults the cost model assumes when a setting is not given (kept equal to the builders' and
#: the modules' defaults; ``tests/test_variants.py`` checks the ones it can).
COST_DEFAULTS: dict[str, dict[str, Any]] = {
    "sliding": {"window": 64},
    "local_global": {"window": 64, "global_tokens": (0,)},
    "performer": {"num_features": 256},
    "linear": {},  # elu + 1 feature map: F = head_dim
    "infini": {"segment_len": 2048},
}


def _pos_int(x: object, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} ({x!r})")
    if x < 1:
        raise ValueError(f"{name} must be >= 1, got {x}")
    return x


def resolve_config(name: str, dim: int, num_heads: int, **kwargs: Any) -> VariantConfig:
    """Fill in a variant's defaults exactly as :func:`build_attention` would build it.

    Args:
        name: one of :func:`variant_names`.
        dim: model width ``C``.
        num_heads: query heads ``H`` (must divide ``dim`` unless ``head_dim`` is given).
        **kwargs: ``num_kv_heads``, ``head_dim``, ``causal``, ``window`` (int or ``(left, right)``),
            ``global_tokens``, ``num_features``, ``segment_len``.
    """
    if not isinstance(name, str) or name not in VARIANTS:
        raise ValueError(f"unknown attention variant {name!r}; expected one of {variant_names()}")
    dim = _pos_int(dim, "dim")
    num_heads = _pos_int(num_heads, "num_heads")
    known = {"num_kv_heads", "head_dim", "causal", "window", "global_tokens", "num_features", "segment_len"}
    unknown = set(kwargs) - known
    if unknown:
        raise TypeError(f"resolve_config: unknown setting(s) {sorted(unknown)}; expected some of {sorted(known)}")
    kw = {**COST_DEFAULTS.get(name, {}), **{k: v for k, v in kwargs.items() if v is not None}}
    head_dim = kw.get("head_dim")
    if head_dim is None:
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}; pass head_dim")
        head_dim = dim // num_heads
    head_dim = _pos_int(head_dim, "head_dim")
    causal = kw.get("causal", True)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if name == "mha":
        kv = num_heads
    elif name == "mqa":
        kv = 1
    elif name == "gqa":
        kv = _pos_int(kw.get("num_kv_heads") or default_kv_heads(num_heads), "num_kv_heads")
        if num_heads % kv:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={kv}")
    else:
        kv = _pos_int(kw.get("num_kv_heads") or num_heads, "num_kv_heads")
        if num_heads % kv:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={kv}")
    window = None
    if VARIANTS[name].pattern in ("window", "local_global"):
        from attnzoo.functional._request import normalize_window

        w = kw.get("window")
        window = normalize_window((w, 0) if isinstance(w, int) and causal else w)
    globals_: tuple[int, ...] = ()
    if VARIANTS[name].pattern == "local_global":
        globals_ = tuple(int(g) for g in kw.get("global_tokens", ()))
    nf = None
    if VARIANTS[name].pattern == "feature":
        nf = _pos_int(kw.get("num_features") or head_dim, "num_features")
    seg = None
    if VARIANTS[name].pattern == "compressive":
        seg = _pos_int(kw.get("segment_len"), "segment_len")
    return VariantConfig(name=name, dim=dim, num_heads=num_heads, num_kv_heads=kv, head_dim=head_dim,
                         causal=causal, window=window, global_tokens=globals_, num_features=nf,
                         segment_len=seg)


def kv_cache_bytes_per_token(name: str, dim: int, num_heads: int, dtype_bytes: int = 2, **kwargs: Any) -> int:
    """Decode-cache bytes one more token adds to one layer (0 for fixed-size states).

    Softmax variants store ``2 * Hkv * D`` numbers per token (a sliding window stops growing at
    ``W`` tokens); feature-map and compressive variants keep a state whose size does not grow.
    See :func:`attnzoo.cost.estimate` for the full cache size at a given length.
    """
    cfg = resolve_config(name, dim, num_heads, **kwargs)
    if VARIANTS[name].family != "softmax":
        return 0
    return 2 * cfg.num_kv_heads * cfg.head_dim * _pos_int(dtype_bytes, "dtype_bytes")
