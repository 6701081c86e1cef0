"""Analytic cost of one attention layer: FLOPs, bytes moved, activation memory and KV-cache size.

:func:`estimate` turns a registered variant (:mod:`attnzoo.variants`) and a shape into numbers,
following the complexity analysis of the seed texts:

* projections ``Q, K, V, O``: ``O(N C^2)``, exactly ``2 B N C (Hq + 2 Hkv) D + 2 B N Hq Dv C``;
* softmax scores and the weighted sum: ``2 B Hq (D + Dv)`` FLOPs per *computed* (query, key)
  pair: ``O(N^2 C)`` dense, ``O(N W C)`` for a window, ``O(N (W + G) C)`` with global tokens;
* feature-map attention: ``O(N F C)`` (``F`` features per head); Infini-attention: a causal
  softmax inside each segment of ``S`` tokens plus a ``D x Dv`` memory per head.

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

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attnzoo.variants import VARIANTS, VariantConfig, resolve_config, variant_names

__all__ = ["CostEstimate", "dtype_from_name", "estimate", "measure_activation_bytes", "visible_pairs"]

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


# --------------------------------------------------------------------------- visible pairs
def _window_counts(n: int, window: tuple[int | None, int | None] | None, causal: bool) -> torch.Tensor:
    """Visible keys per query row of a self-attention over ``n`` tokens: int64 ``[n]``."""
    p = torch.arange(n, dtype=torch.int64)
    lo = torch.zeros_like(p)
    hi = torch.full_like(p, n - 1)
    if window is not None:
        left, right = window
        if left is not None:
            lo = torch.clamp(p - left, min=0)
        if right is not None:
            hi = torch.clamp(p + right, max=n - 1)
    if causal:
        hi = torch.minimum(hi, p)
    return torch.clamp(hi - lo + 1, min=0)


def visible_pairs(cfg: VariantConfig, seq_len: int) -> int:
    """Number of (query, key) pairs a softmax variant lets attend, per batch element and head."""
    n = seq_len
    pattern = VARIANTS[cfg.name].pattern
    if pattern in ("dense", "feature"):
        return n * (n + 1) // 2 if cfg.causal else n * n
    if pattern == "compressive":
        s = cfg.segment_len or n
        full, rest = divmod(n, s)
        return full * s * (s + 1) // 2 + rest * (rest + 1) // 2
    counts = _window_counts(n, cfg.window, cfg.causal)
    if pattern == "window" or not cfg.global_tokens:
        return int(counts.sum())
    # local_global: causal? & (window | global): add the global columns outside each row's window,
    # then make the global rows full.
    g = torch.tensor(sorted({t for t in cfg.global_tokens if 0 <= t < n}), dtype=torch.int64)
    if g.numel() == 0:
        return int(counts.sum())
    p = torch.arange(n, dtype=torch.int64).view(-1, 1)
    left, right = cfg.window if cfg.window is not None else (None, None)
    in_win = torch.ones(n, g.numel(), dtype=torch.bool)
    if left is not None:
        in_win &= g.view(1, -1) >= p - left
    if right is not None:
        in_win &= g.view(1, -1) <= p + right
    visible_col = g.view(1, -1) <= p if cfg.causal else torch.ones_like(in_win)
    extra = (visible_col & ~in_win).sum(dim=1)
    rows = counts + extra
    full_row = (p.view(-1) + 1) if cfg.causal else torch.full((n,), n, dtype=torch.int64)
    rows[g] = full_row[g]
    return int(rows.sum())


def _fake_request(cfg: VariantConfig, batch: int, n: int, dtype: torch.dtype) -> Any:
    from attnzoo.functional._request import build_request
    from attnzoo.masks import global_tokens, sliding_window

    one = torch.zeros(1, 1, 1, 1, dtype=dtype)
    q = one.expand(batch, cfg.num_heads, n, cfg.head_dim)  # no memory: stride-0 views
    k = one.expand(batch, cfg.num_kv_heads, n, cfg.head_dim)
    mask = None
    window = cfg.window
    if cfg.global_tokens and VARIANTS[cfg.name].pattern == "local_global":
        w = cfg.window if cfg.window is not None else (None, None)
        mask = sliding_window(*w) | global_tokens(list(cfg.global_tokens))
        window = None
    return build_request(q, k, k, mask=mask, causal=cfg.causal, window=window, q_offset=None, scale=None,
                         softcap=None, alibi_slopes=None, dropout_p=0.0, return_lse=False, return_weights=False)


def _computed_pairs(cfg: VariantConfig, batch: int, n: int, backend: str, dtype: torch.dtype) -> tuple[int, str]:
    """Pairs the backend computes per (batch, head), and the backend actually meant."""
    if backend == "auto":
        from attnzoo.functional.attention import choose_backend

        backend = choose_backend(_fake_request(cfg, batch, n, dtype))
    if backend == "ideal":
        return visible_pairs(cfg, n), backend
    if backend in ("reference", "sdpa", "flash"):
        return n * n, backend
    r = _fake_request(cfg, batch, n, dtype)
    if backend == "tiled":
        from attnzoo.functional.tiled import tile_plan

        plan = tile_plan(r)
        total = 0
        for i, chunks in enumerate(plan.rows):
            rows = min(n, (i + 1) * plan.block_q) - i * plan.block_q
            total += rows * sum(c.k_hi - c.k_lo for c in chunks)
        return total, backend
    # flex: every non-empty 128 x 128 block is computed in full
    s = r.structure
    if s is None:
        return n * n, backend
    bm = s.block_map(1, 1, n, n, 128, 128)
    return int((bm != 0).sum()) * 128 * 128, backend


# --------------------------------------------------------------------------- the estimate
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
        num_kv_heads, window, global_tokens, num_features, segment_len: the variant's settings;
            missing ones take the registry defaults (:func:`attnzoo.variants.resolve_config`).
        chunk_size: chunk of the chunked causal feature-map form (default 64, the modules' default).
        causal: causal self-attention (default, as in the registry).
        dtype: storage dtype of activations, weights and cache (``"float32"``, ``"bf16"``...).
        backend: whose computed pairs to count for softmax variants: ``"auto"`` (what
            :func:`attnzoo.attention` would pick), ``"reference"``/``"sdpa"`` (dense),
            ``"tiled"``, ``"flex"``, or ``"ideal"`` (visible pairs only).

    Returns:
        A :class:`CostEstimate`.
    """
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"variant must be one of {variant_names()}, got {variant!r}")
    for name, val in (("seq_len", seq_len), ("batch", batch)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {type(val).__name__} ({val!r})")
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    dt = dtype_from_name(dtype)
    e = torch.finfo(dt).bits // 8
    cfg = resolve_config(variant, dim, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, window=window,
                         global_tokens=global_tokens, num_features=num_features, segment_len=segment_len,
                         causal=causal)
    spec = VARIANTS[variant]
    B, N, C = batch, seq_len, cfg.dim
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    Dv = D
    inner_q, inner_kv = Hq * D, Hkv * D

    params = C * inner_q + 2 * C * inner_kv + inner_q * C
    flops_proj = 2 * B * N * C * (inner_q + 2 * inner_kv) + 2 * B * N * inner_q * C
    acc = 8 if dt == torch.float64 else 4  # softmax / accumulation bytes
    qkv_bytes = B * N * (inner_q + 2 * inner_kv) * e
    io_bytes = 2 * B * N * C * e + params * e  # read x, write y, read the weights

    pairs_visible = visible_pairs(cfg, N)
    flops_useful = 2 * B * Hq * pairs_visible * (D + Dv)
    kv_max: int | None = None
    if spec.family == "softmax":
        pairs, used = _computed_pairs(cfg, B, N, backend, dt)
        # the tiled kernel multiplies P by [V | 1] (one extra column gives the softmax normaliser)
        flops_attn = 2 * B * Hq * pairs * (D + Dv + (1 if used == "tiled" else 0))
        materialised = used == "reference"
        per_token = 2 * Hkv * D * e
        if spec.pattern == "window" and cfg.window is not None and cfg.window[0] is not None:
            kv_max = cfg.window[0] + 1
        cached = N if kv_max is None else min(N, kv_max)
        kv_bytes = B * cached * per_token
        # saved for backward: x, q/k/v, the head-merged output, plus the backend's residue
        act = B * N * C * e + qkv_bytes + B * N * inner_q * e
        score_bytes = B * Hq * N * N * acc
        if materialised:
            # raw scores (kept by the row max), exp-scores and probabilities, and the bool mask
            act += 3 * score_bytes + (N * N if (causal or cfg.window is not None) else 0)
            traffic = 4 * score_bytes  # write S, read S, write P, read P
        elif used == "sdpa":
            # torch's CPU kernel writes its output already in [B, N, H, D] order, so the merged
            # output is the same storage; any mask beyond plain causal becomes a dense float mask.
            act += B * Hq * N * acc + (N * N * e if spec.pattern != "dense" else 0)
            traffic = 0
        else:
            act += B * Hq * N * Dv * e + B * Hq * N * acc  # kernel output and LSE
            traffic = 0
        bwd = 2 * flops_attn if materialised else (5 * flops_attn) // 2
    elif spec.pattern == "feature":
        used = "feature-map"
        F = cfg.num_features or D
        if chunk_size is None and causal:
            chunk_size = 64  # the modules' default chunk of the causal form
        flops_attn = 0
        if variant == "performer":
            flops_attn += 2 * B * Hq * N * D * F + 2 * B * Hkv * N * D * F  # random-feature maps
        if causal and chunk_size is not None:
            c = min(chunk_size, N)
            n_pad = -(-N // c) * c  # the last chunk is padded
            flops_attn += 2 * B * Hq * n_pad * c * (F + Dv + 1)  # intra-chunk scores, times [V | 1]
            flops_attn += 2 * B * Hq * n_pad * F * (Dv + 1) * 2  # read and update the running state
        else:
            flops_attn += 2 * B * Hq * N * F * (Dv + 1) * 2  # phi(K)^T [V | 1], then phi(Q) (KV) with normaliser
        flops_useful = flops_attn
        pairs = pairs_visible
        per_token = 0
        kv_bytes = B * Hkv * (F * Dv + F) * acc
        base = B * N * C * e + qkv_bytes + B * N * inner_q * e
        bh = B * Hq
        if causal and chunk_size is not None:
            c = min(chunk_size, N)
            n_pad = -(-N // c) * c
            # features of q and k (token and chunk layouts), the masked c x c score tile of every
            # chunk, [V | 1], chunk outputs and normalisers, and the running state at each chunk
            tok_feats = 2 * bh * N * F * acc if variant == "performer" else 0  # random features, token layout
            act = (base + tok_feats + 2 * bh * n_pad * F * acc + bh * n_pad * c * acc
                   + bh * n_pad * (2 * Dv + 3) * acc + (n_pad // c) * bh * F * (Dv + 1) * acc)
        else:
            act = base + 2 * bh * N * F * acc + bh * F * (Dv + 1) * acc + bh * N * (Dv + 1) * acc
        traffic = 2 * B * Hq * F * Dv * acc
        bwd = 2 * flops_attn
    else:  # compressive (Infini-attention)
        used = "infini"
        S = min(cfg.segment_len or N, N)
        flops_local = 2 * B * Hq * (N // S * S * S + (N % S) ** 2) * (D + Dv)
        flops_mem = 2 * B * Hq * N * D * (Dv + 1) * 2  # retrieve sigma(Q) M, update M += sigma(K)^T V
        flops_attn = flops_local + flops_mem
        flops_useful = 2 * B * Hq * pairs_visible * (D + Dv) + flops_mem
        pairs = pairs_visible
        per_token = 0
        kv_max = S
        kv_bytes = B * Hkv * (D * Dv + D) * acc + B * min(N, S) * 2 * Hkv * D * e
        # the local softmax runs on a fused kernel (O(S) residue); per token the module keeps the
        # segment's q/k/v views, sigma(q), sigma(k) and the retrieved memory readout
        act = B * N * C * e + qkv_bytes + B * N * inner_q * e + 5 * B * Hq * N * D * acc
        traffic = 4 * B * Hq * N * S * acc
        bwd = 2 * flops_attn
    flops = flops_proj + flops_attn
    return CostEstimate(
        variant=variant, backend=used, batch=B, seq_len=N, dim=C, num_heads=Hq, num_kv_heads=Hkv, head_dim=D,
        dtype=str(dt).replace("torch.", ""),
        flops_projections=flops_proj, flops_attention=flops_attn, flops_useful=flops_useful, flops=flops,
        flops_backward=2 * flops_proj + bwd,
        bytes_moved=io_bytes + 2 * qkv_bytes + 2 * B * N * inner_q * e + traffic,
        activation_bytes=act, kv_cache_bytes_per_token=per_token, kv_cache_bytes=kv_bytes,
        kv_cache_max_tokens=kv_max, params=params, visible_fraction=pairs_visible / (N * N),
    )


# --------------------------------------------------------------------------- measuring
def measure_activation_bytes(fn: Callable[[], Any], exclude: Any = ()) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs.

    Each storage is counted once (views share it); tensors in ``exclude`` (e.g. a module's
    parameters) and their storages are left out. This is the quantity
    :attr:`CostEstimate.activation_bytes` predicts.
    """
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
