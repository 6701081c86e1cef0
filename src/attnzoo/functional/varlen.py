"""Variable-length (packed) attention: ``attention_varlen`` over sequences laid end to end.

``S`` sequences are packed along one token axis: queries ``[Tq, Hq, D]`` with sequence ``i`` at
rows ``cu_seqlens_q[i] : cu_seqlens_q[i+1]``, keys/values ``[Tk, Hkv, D|Dv]`` likewise with
``cu_seqlens_k``. The result equals calling :func:`attnzoo.attention` on every sequence alone,
each bottom-right aligned (``q_offset = n_k_i - n_q_i``), forward and backward.

Fast path: one call of the ``tiled`` backend on the packed ``[1, H, T, D]`` tensors with a
:class:`~attnzoo.masks.Mask` that allows a pair only inside one sequence (and, per sequence, the
aligned causal / window constraint). The mask classifies tiles from the sequence boundaries, so
every tile whose queries and keys lie in different sequences is empty and skipped: the work
grows with ``sum_i n_q_i * n_k_i``, not ``Tq * Tk``. Other backends (and ALiBi with
``cu_seqlens_q != cu_seqlens_k``, whose distances are per sequence) run one call per sequence.
Semantics drawn for small N: ``docs/softmax-frontier.md``.

Under ``torch.compile`` / ``torch.export`` the sequence boundaries are tensor data, so the call runs
once on the packed tensors with a dense ``[Tq, Tk]`` mask built by tensor ops (exact, no graph
break, but ``O(Tq x Tk)`` memory) when gradients are needed; inference runs the eager call as one
custom operator (``attnzoo::varlen_fwd``). The checks on ``cu_seqlens`` values run in eager mode only.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from attnzoo.functional._request import Window, check_qkv, normalize_window
from attnzoo.functional.attention import BACKENDS, attention
from attnzoo.functional.rules import alibi_bias
from attnzoo.masks import Mask

__all__ = ["attention_varlen", "varlen_fwd", "varlen_mask"]

#: Backends that run the packed tensors in one call (they consume a Mask and skip empty tiles).
PACKED_BACKENDS = ("tiled", "flex")


def _check_cu(cu: object, name: str, total: int, device: torch.device) -> Tensor:
    """Validate cumulative lengths: int32 ``[S+1]``, starting at 0, non-decreasing, ending at ``total``."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be an int32 tensor [S+1], got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (as flash-attn's varlen API), got {cu.dtype}; "
                        f"use .to(torch.int32)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-d [S+1] with S >= 1 sequences, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if not torch.compiler.is_compiling():
        values = cu.tolist()
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {values[0]} ({name}={values})")
        if any(b < a for a, b in itertools.pairwise(values)):
            raise ValueError(f"{name} must be non-decreasing, got {values}")
        if values[-1] != total:
            raise ValueError(f"{name} must end at the number of packed tokens {total}, got {values[-1]} "
                             f"({name}={values})")
    return cu


def _check_packed(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be rank 3 [T, H, D] (packed tokens), got shape {tuple(t.shape)}")


def _row_intervals(cu_q: Tensor, cu_k: Tensor, tq: int, causal: bool, window: Window | None,
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Per packed query row ``r`` of ``tq``, the inclusive range ``lo[r] .. hi[r]`` of packed keys it
    may see (``lo > hi``: none) and its aligned key position ``a[r] = r + shift_s`` (row ``r`` of
    sequence ``s``, ``shift_s = cu_k[s+1] - cu_q[s+1]``: bottom-right alignment inside the sequence)."""
    seq = torch.searchsorted(cu_q[1:], torch.arange(tq, device=cu_q.device), right=True)  # [Tq]
    lo, hi = cu_k[seq], cu_k[seq + 1] - 1  # the sequence's keys
    a = torch.arange(tq, device=cu_q.device) + cu_k[seq + 1] - cu_q[seq + 1]  # aligned key position
    left, right = (None, None) if window is None else window
    if causal:
        hi = torch.minimum(hi, a)
    if left is not None:
        lo = torch.maximum(lo, a - left)
    if right is not None:
        hi = torch.minimum(hi, a + right)
    return lo, hi, a


def varlen_mask(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *, causal: bool = False,
                window: Window | None = None) -> Mask:
    """The packed pattern as a :class:`~attnzoo.masks.Mask` over packed row indices (``q_offset=0``).

    Query row ``r`` of sequence ``s`` may see key ``j`` iff ``j`` lies in sequence ``s`` and, with
    ``d = j - r - shift_s`` (``shift_s = cu_k[s+1] - cu_q[s+1]``, bottom-right alignment),
    ``d <= 0`` (causal) and ``-left <= d <= right`` (window). All of it is one interval of keys
    per row, ``lo[r] <= j <= hi[r]``, so the predicate is two comparisons and a tile is classified
    exactly as full (every row's interval covers it) and as empty whenever the hull of its rows'
    intervals misses it: every tile between two different sequences is empty.
    """
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    tq = int(cu_q[-1])
    lo, hi, _ = _row_intervals(cu_q, cu_k, tq, causal, window)
    big = int(cu_k[-1]) + 1
    lo_seen = torch.where(lo <= hi, lo, big)  # rows that see nothing drop out of the hull
    hi_seen = torch.where(lo <= hi, hi, -1)

    def fn(b: Tensor, h: Tensor, qp: Tensor, kp: Tensor) -> Tensor:
        r = qp.clamp(0, max(0, tq - 1))
        return (kp >= lo[r]) & (kp <= hi[r])

    def tiles(t: object) -> tuple[Tensor, Tensor]:
        qs = t.q_start.view(-1)  # type: ignore[attr-defined]
        bq = int(t.q_end.view(-1)[0] - qs[0] + 1)  # type: ignore[attr-defined]
        pad = len(qs) * bq - tq  # the last tile's missing rows repeat its last row (min/max unchanged)

        def per_tile(x: Tensor, op: str) -> Tensor:
            x = torch.cat([x, x[-1:].expand(pad)]).view(len(qs), bq)
            return (x.amax(dim=1) if op == "max" else x.amin(dim=1)).view(-1, 1)  # [nQB, 1]

        ks, ke = t.k_start, t.k_end  # type: ignore[attr-defined]
        full = (per_tile(lo, "max") <= ks) & (per_tile(hi, "min") >= ke)
        empty = (per_tile(lo_seen, "min") > ke) | (per_tile(hi_seen, "max") < ks)
        return full, empty

    return Mask(fn, "varlen", tiles=tiles)  # type: ignore[arg-type]


def _dense_packed_mask(cu_q: Tensor, cu_k: Tensor, tq: int, tk: int, causal: bool, window: Window | None,
                       alibi_slopes: Tensor | None) -> Tensor:
    """The packed pattern as a dense mask ``[1, 1, Tq, Tk]`` (bool), or with ALiBi a float mask
    ``[1, Hq, Tq, Tk]`` holding each sequence's own ALiBi bias and ``-inf`` where hidden. Built from
    shapes and tensor ops only (no host sync): what a compiled ``attention_varlen`` runs on."""
    lo, hi, a = _row_intervals(cu_q.long(), cu_k.long(), tq, causal, window)
    j = torch.arange(tk, device=cu_q.device).view(1, -1)
    allowed = ((j >= lo.view(-1, 1)) & (j <= hi.view(-1, 1))).view(1, 1, tq, tk)
    if alibi_slopes is None:
        return allowed
    bias = alibi_bias(alibi_slopes.view(1, -1, 1, 1), a.view(-1, 1), j)  # [1, Hq, Tq, Tk]
    return bias.masked_fill(~allowed, float("-inf"))


@torch.library.custom_op("attnzoo::varlen_fwd", mutates_args=())
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, causal: bool, window_left: int | None,
               window_right: int | None, has_window: bool, scale: float | None, softcap: float | None,
               alibi_slopes: Tensor | None, sinks: Tensor | None, return_lse: bool, backend: str,
               ) -> tuple[Tensor, Tensor]:
    """Inference ``attention_varlen`` as one operator (the eager packed path, tiles skipped from the
    sequence boundaries): ``(out [Tq, Hq, Dv], lse [Hq, Tq] or an empty [0] unless return_lse)``."""
    with torch.no_grad():
        res = attention_varlen(q, k, v, cu_q, cu_k, causal=causal, scale=scale, softcap=softcap,
                               window=(window_left, window_right) if has_window else None,
                               alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse, backend=backend)
    out, lse = res if isinstance(res, tuple) else (res, q.new_empty(0, dtype=_lse_dtype(q)))
    return out.contiguous(), lse.contiguous()


@varlen_fwd.register_fake
def _varlen_fwd_fake(q: Tensor, k: Tensor, v: Tensor, *args: object) -> tuple[Tensor, Tensor]:
    return_lse = args[-2]
    lse_shape = (q.shape[1], q.shape[0]) if return_lse else (0,)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(lse_shape, dtype=_lse_dtype(q))


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _compiled_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, win: Window | None,
                     kwargs: dict, backend: str) -> Tensor | tuple[Tensor, Tensor]:
    """``attention_varlen`` while compiling: one call on the packed tensors with a dense mask (the
    sequence boundaries are tensor data, so per-sequence slices or tile plans would break the graph).
    ``reference`` / ``sdpa`` / ``tiled`` run as asked, other backends run ``tiled``. Without
    gradients the eager call runs as one operator instead (:func:`varlen_fwd`: tiles skipped
    exactly, no dense mask)."""
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in
                                            (q, k, v, kwargs["alibi_slopes"], kwargs["sinks"]))):
        left, right = win if win is not None else (None, None)
        out, lse = varlen_fwd(q, k, v, cu_q, cu_k, kwargs["causal"], left, right, win is not None, kwargs["scale"],
                              kwargs["softcap"], kwargs["alibi_slopes"], kwargs["sinks"], kwargs["return_lse"],
                              backend)
        return (out, lse) if kwargs["return_lse"] else out
    mask = _dense_packed_mask(cu_q, cu_k, q.shape[0], k.shape[0], kwargs.pop("causal"), win,
                              kwargs.pop("alibi_slopes"))
    qp, kp, vp = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
    name = backend if backend in ("reference", "sdpa", "tiled") else "tiled"
    res = attention(qp, kp, vp, mask=mask, q_offset=0, backend=name, **kwargs)
    out_p, lse_p = res if isinstance(res, tuple) else (res, None)
    out = out_p[0].transpose(0, 1)  # [Tq, Hq, Dv]
    return (out, lse_p[0]) if lse_p is not None else out


def _per_sequence(q: Tensor, k: Tensor, v: Tensor, bounds_q: list[int], bounds_k: list[int],
                  kwargs: dict, sinks: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
    """One ``attention`` call per sequence; returns ``(out [Tq, Hq, Dv], lse [Hq, Tq])``."""
    outs, lses = [], []
    hq, dv = q.shape[1], v.shape[-1]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # no key: zeros, LSE -inf (or the sink's logit)
            outs.append(q.new_zeros(q1 - q0, hq, dv))
            lse = torch.full((hq, q1 - q0), float("-inf"), dtype=lse_dtype, device=q.device)
            lses.append(lse if sinks is None else sinks.to(lse_dtype).view(hq, 1).expand(hq, q1 - q0))
            continue
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))  # [1, H, n, D]
        res = attention(qi, ki, vi, sinks=sinks, return_lse=kwargs["return_lse"], backend=backend,
                        **{n: kwargs[n] for n in ("causal", "window", "scale", "softcap", "alibi_slopes")})
        out_i, lse_i = res if isinstance(res, tuple) else (res, None)
        outs.append(out_i[0].transpose(0, 1))  # [n_q, Hq, Dv]
        if lse_i is not None:
            lses.append(lse_i[0])  # [Hq, n_q]
    out = torch.cat(outs, dim=0) if outs else q.new_zeros(0, hq, dv)
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(hq, 0, dtype=lse_dtype, device=q.device)
    return out, lse


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed variable-length sequences (flash-attn's varlen layout).

    Args:
        q: packed queries ``[Tq, Hq, D]``; sequence ``i`` is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``.
        k: packed keys ``[Tk, Hkv, D]`` (``Hq % Hkv == 0``, GQA without copying K/V on the packed path).
        v: packed values ``[Tk, Hkv, Dv]``.
        cu_seqlens_q: int32 ``[S+1]`` cumulative query lengths: 0, then non-decreasing, ending at ``Tq``.
        cu_seqlens_k: int32 ``[S+1]`` cumulative key lengths, ending at ``Tk`` (same ``S``).
        causal, window, softcap, alibi_slopes, scale, sinks: as in :func:`attnzoo.attention`, applied
            to each sequence in its own positions, bottom-right aligned (``q_offset = n_k_i - n_q_i``).
        return_lse: also return the log-sum-exp, ``[Hq, Tq]`` float32 (float64 for float64 inputs),
            heads first as flash-attn's varlen functions return it.
        backend: ``"auto"`` / ``"tiled"`` / ``"flex"`` run the packed tensors in one call (``auto``
            = ``tiled``); ``"reference"`` / ``"sdpa"`` / ``"flash"`` run one call per sequence.

    Returns:
        ``out [Tq, Hq, Dv]`` in q's dtype, or ``(out, lse [Hq, Tq])``. Equal to calling
        ``attention`` on each sequence alone; a query whose sequence has no visible key returns zeros.
    """
    _check_packed(q, k, v)
    if q.shape[1] % max(1, k.shape[1]) != 0 or k.shape[1] != v.shape[1] or k.shape[0] != v.shape[0]:
        raise ValueError(f"packed shapes disagree: q {tuple(q.shape)} [Tq, Hq, D], k {tuple(k.shape)} "
                         f"[Tk, Hkv, D], v {tuple(v.shape)} [Tk, Hkv, Dv] (Hq % Hkv == 0, k/v same Tk, Hkv)")
    check_qkv(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))  # dtypes, devices, head dims
    cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device)
    cu_k = _check_cu(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{cu_q.numel() - 1} and {cu_k.numel() - 1}")
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(f"backend must be one of {('auto', *BACKENDS)}, got {backend!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    win = normalize_window(window)
    name = "tiled" if backend == "auto" else backend
    if torch.compiler.is_compiling():
        return _compiled_varlen(q, k, v, cu_q, cu_k, win, dict(causal=causal, scale=scale, softcap=softcap,
                                alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse), name)
    same_cu = alibi_slopes is None or bool(torch.equal(cu_q, cu_k))
    if name in PACKED_BACKENDS and q.shape[0] > 0 and k.shape[0] > 0 and same_cu:
        mask = varlen_mask(cu_q, cu_k, causal=causal, window=win)
        qp, kp, vp = (t.transpose(0, 1).contiguous().unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
        res = attention(qp, kp, vp, mask=mask, q_offset=0, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks, return_lse=return_lse, backend=name)
        out_p, lse_p = res if isinstance(res, tuple) else (res, None)
        out = out_p[0].transpose(0, 1).contiguous()  # [Tq, Hq, Dv]
        return (out, lse_p[0]) if lse_p is not None else out
    kwargs = dict(causal=causal, window=win, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                  return_lse=return_lse)
    out, lse = _per_sequence(q, k, v, cu_q.tolist(), cu_k.tolist(), kwargs, sinks, backend)
    return (out, lse) if return_lse else out
