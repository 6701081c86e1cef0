"""A dense float64 attention oracle written straight from ``docs/conventions.md``.

It shares no plumbing with the rest of attnzoo (no request object, no mask algebra, no ALiBi or
visibility helper; it imports only torch): every rule of the conventions page is materialised here
with plain torch ops. The only thing it takes from a caller's mask is a ``Mask``'s predicate,
called as documented, ``mask(b, h, q_pos, k_pos) -> bool``, on index grids. ``attnzoo check``
and the backend grid tests compare every backend against it, so a bug in the shared mask/ALiBi
code cannot hide on both sides::

    from attnzoo.oracle import oracle_attention
    out, lse = oracle_attention(q, k, v, causal=True, window=(8, 0))   # float64 [B, Hq, Nq, Dv], [B, Hq, Nq]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["oracle_attention", "visible_table"]


def _window_sides(window: int | tuple[int | None, int | None] | None) -> tuple[int | None, int | None]:
    """``w`` means ``(w, w)``; ``None`` means both sides unbounded."""
    if window is None:
        return None, None
    if isinstance(window, int) and not isinstance(window, bool) and window >= 0:
        return window, window
    if (isinstance(window, tuple) and len(window) == 2
            and all(w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 0) for w in window)):
        return window[0], window[1]
    raise ValueError(f"oracle: window must be None, an int >= 0 or a (left, right) pair of them, got {window!r}")


def _tensor4(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"oracle: {name} must be a floating-point tensor [B, H, N, D], got {got}")
    if t.dim() != 4:
        raise ValueError(f"oracle: {name} must be [B, H, N, D], got shape {tuple(t.shape)}")
    return t


def _check_inputs(q: object, k: object, v: object, alibi_slopes: object) -> None:
    """The oracle's own boundary checks (kept apart from attnzoo's validators, like the rest of it)."""
    qs, ks, vs = (tuple(_tensor4(name, t).shape) for name, t in (("q", q), ("k", k), ("v", v)))
    (b, hq, _, d), (bk, hkv, nk, dk), (bv, hv, nv, _) = qs, ks, vs
    if (bk, bv) != (b, b) or hv != hkv or nv != nk or dk != d or hkv == 0 or hq % hkv:
        raise ValueError(f"oracle: expected q [B, Hq, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] with "
                         f"Hq % Hkv == 0, got q {qs}, k {ks}, v {vs}")
    if alibi_slopes is not None and (not isinstance(alibi_slopes, Tensor) or tuple(alibi_slopes.shape) != (hq,)):
        got = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, Tensor) else type(alibi_slopes).__name__
        raise ValueError(f"oracle: alibi_slopes must be a tensor [Hq] = [{hq}], got {got}")


def visible_table(b: int, hq: int, nq: int, nk: int, *, causal: bool = False,
                  window: int | tuple[int | None, int | None] | None = None, q_offset: int | None = None,
                  mask: Tensor | Callable[..., Tensor] | None = None) -> Tensor:
    """Bool ``[B, Hq, Nq, Nk]``: True where the query may attend (causal, window, bool mask, Mask)."""
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in (b, hq, nq, nk)):
        raise ValueError(f"oracle: b, hq, nq, nk must be ints >= 0, got {(b, hq, nq, nk)}")
    if isinstance(mask, Tensor) and (mask.dim() > 4 or any(
            m not in (1, n) for m, n in zip(mask.shape[::-1], (nk, nq, hq, b), strict=False))):
        raise ValueError(f"oracle: mask must broadcast to [B, Hq, Nq, Nk] = {[b, hq, nq, nk]}, got {tuple(mask.shape)}")
    off = nk - nq if q_offset is None else q_offset  # bottom-right alignment by default
    p = (off + torch.arange(nq)).view(1, 1, nq, 1)  # query positions
    j = torch.arange(nk).view(1, 1, 1, nk)  # key positions
    ok = torch.ones(b, hq, nq, nk, dtype=torch.bool)
    if causal:
        ok &= j <= p
    left, right = _window_sides(window)
    if left is not None:
        ok &= j >= p - left
    if right is not None:
        ok &= j <= p + right
    if isinstance(mask, Tensor) and mask.dtype == torch.bool:
        ok &= mask.expand(b, hq, nq, nk)
    elif mask is not None and not isinstance(mask, Tensor):  # a Mask: its predicate on index grids
        bb = torch.arange(b).view(b, 1, 1, 1)
        hh = torch.arange(hq).view(1, hq, 1, 1)
        ok &= mask(bb, hh, p, j).expand(b, hq, nq, nk)
    return ok


def oracle_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Callable[..., Tensor] | None = None,
                     causal: bool = False, window: int | tuple[int | None, int | None] | None = None,
                     q_offset: int | None = None, scale: float | None = None, softcap: float | None = None,
                     alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq])`` in float64, differentiable in q, k, v.

    Rules (``docs/conventions.md``): scores ``scale * q k^T`` (default ``1/sqrt(D)``), then the
    softcap ``c * tanh(s / c)``, then additive biases (ALiBi ``-slope_h * |p - j|``, a float mask),
    then the visibility rules; query head ``h`` reads KV head ``h // (Hq / Hkv)``; a row with no
    visible key gives zeros and LSE ``-inf``.
    """
    _check_inputs(q, k, v, alibi_slopes)
    q, k, v = q.double(), k.double(), v.double()
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    kv_head = torch.arange(hq) // (hq // hkv)  # GQA: which KV head each query head reads
    k_h, v_h = k[:, kv_head], v[:, kv_head]  # [B, Hq, Nk, D|Dv]
    ok = visible_table(b, hq, nq, nk, causal=causal, window=window, q_offset=q_offset, mask=mask)
    s = torch.matmul(q, k_h.transpose(-1, -2)) * (1.0 / math.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    off = nk - nq if q_offset is None else q_offset
    if alibi_slopes is not None:
        dist = ((off + torch.arange(nq)).view(-1, 1) - torch.arange(nk).view(1, -1)).abs().double()
        s = s - alibi_slopes.double().view(1, hq, 1, 1) * dist
    if isinstance(mask, Tensor) and mask.is_floating_point():
        s = s + mask.double()
    ok &= s > float("-inf")  # a float mask's -inf hides a key too
    s = s.masked_fill(~ok, float("-inf"))
    # row maxima; a row of no keys at all (Nk = 0) has none: -inf, like a row whose keys are all hidden
    m = s.detach().amax(dim=-1, keepdim=True) if nk else s.new_full((*s.shape[:-1], 1), float("-inf"))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)  # 0 where hidden
    denom = e.sum(dim=-1, keepdim=True)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = torch.where(denom > 0, torch.log(safe) + m, torch.full_like(denom, float("-inf"))).squeeze(-1)
    return torch.matmul(e / safe, v_h), lse
