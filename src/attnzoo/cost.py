"""Analytic cost of one attention layer: FLOPs, bytes moved, activation memory and KV-cache size.

:func:`estimate` turns a registered variant (:mod:`attnzoo.variants`) and a shape into numbers,
following the complexity analysis of the seed texts:

* projections ``Q, K, V, O``: ``O(N C^2)``, exactly ``2 B N C (Hq + 2 Hkv) D + 2 B N Hq Dv C``;
* softmax scores and the weighted sum: ``2 B Hq (D + Dv)`` FLOPs per *computed* (query, key)
  pair: ``O(N^2 C)`` dense, ``O(N W C)`` for a window, ``O(N (W + G) C)`` with global tokens;
* feature-map attention: ``O(N F C)`` (``F`` features per head); Infini-attention: a causal
  softmax inside each segment of ``S`` tokens plus a ``D x Dv`` memory per head.

Each variant's own cost function (declared in its spec, next to its module class) computes these
numbers in closed form (Python ints, no tensors: instant even at ``N = 10^9``); this module
validates the request, resolves the config and assembles a :class:`CostEstimate`.

FLOPs count multiply-adds as 2, like :class:`torch.utils.flop_counter.FlopCounterMode` (which
counts matrix products only; softmax, masking and element-wise work are left out here too).
Which pairs are *computed* depends on the backend: dense kernels (``reference``, ``sdpa``)
compute all ``Nq x Nk`` scores and mask afterwards; ``tiled`` computes the key chunks its tile
plan visits; ``flex`` the non-empty ``128 x 128`` blocks; ``ideal`` only the visible pairs (the
work a perfect sparse kernel would do; also reported as ``flops_useful``).

Activation memory is what one training forward keeps alive for backward (the tensors autograd
saves, counted once per storage, parameters excluded): the input, the projections, the output
before ``out_proj`` and the backend's own residue (the ``[B, Hq, Nq, Nk]`` probabilities for
``reference``; output and LSE for the fused and tiled kernels). :func:`measure_activation_bytes`
measures the same quantity on a real module; ``tests/test_cost.py`` holds the two within 25%.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attnzoo._validate import check_int, check_optional_int
from attnzoo.nn.costs import visible_pairs as _visible_pairs
from attnzoo.nn.spec import CostShape, VariantConfig
from attnzoo.variants import VARIANTS, layer_pattern, resolve_config, variant_names

__all__ = ["CostEstimate", "StackEstimate", "dtype_from_name", "estimate", "estimate_stack", "measure_activation_bytes",
           "visible_pairs"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}
_BACKENDS = ("auto", "ideal", "reference", "sdpa", "tiled", "flex", "flash")


def dtype_from_name(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` ... -> ``torch.dtype`` (ValueError otherwise)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


@dataclass(frozen=True)
class CostEstimate:
    """Cost of one forward (and backward) of one attention layer on ``[B, N, C]``.

    All FLOP counts are multiply-adds x 2 of matrix products; bytes are for ``dtype``.
    """

    variant: str
    backend: str  # the backend whose computed pairs the attention FLOPs count
    batch: int
    seq_len: int
    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    flops_projections: int  # Q, K, V and output projections (forward)
    flops_attention: int  # scores + weighted sum as computed by `backend` (forward)
    flops_useful: int  # scores + weighted sum over visible pairs only
    flops: int  # forward total = projections + attention
    flops_backward: int  # backward total (gradients of inputs and weights)
    bytes_moved: int  # minimum memory traffic of one forward (weights, activations, score matrix if materialised)
    activation_bytes: int  # kept alive for backward by one training forward
    kv_cache_bytes_per_token: int  # what one more decoded token adds to the cache (0: fixed-size state)
    kv_cache_bytes: int  # cache (or recurrent state) after `seq_len` tokens, whole batch
    kv_cache_max_tokens: int | None  # tokens the cache holds at most (None: unbounded)
    params: int  # parameters of the layer (weights; biases ignored)
    visible_fraction: float  # visible pairs / (Nq x Nk)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready)."""
        return asdict(self)

    @property
    def arithmetic_intensity(self) -> float:
        """Forward FLOPs per byte moved."""
        return self.flops / max(1, self.bytes_moved)


def visible_pairs(cfg: VariantConfig, seq_len: int) -> int:
    """Number of (query, key) pairs the config lets attend, per batch element and head (closed-form)."""
    if not isinstance(cfg, VariantConfig):
        raise TypeError(f"visible_pairs: cfg must be an attnzoo.nn.spec.VariantConfig, "
                        f"got {type(cfg).__name__}")
    return _visible_pairs(cfg, check_int(seq_len, "seq_len"))


def estimate(
    variant: str,
    seq_len: int,
    dim: int,
    num_heads: int,
    *,
    batch: int = 1,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    global_tokens: tuple[int, ...] | None = None,
    num_features: int | None = None,
    segment_len: int | None = None,
    chunk_size: int | None = None,
    causal: bool = True,
    dtype: str | torch.dtype = "float32",
    backend: str = "auto",
) -> CostEstimate:
    """Analytic cost of one attention layer of ``variant`` on ``[B, N, C] = [batch, seq_len, dim]``.

    Args:
        variant: a registered name (``attnzoo list``): ``mha``, ``gqa``, ``sliding``, ``linear``...
        seq_len: tokens ``N`` (self-attention).
        dim: model width ``C``.
        num_heads: query heads ``Hq``; ``head_dim`` defaults to ``C / Hq``.
        batch: ``B``.
        num_kv_heads, window, global_tokens, num_features, segment_len, chunk_size: the variant's
            settings (``None``: its defaults, :func:`attnzoo.variants.resolve_config`). A setting
            that does not apply to the variant (``window`` for ``mha``...) raises ``ValueError``.
        causal: causal self-attention (default, as in the registry); ``False`` raises for a
            variant that is causal by construction.
        dtype: storage dtype of activations, weights and cache (``"float32"``, ``"bf16"``...).
        backend: whose computed pairs to count for softmax variants: ``"auto"`` (the CPU policy
            of :func:`attnzoo.attention`), ``"reference"``/``"sdpa"`` (dense), ``"tiled"``,
            ``"flex"``, or ``"ideal"`` (visible pairs only).

    Returns:
        A :class:`CostEstimate`.
    """
    if not isinstance(variant, str) or variant not in VARIANTS:
        hint = "; a stack of layers ('a/b/c') is estimate_stack's" if isinstance(variant, str) and "/" in variant else ""
        raise ValueError(f"variant must be one of {variant_names()}, got {variant!r}{hint}")
    check_int(seq_len, "seq_len")
    check_int(batch, "batch")
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    check_optional_int(chunk_size, "chunk_size")
    dt = dtype_from_name(dtype)
    e = torch.finfo(dt).bits // 8
    spec = VARIANTS[variant]
    cfg = resolve_config(variant, dim, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, window=window,
                         global_tokens=global_tokens, num_features=num_features, segment_len=segment_len,
                         chunk_size=chunk_size, causal=causal)
    shape = CostShape(batch=batch, seq_len=seq_len, elem_bytes=e, acc_bytes=8 if e == 8 else 4, backend=backend)
    c = spec.cost(cfg, shape)
    return CostEstimate(
        variant=variant, backend=c.backend, batch=batch, seq_len=seq_len, dim=cfg.dim, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=str(dt).replace("torch.", ""),
        flops_projections=c.flops_projections, flops_attention=c.flops_attention, flops_useful=c.flops_useful,
        flops=c.flops_projections + c.flops_attention, flops_backward=c.flops_backward,
        bytes_moved=c.bytes_moved, activation_bytes=c.activation_bytes,
        kv_cache_bytes_per_token=c.kv_cache_bytes_per_token, kv_cache_bytes=c.kv_cache_bytes,
        kv_cache_max_tokens=c.kv_cache_max_tokens, params=c.params,
        visible_fraction=c.visible_pairs / (seq_len * seq_len),
    )


#: The :func:`estimate` settings that belong to a variant (a stack hands each to the layers that take it).
_LAYER_SETTINGS = ("num_kv_heads", "window", "global_tokens", "num_features", "segment_len", "chunk_size")
#: The :class:`StackEstimate` totals: sums of the layers' :class:`CostEstimate` fields.
_SUMMED = ("flops_projections", "flops_attention", "flops_useful", "flops", "flops_backward", "bytes_moved",
           "activation_bytes", "kv_cache_bytes_per_token", "kv_cache_bytes", "params")


@dataclass(frozen=True)
class StackEstimate:
    """Cost of one forward (and backward) of a stack of attention layers, one :class:`CostEstimate`
    per layer (``layers``) and their sums as attributes (``flops``, ``kv_cache_bytes``, ``params``,
    ...: the fields of :class:`CostEstimate` that add up across layers). A hybrid stack's decode
    state is ``kv_cache_bytes``: the softmax layers' caches grow with ``seq_len``, the recurrent
    layers' states do not."""

    pattern: tuple[str, ...]
    layers: tuple[CostEstimate, ...]

    def __getattr__(self, name: str) -> int:
        if name in _SUMMED:
            return sum(getattr(layer, name) for layer in self.layers)
        raise AttributeError(f"StackEstimate has no attribute {name!r}")

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready): the pattern, the totals and every layer's estimate."""
        return {"pattern": "/".join(self.pattern), **{n: getattr(self, n) for n in _SUMMED},
                "layers": [layer.as_dict() for layer in self.layers]}


def estimate_stack(pattern: str | Sequence[str], seq_len: int, dim: int, num_heads: int, *,
                   depth: int | None = None, **settings: Any) -> StackEstimate:
    """Analytic cost of a stack of layers, e.g. a hybrid ``"gated_deltanet/gated_deltanet/gated_deltanet/mha"``.

    Args:
        pattern: a registry name, a ``/``-separated pattern or a list of names
            (:func:`attnzoo.variants.layer_pattern`), cycled to ``depth``.
        seq_len, dim, num_heads: as :func:`estimate`.
        depth: layers of the stack (default: the pattern's length).
        **settings: the keywords of :func:`estimate`; a variant setting (``num_kv_heads``,
            ``window``, ``num_features``, ...) goes to the layers whose variant takes it (one that no
            layer takes is a ``ValueError``, as :func:`estimate` refuses it for one variant), the
            others (``batch``, ``head_dim``, ``causal``, ``dtype``, ``backend``) to every layer.

    Returns:
        A :class:`StackEstimate`.
    """
    n_entries = len(pattern.split("/")) if isinstance(pattern, str) else len(pattern)
    names = layer_pattern(pattern, n_entries if depth is None else depth)
    unknown = sorted(set(settings) - set(_LAYER_SETTINGS) - {"batch", "head_dim", "causal", "dtype", "backend"})
    if unknown:
        raise TypeError(f"estimate_stack: unknown setting(s) {unknown}")
    unused = sorted(k for k in settings if k in _LAYER_SETTINGS and settings[k] is not None
                    and not any(k in VARIANTS[n].options for n in names))
    if unused:
        raise ValueError(f"estimate_stack: setting(s) {unused} apply to no layer of {'/'.join(dict.fromkeys(names))} "
                         f"(each variant's settings: attnzoo list)")
    per_name: dict[str, CostEstimate] = {}
    for name in dict.fromkeys(names):
        own = {k: v for k, v in settings.items() if k not in _LAYER_SETTINGS or k in VARIANTS[name].options}
        per_name[name] = estimate(name, seq_len, dim, num_heads, **own)
    return StackEstimate(names, tuple(per_name[n] for n in names))


# --------------------------------------------------------------------------- measuring
def measure_activation_bytes(fn: Callable[[], Any], exclude: Any = ()) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs.

    Each storage is counted once (views share it); tensors in ``exclude`` (e.g. a module's
    parameters) and their storages are left out. This is the quantity
    :attr:`CostEstimate.activation_bytes` predicts.
    """
    exclude = list(exclude)
    if not all(isinstance(t, torch.Tensor) for t in exclude):
        raise TypeError(f"measure_activation_bytes: exclude must hold tensors (e.g. model.parameters()), "
                        f"got {sorted({type(t).__name__ for t in exclude if not isinstance(t, torch.Tensor)})}")
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())
