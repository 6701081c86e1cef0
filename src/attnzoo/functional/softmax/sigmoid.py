r"""Sigmoid attention (Ramapuram et al., Apple, 2024): an element-wise sigmoid instead of the softmax.

.. math::

    o_i = \sum_{j \text{ visible}} \sigma(s_{ij} + b)\, v_j, \qquad
    s_{ij} = \text{scale} \cdot q_i \cdot k_j \;(+\text{softcap}, \text{ALiBi}, \text{float mask}),

with the default bias :math:`b = -\log N_k` (the paper's choice, which keeps the early-training
output norm close to softmax attention's). Hidden keys contribute 0; a row with no visible key
returns zeros. The weights are not normalised, so there is no LSE and no online rescaling: the
tiled form simply accumulates :math:`\sigma(S + b) V` over the key chunks a query block can see
(skipping tiles the mask proves empty), and its backward recomputes each tile:

.. math::

    dV \mathrel{+}= P^\top dO, \quad dS = (dO\,V^\top) \odot P \odot (1 - P), \quad
    dQ \mathrel{+}= \text{scale} \cdot dS\,K, \quad dK \mathrel{+}= \text{scale} \cdot dS^\top Q

(times :math:`1 - \tanh^2` under a softcap). Memory is ``O(N x block)``. GQA folds the ``G``
query heads of a group into the rows, so K/V are never expanded. Masks, positions and windows
follow ``docs/conventions.md``; small-N pictures in ``docs/softmax-frontier.md``.

Under ``torch.compile`` / ``torch.export`` the tiled form runs as two custom operators,
``attnzoo::sigmoid_attention_fwd`` and ``attnzoo::sigmoid_attention_bwd`` (as the softmax tiled backend does in
``tiled_ops``): the compiler sees one node per direction, the plan is made at run time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import check_float
from attnzoo.functional.backends.reference import compute_dtype, masked_scores
from attnzoo.functional.backends.tiled import TilePlan, tile_plan
from attnzoo.functional.backends.tiled_ops import dense_mask, op_request
from attnzoo.functional.core._edge import empty_result, guard_nonfinite, is_empty
from attnzoo.functional.core._request import AttnRequest, build_request
from attnzoo.functional.core.rules import output_like_v, stored_like_v
from attnzoo.masks import Mask

__all__ = ["SIGMOID_BACKENDS", "sigmoid_attention"]

SIGMOID_BACKENDS = ("reference", "tiled")


def _reference(r: AttnRequest, bias: float) -> tuple[Tensor, Tensor]:
    """Dense form: ``(out [B, Hq, Nq, Dv], weights [B, Hq, Nq, Nk])`` in the compute dtype."""
    cdt = compute_dtype(r.q.dtype)
    q, k, v = r.q.to(cdt), r.k.to(cdt), r.v.to(cdt)
    if r.group > 1:  # the dense form may expand K/V; the tiled form never does
        k = k.repeat_interleave(r.group, dim=1)  # [B, Hq, Nk, D]
        v = v.repeat_interleave(r.group, dim=1)  # [B, Hq, Nk, Dv]
    s = masked_scores(r, q, k, 0, r.nq, 0, r.nk)  # [B, Hq, Nq, Nk], -inf where hidden
    p = torch.sigmoid(s + bias)  # sigmoid(-inf) = 0
    return torch.matmul(p, v), p


def _tile(r: AttnRequest, bias: float, q_t: Tensor, k_c: Tensor, q_lo: int, q_hi: int, k_lo: int, k_hi: int,
          needs_mask: bool) -> tuple[Tensor, Tensor | None]:
    """``sigmoid(scores + bias)`` of one tile ``[B, Hkv, G*bq, bk]`` (0 where hidden), and
    ``tanh(raw / softcap)`` when a softcap is set. ``q_t`` is pre-scaled and folded."""
    s = torch.matmul(q_t, k_c.transpose(-1, -2))  # [B, Hkv, G*bq, bk]
    t: Tensor | None = None
    if r.softcap is not None:
        t = torch.tanh(s / r.softcap)
        s = t * r.softcap
    B, Hkv, R, bk = s.shape
    s = s.reshape(B, r.hq, q_hi - q_lo, bk)  # a view: folded rows are (group member, row)
    extra = r.bias(q_lo, q_hi, k_lo, k_hi)
    if extra is not None:
        s = s + extra.to(s.dtype)
    if needs_mask:
        allowed = r.allowed(q_lo, q_hi, k_lo, k_hi)
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
    return torch.sigmoid(s + bias).reshape(B, Hkv, R, bk), t


def _fold(x: Tensor, r: AttnRequest, lo: int, hi: int) -> Tensor:
    """Rows ``lo:hi`` of ``[B, Hq, N, E]`` as ``[B, Hkv, G*(hi-lo), E]``."""
    return x[:, :, lo:hi].reshape(x.shape[0], r.hkv, r.group * (hi - lo), x.shape[-1])


def _forward(r: AttnRequest, plan: TilePlan, bias: float, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Tiled forward in the compute dtype of ``q``: ``out [B, Hq, Nq, Dv]``."""
    B, Hq, Nq, _ = q.shape
    out = q.new_zeros(B, Hq, Nq, v.shape[-1])
    for i, chunks in enumerate(plan.rows):
        q_lo, q_hi = i * plan.block_q, min(Nq, (i + 1) * plan.block_q)
        if not chunks:
            continue  # no visible key: zeros
        q_t = _fold(q, r, q_lo, q_hi) * r.scale  # [B, Hkv, G*bq, D]
        acc = q_t.new_zeros(B, r.hkv, q_t.shape[2], v.shape[-1])
        for c in chunks:
            p, _ = _tile(r, bias, q_t, k[:, :, c.k_lo:c.k_hi], q_lo, q_hi, c.k_lo, c.k_hi, c.needs_mask)
            acc += torch.matmul(p, v[:, :, c.k_lo:c.k_hi])  # [B, Hkv, G*bq, Dv]
        out[:, :, q_lo:q_hi] = acc.reshape(B, Hq, q_hi - q_lo, -1)
    return out


def _backward(r: AttnRequest, plan: TilePlan, bias: float, q: Tensor, k: Tensor, v: Tensor,
              d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    B, Hq, Nq, _ = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i, chunks in enumerate(plan.rows):
        q_lo, q_hi = i * plan.block_q, min(Nq, (i + 1) * plan.block_q)
        if not chunks:
            continue
        q_t = _fold(q, r, q_lo, q_hi) * r.scale  # [B, Hkv, G*bq, D]
        do_t = _fold(d_out, r, q_lo, q_hi)  # [B, Hkv, G*bq, Dv]
        dq_t = torch.zeros_like(q_t)
        for c in chunks:
            k_c, v_c = k[:, :, c.k_lo:c.k_hi], v[:, :, c.k_lo:c.k_hi]
            p, t = _tile(r, bias, q_t, k_c, q_lo, q_hi, c.k_lo, c.k_hi, c.needs_mask)
            dv[:, :, c.k_lo:c.k_hi] += torch.matmul(p.transpose(-1, -2), do_t)
            ds = torch.matmul(do_t, v_c.transpose(-1, -2)).mul_(p * (1 - p))  # [B, Hkv, G*bq, bk]
            if t is not None:
                ds = ds.mul_(1 - t * t)
            dq_t += torch.matmul(ds, k_c)
            dk[:, :, c.k_lo:c.k_hi] += torch.matmul(ds.transpose(-1, -2), q_t)
        dq[:, :, q_lo:q_hi] = dq_t.reshape(B, Hq, q_hi - q_lo, -1)
    return dq.mul_(r.scale), dk, dv


class _TiledSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, r: AttnRequest, plan: TilePlan,  # type: ignore[override]
                bias: float) -> Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.r, ctx.plan, ctx.bias = r, plan, bias
        return _forward(r, plan, bias, q, k, v)

    @staticmethod
    def backward(ctx, d_out: Tensor):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.r, ctx.plan, ctx.bias, q, k, v, d_out.contiguous())
        return dq, dk, dv, None, None, None


@torch.library.custom_op("attnzoo::sigmoid_attention_fwd", mutates_args=())
def sigmoid_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, window_left: int | None,
                window_right: int | None, has_window: bool, q_offset: int, scale: float, softcap: float | None,
                alibi_slopes: Tensor | None, bias: float) -> Tensor:
    """Tiled sigmoid attention forward ``out [B, Hq, Nq, Dv]`` (q/k/v already in the compute dtype), stored
    as :func:`~attnzoo.functional.core.rules.output_like_v` says (renamed from ``sigmoid_fwd`` when that layout came in)."""
    r = op_request(q, k, v, mask, causal, window_left, window_right, has_window, q_offset, scale, softcap,
                   alibi_slopes, False)
    with torch.no_grad():
        return stored_like_v(_forward(r, tile_plan(r), bias, q, k, v), q, v)


@sigmoid_fwd.register_fake
def _sigmoid_fwd_fake(q: Tensor, k: Tensor, v: Tensor, *args: object) -> Tensor:
    return output_like_v(q, v)


@torch.library.custom_op("attnzoo::sigmoid_attention_bwd", mutates_args=())
def sigmoid_bwd(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                window_left: int | None, window_right: int | None, has_window: bool, q_offset: int, scale: float,
                softcap: float | None, alibi_slopes: Tensor | None, bias: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`sigmoid_fwd` (each tile recomputed)."""
    r = op_request(q, k, v, mask, causal, window_left, window_right, has_window, q_offset, scale, softcap,
                   alibi_slopes, False)
    with torch.no_grad():
        dq, dk, dv = _backward(r, tile_plan(r), bias, q, k, v, d_out.contiguous())
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@sigmoid_bwd.register_fake
def _sigmoid_bwd_fake(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, *args: object) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    q, k, v, mask, *scalars, alibi_slopes, bias = inputs
    ctx.save_for_backward(q, k, v, mask, alibi_slopes)
    ctx.scalars, ctx.bias = scalars, bias


def _backward_formula(ctx, d_out: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    q, k, v, mask, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = sigmoid_bwd(d_out, q, k, v, mask, *ctx.scalars, alibi_slopes, ctx.bias)
    return dq, dk, dv, *([None] * 10)


sigmoid_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def _sigmoid_op(r: AttnRequest, bias: float, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The tiled form through the custom operators (what a compiled graph calls)."""
    left, right = r.window if r.window is not None else (None, None)
    return sigmoid_fwd(q, k, v, dense_mask(r), r.causal, left, right, r.window is not None, r.q_offset,
                       r.scale, r.softcap, r.alibi_slopes, bias)


def _check_bias(bias: object, nk: int) -> float:
    if bias is None:
        return -math.log(max(1, nk))
    value = check_float(bias, "bias", expected="a float or None (default -log(Nk))")
    if not math.isfinite(value):
        raise ValueError(f"bias must be finite, got {bias}")
    return value


def sigmoid_attention(q: Tensor, k: Tensor, v: Tensor, *, bias: float | None = None, causal: bool = False,
                      window: int | tuple[int | None, int | None] | None = None, mask: Tensor | Mask | None = None,
                      scale: float | None = None, q_offset: int | None = None, softcap: float | None = None,
                      alibi_slopes: Tensor | None = None, return_weights: bool = False, backend: str = "auto"
                      ) -> Tensor | tuple[Tensor, Tensor]:
    """Sigmoid attention: ``out_i = sum_j sigmoid(s_ij + bias) v_j`` over visible keys.

    Args:
        q: queries ``[B, Hq, Nq, D]``.
        k: keys ``[B, Hkv, Nk, D]`` (``Hq % Hkv == 0``; query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        v: values ``[B, Hkv, Nk, Dv]``.
        bias: scalar added to every score before the sigmoid; default ``-log(Nk)`` (Apple's sigmoid
            attention).
        causal, window, mask, scale, q_offset, softcap, alibi_slopes: as in :func:`attnzoo.attention`
            (``docs/conventions.md``); a float mask and ALiBi add to the scores, hidden keys weigh 0.
        return_weights: also return the weights ``sigmoid(s + bias)`` ``[B, Hq, Nq, Nk]`` (reference only).
        backend: ``"auto"`` (``tiled``, or ``reference`` for weights or gradients to a float mask /
            ALiBi slopes), ``"reference"`` (dense) or ``"tiled"`` (memory linear in N, skips empty tiles).

    Returns:
        ``out [B, Hq, Nq, Dv]`` in q's dtype (computed in float32, float64 for float64), or
        ``(out, weights)``. A query with no visible key returns zeros (so does every row when
        ``Nk = 0``; ``Nq = 0`` or ``B = 0`` gives empty outputs). A NaN/inf in a key or value
        changes only the rows that see it, a NaN/inf query only its own row (``docs/conventions.md``).
    """
    r = build_request(q, k, v, mask=mask, causal=causal, window=window, q_offset=q_offset, scale=scale,
                      softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=0.0, return_lse=False,
                      return_weights=return_weights)
    b = _check_bias(bias, r.nk)
    if not isinstance(backend, str) or backend not in ("auto", *SIGMOID_BACKENDS):
        raise ValueError(f"backend must be one of {('auto', *SIGMOID_BACKENDS)}, got {backend!r}")
    lacking = r.features() & {"return_weights", "float mask gradient", "alibi gradient"}
    name = backend if backend != "auto" else ("reference" if lacking else "tiled")
    if name == "tiled" and lacking:
        raise ValueError(f"backend 'tiled' does not support: {', '.join(sorted(lacking))} "
                         f"(use backend='auto' or 'reference')")
    # hidden non-finite keys/values never reach a row (a hidden key weighs sigmoid(-inf) = 0, 0 * NaN = NaN)
    return guard_nonfinite(r, lambda clean: _run(clean, b, name))  # type: ignore[return-value]


def _run(r: AttnRequest, b: float, name: str) -> Tensor | tuple[Tensor, Tensor]:
    """A validated request on backend ``name``: ``out`` or ``(out, weights)`` in q's dtype."""
    q, k, v = r.q, r.k, r.v
    if is_empty(r):  # no keys, queries or batch: zeros (as attention() gives), no kernel runs
        out, _, p = empty_result(r)
        return (out, p) if r.return_weights else out
    if name == "reference":
        out, p = _reference(r, b)
        return (out.to(q.dtype), p.to(q.dtype)) if r.return_weights else out.to(q.dtype)
    cdt = compute_dtype(q.dtype)
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    if tracing():
        return _sigmoid_op(r, b, qc, kc, vc).to(q.dtype)
    plan = tile_plan(r)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = _TiledSigmoid.apply(qc, kc, vc, r, plan, b)
    else:
        out = _forward(r, plan, b, qc, kc, vc)
    return out.to(q.dtype)
