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

Training on the packed path (``auto`` / ``tiled``; under ``torch.compile`` every backend except
``reference`` / ``sdpa``) runs two custom operators, eager and compiled alike:
``attnzoo::varlen_fwd`` (the eager call above, with its LSE) and, as its registered gradient,
``attnzoo::varlen_bwd`` (the tiled backward kernel on the same sequence-aware tile plan, so tiles
between sequences are skipped in both directions; sink gradients and ALiBi included). Compiled
inference runs ``varlen_fwd`` alone. Under ``torch.compile`` / ``torch.export`` the sequence
boundaries are tensor data, so what the operators cannot serve (gradients for ``alibi_slopes``, or
the ``reference`` / ``sdpa`` backends with gradients) runs once on the packed tensors with a dense
``[Tq, Tk]`` mask built by tensor ops (exact, no graph break, but ``O(Tq x Tk)`` memory). The
checks on ``cu_seqlens`` values run in eager mode only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import check_bool, check_cu_seqlens, check_positive_float, check_tensor_ranks
from attnzoo.functional.backends.tiled import attention_backward, native_half_matmul, plan_for
from attnzoo.functional.backends.tiled.native import native_varlen, native_varlen_bwd
from attnzoo.functional.core._request import Window, build_request, check_qkv, normalize_window
from attnzoo.functional.core.rules import alibi_bias
from attnzoo.functional.core.score_mod import ScoreModFn
from attnzoo.functional.softmax.attention import BACKENDS, attention
from attnzoo.functional.softmax.sinks import check_sinks
from attnzoo.functional.softmax.varlen_split import split_applies, split_varlen
from attnzoo.masks import Mask

__all__ = ["attention_varlen", "varlen_bwd", "varlen_fwd", "varlen_mask"]

#: Backends that run the packed tensors in one call (they consume a Mask and skip empty tiles).
PACKED_BACKENDS = ("tiled", "flex")


def _check_cu(cu: object, name: str, total: int, device: torch.device) -> Tensor:
    """Cumulative lengths (:func:`attnzoo._validate.check_cu_seqlens`, values read unless tracing) on q's device."""
    checked = check_cu_seqlens(cu, name, total=total, values=not tracing())
    if checked.device != device:
        raise ValueError(f"{name} is on {checked.device} but q is on {device}")
    return checked


def _check_packed(q: object, k: object, v: object) -> None:
    check_tensor_ranks(3, "[T, H, D] (packed tokens)", q=q, k=k, v=v)


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
    """``attention_varlen`` as one operator (the eager call: tiles between sequences skipped from the
    boundaries): ``(out [Tq, Hq, Dv], lse [Hq, Tq] or an empty [0] unless return_lse)``. Its gradient
    (``return_lse=True`` needed) is :func:`varlen_bwd`, whatever ``backend`` ran the forward."""
    win = (window_left, window_right) if has_window else None
    kw = dict(causal=causal, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
              return_lse=return_lse)
    with torch.no_grad():
        fast = (native_varlen(q, k, v, cu_q, cu_k, causal=causal, window=win, scale=scale, softcap=softcap,
                              training=True)
                if backend == "tiled" and alibi_slopes is None and sinks is None else None)  # the compiled kernel
        out, lse = fast if fast is not None else _eager_varlen(q, k, v, cu_q, cu_k, win, kw, backend)
    return out.contiguous(), (lse if return_lse else q.new_empty(0, dtype=_lse_dtype(q))).contiguous()


@varlen_fwd.register_fake
def _varlen_fwd_fake(q: Tensor, k: Tensor, v: Tensor, *args: object) -> tuple[Tensor, Tensor]:
    return_lse = args[-2]
    lse_shape = (q.shape[1], q.shape[0]) if return_lse else (0,)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(lse_shape, dtype=_lse_dtype(q))


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("attnzoo::varlen_bwd", mutates_args=())
def varlen_bwd(d_out: Tensor, d_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               cu_q: Tensor, cu_k: Tensor, causal: bool, window_left: int | None, window_right: int | None,
               has_window: bool, scale: float | None, softcap: float | None, alibi_slopes: Tensor | None,
               sinks: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, d_sinks)`` of :func:`varlen_fwd` from those of ``out [Tq, Hq, Dv]`` and
    ``lse [Hq, Tq]`` (``d_sinks [Hq]``, an empty ``[0]`` without sinks).

    The tiled backward kernel runs once on the packed tensors with the plan of the forward (tiles
    between sequences skipped), probabilities recomputed from ``lse``. With sinks, ``out`` and
    ``lse`` already include the sink, so ``P = exp(S - lse)`` are the true probabilities and the
    kernel's ``delta = rowsum(dO * O) - d_lse`` is exact; the sink's own gradient is
    ``-sum_rows exp(sink - lse) * delta``. ALiBi with ``cu_q != cu_k`` runs one kernel call per
    sequence (its distances are per sequence, as in the forward)."""
    win = (window_left, window_right) if has_window else None
    with torch.no_grad():
        bad, (k, v, out, lse, d_out, d_lse) = _hide_nonfinite(cu_q, cu_k, causal, win, q.shape[1] // k.shape[1],
                                                              k, v, out, lse, d_out.contiguous(), d_lse)
        qc, kc, vc, oc = q, k, v, out
        if q.dtype in (torch.float16, torch.bfloat16) and not native_half_matmul(q.dtype, q.device.type):
            # tiles in float32, as the eager tiled path computes them (dO too: the tile matmuls need one dtype)
            qc, kc, vc, oc, d_out = q.float(), k.float(), v.float(), out.float(), d_out.float()
        fast = (native_varlen_bwd(qc, kc, vc, oc, lse, d_out, d_lse, cu_q, causal=causal, window=win, scale=scale,
                                  softcap=softcap)
                if alibi_slopes is None and sinks is None and bool(torch.equal(cu_q, cu_k)) else None)
        if fast is not None:  # the compiled kernel, one call per sequence
            dq, dk, dv = fast
        elif q.shape[0] == 0 or k.shape[0] == 0:  # no query or no key anywhere: nothing reaches q, k, v
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        elif alibi_slopes is not None and not bool(torch.equal(cu_q, cu_k)):
            dq, dk, dv = _per_sequence_bwd(d_out, d_lse, qc, kc, vc, oc, lse, cu_q.tolist(), cu_k.tolist(),
                                           dict(causal=causal, window=win, scale=scale, softcap=softcap,
                                                alibi_slopes=alibi_slopes))
        else:
            r = build_request(*_packed_heads(qc, kc, vc), mask=varlen_mask(cu_q, cu_k, causal=causal, window=win),
                              causal=False, window=None, q_offset=0, scale=scale, softcap=softcap,
                              alibi_slopes=alibi_slopes, dropout_p=0.0, return_lse=True, return_weights=False)
            out_p, do_p = _packed_heads(oc, d_out)
            grads = attention_backward(r, plan_for(r), r.q, r.k, r.v, out_p, lse.unsqueeze(0), do_p,
                                       None if d_lse is None else d_lse.unsqueeze(0))
            dq, dk, dv = (g[0].transpose(0, 1) for g in grads)
        if bad is not None:  # the forward ran on K/V with those keys zeroed: no gradient reaches them
            dk, dv = dk.masked_fill(bad.unsqueeze(-1), 0), dv.masked_fill(bad.unsqueeze(-1), 0)
        d_sinks = q.new_empty(0) if sinks is None else _sinks_grad(d_out, d_lse, out, lse, sinks)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), d_sinks


def _hide_nonfinite(cu_q: Tensor, cu_k: Tensor, causal: bool, win: Window | None, group: int, k: Tensor, v: Tensor,
                    out: Tensor, lse: Tensor, d_out: Tensor, d_lse: Tensor | None,
                    ) -> tuple[Tensor | None, tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]]:
    """The backward of the forward's non-finite guard (``attnzoo.functional.core._edge``): keys whose K or V
    holds a non-finite entry ran zeroed and the rows that see one were set to NaN (no gradient).
    Returns ``(bad [Tk, Hkv] or None, (k, v, out, lse, d_out, d_lse))`` with those keys zeroed and
    those rows neutral (``out = dO = d_lse = 0``, ``lse = +inf``: probability 0 everywhere)."""
    tensors = (k, v, out, lse, d_out, d_lse)
    if k.shape[0] == 0 or bool(torch.isfinite(k.sum()) & torch.isfinite(v.sum())):
        return None, tensors  # one reduction each decides (an overflowing half sum only costs the check)
    bad = ~torch.isfinite(k).all(dim=-1) | ~torch.isfinite(v).all(dim=-1)  # [Tk, Hkv]
    if not bool(bad.any()):
        return None, tensors
    lo, hi, _ = _row_intervals(cu_q.long(), cu_k.long(), out.shape[0], causal, win)  # keys of each row
    seen_before = torch.cat([bad.new_zeros(1, bad.shape[1], dtype=torch.long), bad.long().cumsum(0)])  # [Tk+1, Hkv]
    tk = k.shape[0]
    n_bad = seen_before[(hi + 1).clamp(0, tk)] - seen_before[lo.clamp(0, tk)]  # [Tq, Hkv] bad keys per row
    rows = (n_bad > 0).repeat_interleave(group, dim=1)  # [Tq, Hq]
    k, v = k.masked_fill(bad.unsqueeze(-1), 0), v.masked_fill(bad.unsqueeze(-1), 0)
    out, d_out = out.masked_fill(rows.unsqueeze(-1), 0), d_out.masked_fill(rows.unsqueeze(-1), 0)
    lse = lse.masked_fill(rows.t(), float("inf"))
    d_lse = None if d_lse is None else d_lse.masked_fill(rows.t(), 0)
    return bad, (k, v, out, lse, d_out, d_lse)


@varlen_bwd.register_fake
def _varlen_bwd_fake(d_out: Tensor, d_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, *args: object,
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    sinks = args[-1]
    d_sinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)  # type: ignore[union-attr]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_sinks


def _packed_heads(*ts: Tensor) -> tuple[Tensor, ...]:
    """``[T, H, D]`` tensors as ``[1, H, T, D]`` views (what the packed tiled call runs on). Views,
    not copies: the tiled kernels slice key chunks and query blocks, and ran 5-15% faster on the
    strided views than on contiguous copies (T=2048, H=4, D=32, forward and backward, one thread)."""
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in ts)


def _sinks_grad(d_out: Tensor, d_lse: Tensor | None, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``d_sinks [Hq] = -sum_rows exp(sink - lse) (rowsum(dO * O) - d_lse)`` (``lse`` includes the sink)."""
    acc = lse.dtype
    delta = (d_out.to(acc) * out.to(acc)).sum(dim=-1).transpose(0, 1)  # [Hq, Tq]
    if d_lse is not None:
        delta = delta - torch.nan_to_num(d_lse.to(acc), nan=0.0, posinf=0.0, neginf=0.0)
    p_sink = torch.exp(sinks.to(acc).view(-1, 1) - lse)  # [Hq, Tq]: the mass each row puts on its sink
    return (-(p_sink * delta).sum(dim=1)).to(sinks.dtype)


def _per_sequence_bwd(d_out: Tensor, d_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                      lse: Tensor, bounds_q: list[int], bounds_k: list[int], kw: dict,
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`varlen_bwd` one sequence at a time (each bottom-right aligned, as :func:`_per_sequence`)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i in range(len(bounds_q) - 1):
        rq, rk = slice(bounds_q[i], bounds_q[i + 1]), slice(bounds_k[i], bounds_k[i + 1])
        if rq.stop == rq.start or rk.stop == rk.start:  # no query, or no key: no gradient
            continue
        r = build_request(*_packed_heads(q[rq], k[rk], v[rk]), mask=None, q_offset=None, dropout_p=0.0,
                          return_lse=True, return_weights=False, **kw)
        out_p, do_p = _packed_heads(out[rq], d_out[rq])
        grads = attention_backward(r, plan_for(r), r.q, r.k, r.v, out_p, lse[:, rq].unsqueeze(0), do_p,
                                   None if d_lse is None else d_lse[:, rq].unsqueeze(0))
        for acc, g, rows in zip((dq, dk, dv), grads, (rq, rk, rk), strict=True):
            acc[rows] = g[0].transpose(0, 1)
    return dq, dk, dv


_OP_SCALARS = ("cu_q", "cu_k", "causal", "window_left", "window_right", "has_window", "scale", "softcap")


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:  # type: ignore[no-untyped-def]
    q, k, v, *rest = inputs
    alibi_slopes, sinks, return_lse, _backend = rest[len(_OP_SCALARS):]
    if not return_lse:
        raise ValueError("attnzoo::varlen_fwd: gradients need return_lse=True (the backward reads the LSE)")
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise ValueError("attnzoo::varlen_fwd: no gradient for alibi_slopes (attention_varlen runs such "
                         "calls without the operator)")
    ctx.save_for_backward(q, k, v, *output, alibi_slopes, sinks)
    ctx.args = dict(zip(_OP_SCALARS, rest[:len(_OP_SCALARS)], strict=True))


def _backward_formula(ctx, d_out: Tensor, d_lse: Tensor | None) -> tuple:  # type: ignore[no-untyped-def]
    q, k, v, out, lse, alibi_slopes, sinks = ctx.saved_tensors
    dq, dk, dv, d_sinks = varlen_bwd(d_out, d_lse, q, k, v, out, lse, *ctx.args.values(), alibi_slopes, sinks)
    return (dq, dk, dv, *(None,) * len(_OP_SCALARS), None, None if sinks is None else d_sinks, None, None)


varlen_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def _op_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, win: Window | None, kw: dict,
               backend: str, need_lse: bool) -> Tensor | tuple[Tensor, Tensor]:
    """``attention_varlen`` through :func:`varlen_fwd` (and its gradient :func:`varlen_bwd`)."""
    left, right = win if win is not None else (None, None)
    out, lse = varlen_fwd(q, k, v, cu_q, cu_k, kw["causal"], left, right, win is not None, kw["scale"], kw["softcap"],
                          kw["alibi_slopes"], kw["sinks"], need_lse or kw["return_lse"], backend)
    return (out, lse) if kw["return_lse"] else out


def _needs_grad(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))


def _compiled_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, win: Window | None,
                     kwargs: dict, backend: str) -> Tensor | tuple[Tensor, Tensor]:
    """``attention_varlen`` while compiling, when :func:`varlen_fwd` cannot serve it: gradients for
    ALiBi slopes, or for the ``reference`` / ``sdpa`` backends. One call on the packed tensors with a
    dense mask (the sequence boundaries are tensor data, so per-sequence slices or tile plans would
    break the graph; ``O(Tq x Tk)`` memory)."""
    mask = _dense_packed_mask(cu_q, cu_k, q.shape[0], k.shape[0], kwargs.pop("causal"), win,
                              kwargs.pop("alibi_slopes"))
    qp, kp, vp = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
    name = backend if backend in ("reference", "sdpa", "tiled") else "tiled"
    res = attention(qp, kp, vp, mask=mask, q_offset=0, backend=name, **kwargs)
    out_p, lse_p = res if isinstance(res, tuple) else (res, None)
    out = out_p[0].transpose(0, 1)  # [Tq, Hq, Dv]
    return (out, lse_p[0]) if lse_p is not None else out


def _eager_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, win: Window | None, kw: dict,
                  name: str) -> tuple[Tensor, Tensor | None]:
    """The eager ``attention_varlen`` (validated arguments): the packed call, or one per sequence.
    Returns ``(out [Tq, Hq, Dv], lse [Hq, Tq] or None unless kw["return_lse"])``."""
    same_cu = kw["alibi_slopes"] is None or bool(torch.equal(cu_q, cu_k))
    mod = kw.get("score_mod")
    if name in PACKED_BACKENDS and q.shape[0] > 0 and k.shape[0] > 0 and same_cu:
        mask = varlen_mask(cu_q, cu_k, causal=kw["causal"], window=win)
        res = attention(*_packed_heads(q, k, v), mask=mask, q_offset=0, backend=name,
                        score_mod=None if mod is None else _sequence_score_mod(mod, cu_q, cu_k),
                        **{n: kw[n] for n in ("scale", "softcap", "alibi_slopes", "sinks", "return_lse")})
        out_p, lse_p = res if isinstance(res, tuple) else (res, None)
        return out_p[0].transpose(0, 1).contiguous(), (None if lse_p is None else lse_p[0])  # [Tq, Hq, Dv]
    kwargs = dict(window=win, score_mod=mod,
                  **{n: kw[n] for n in ("causal", "scale", "softcap", "alibi_slopes", "return_lse")})
    out, lse = _per_sequence(q, k, v, cu_q.tolist(), cu_k.tolist(), kwargs, kw["sinks"], name)
    return out, (lse if kw["return_lse"] else None)


def _batch_is_sequence(score_mod: ScoreModFn, i: int) -> ScoreModFn:
    """``score_mod`` for sequence ``i`` called alone: its batch index is ``i``."""
    def mod(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score_mod(s, b + i, h, q_idx, kv_idx)

    return mod


def _sequence_score_mod(score_mod: ScoreModFn, cu_q: Tensor, cu_k: Tensor) -> ScoreModFn:
    """``score_mod`` on the packed tensors as each sequence sees it alone: batch index = the
    sequence's index, positions within the sequence (bottom-right aligned, as ``attention_varlen``)."""
    lens_q, lens_k = cu_q.diff().long(), cu_k.diff().long()
    seqs = torch.arange(lens_q.numel(), device=cu_q.device)
    seq_q = seqs.repeat_interleave(lens_q)  # [Tq] sequence of each packed query
    seq_k = seqs.repeat_interleave(lens_k)  # [Tk]
    shift_q = (lens_k - lens_q - cu_q[:-1].long())[seq_q]  # packed row -> its aligned position
    shift_k = (-cu_k[:-1].long())[seq_k]
    tq, tk = seq_q.numel(), seq_k.numel()

    def mod(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        qc, kc = q_idx.clamp(0, tq - 1), kv_idx.clamp(0, tk - 1)  # pairs across sequences are hidden anyway
        return score_mod(s, seq_q[qc], h, q_idx + shift_q[qc], kv_idx + shift_k[kc])

    return mod


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
        mod = kwargs.get("score_mod")
        res = attention(qi, ki, vi, sinks=sinks, return_lse=kwargs["return_lse"], backend=backend,
                        score_mod=None if mod is None else _batch_is_sequence(mod, i),
                        **{n: kwargs[n] for n in ("causal", "window", "scale", "softcap", "alibi_slopes")})
        out_i, lse_i = res if isinstance(res, tuple) else (res, None)
        outs.append(out_i[0].transpose(0, 1))  # [n_q, Hq, Dv]
        if lse_i is not None:
            lses.append(lse_i[0])  # [Hq, n_q]
    out = torch.cat(outs, dim=0) if outs else q.new_zeros(0, hq, dv)
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(hq, 0, dtype=lse_dtype, device=q.device)
    return out, lse


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                     causal: bool = False, window: int | tuple[int | None, int | None] | None = None,
                     softcap: float | None = None, alibi_slopes: Tensor | None = None, scale: float | None = None,
                     sinks: Tensor | None = None, return_lse: bool = False, backend: str = "auto",
                     score_mod: ScoreModFn | None = None) -> Tensor | tuple[Tensor, Tensor]:
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
        score_mod: as in :func:`attnzoo.attention`, seen as each sequence alone sees it: ``b`` is
            the sequence's index ``i`` and ``q_idx`` / ``kv_idx`` are positions within sequence
            ``i`` (keys ``0 .. n_k_i - 1``, queries bottom-right aligned). Runs eagerly (the
            packed ``tiled`` call and its own backward, gradients to captured tensors included).

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
    check_bool(causal, "causal")
    check_bool(return_lse, "return_lse")  # every option checked here: the op paths below take them as is
    scale = None if scale is None else check_positive_float(scale, "scale")
    softcap = None if softcap is None else check_positive_float(softcap, "softcap")
    if alibi_slopes is not None:
        check_tensor_ranks(1, "[Hq]", floating=True, alibi_slopes=alibi_slopes)
    if sinks is not None:
        check_sinks(sinks, q.shape[1], q.device)
    win = normalize_window(window)
    if (backend in ("auto", "tiled") and not tracing() and score_mod is None and alibi_slopes is None
            and sinks is None and not _needs_grad(q, k, v, None)):  # the opt-in compiled kernel, when built
        fast = native_varlen(q, k, v, cu_q, cu_k, causal=causal, window=win, scale=scale, softcap=softcap)
        if fast is not None:
            return (fast[0], fast[1]) if return_lse else fast[0]  # a tuple, whatever the kernel returned
    if backend == "auto" and not tracing() and score_mod is None:  # per-length SDPA calls: varlen_split.py
        bq, bk = cu_q.tolist(), cu_k.tolist()
        if split_applies(q, k, v, bq, bk, softcap=softcap, sinks=sinks, return_lse=return_lse):
            return split_varlen(q, k, v, bq, bk, causal=causal, window=win, scale=scale, alibi_slopes=alibi_slopes)
    name = "tiled" if backend == "auto" else backend
    kw = dict(causal=causal, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
              return_lse=return_lse)
    if score_mod is not None:
        if not callable(score_mod):
            raise TypeError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, "
                            f"got {type(score_mod).__name__}")
        out, lse = _eager_varlen(q, k, v, cu_q, cu_k, win, {**kw, "score_mod": score_mod}, name)
        return (out, lse) if lse is not None else out
    grads, alibi_grad = _needs_grad(q, k, v, sinks), alibi_slopes is not None and alibi_slopes.requires_grad
    compiling = tracing()
    if grads and not alibi_grad and (name == "tiled" or (compiling and name not in ("reference", "sdpa"))):
        return _op_varlen(q, k, v, cu_q, cu_k, win, kw, "tiled", need_lse=True)  # training: one op per direction
    if compiling and (grads or alibi_grad):
        return _compiled_varlen(q, k, v, cu_q, cu_k, win, kw, name)
    if compiling:
        return _op_varlen(q, k, v, cu_q, cu_k, win, kw, name, need_lse=False)  # inference: one op
    out, lse = _eager_varlen(q, k, v, cu_q, cu_k, win, kw, name)
    return (out, lse) if lse is not None else out
