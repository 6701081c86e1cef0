r"""The backward pass of the ``tiled`` backend, and the attention backward kernel that ring
attention reuses: given the final log-sum-exp of every query row, each tile's probabilities are
recomputed, :math:`P = e^{S - \text{lse}}`, and

.. math::

    dV \mathrel{+}= P^\top dO, \quad dS = P \odot (dO\,V^\top - \delta), \quad
    dQ \mathrel{+}= dS\,K, \quad dK \mathrel{+}= dS^\top Q

with :math:`\delta = \text{rowsum}(dO \odot O)` of the *whole* output row (so the same kernel
serves one shard of keys of a longer row, as ring attention needs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo.functional.backends.tiled.plan import Band, Chunk, TilePlan
from attnzoo.functional.backends.tiled.scores import (
    as_heads,
    band_scores,
    exp_,
    finish_tile_scores,
    fold_q,
    raw_tile_scores,
    score_unit,
    tile_scores,
    unfold_rows,
)
from attnzoo.functional.core._request import AttnRequest
from attnzoo.functional.core.rules import compute_dtype
from attnzoo.functional.core.score_mod import score_mod_vjp

__all__ = ["FP16_SAFE_LIMIT", "accumulate_grads", "attention_backward", "backward_band", "fp16_grads_may_overflow"]

#: float16 tile products whose bound exceeds this (max float16: 65504) run in float32 instead.
FP16_SAFE_LIMIT = 2.0 ** 15


def backward_band(r: AttnRequest, bq: int, band: Band, q: Tensor, k: Tensor, v: Tensor, d_out: Tensor,
                   lse: Tensor, delta: Tensor, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Backward of a band: recompute its scores, then dQ for its rows and the overlapping
    windows' dK/dV (added back block by block: window slot ``t`` of block ``j`` is key block
    ``j + t``). ``dq`` gets ``dS K`` without the scale (the caller applies it once)."""
    B, Hq = q.shape[:2]
    Hkv, G, g, S = r.hkv, r.group, band.count, band.width
    q_lo = band.first * bq
    R = g * bq
    c = S // bq
    unit = score_unit(r)  # log2 units when plain: exp2 below
    bs = band_scores(r, bq, band, q, k, v, unit)
    acc_dtype = bs.s.dtype

    def fold_rows(x: Tensor) -> Tensor:  # [B, Hq, R, E] -> [B, Hkv, g, G*bq, E]
        return x.reshape(B, Hkv, G, g, bq, -1).transpose(2, 3).reshape(B, Hkv, g, G * bq, -1)

    lse_b = fold_rows(lse[:, :, q_lo:q_lo + R].unsqueeze(-1))
    lse_b = torch.where(torch.isfinite(lse_b), lse_b * unit, torch.full_like(lse_b, float("inf")))
    delta_b = fold_rows(delta[:, :, q_lo:q_lo + R].unsqueeze(-1))
    do_b = fold_rows(d_out[:, :, q_lo:q_lo + R])  # [B, Hkv, g, G*bq, Dv]
    p = exp_(bs.s.sub_(lse_b), unit)  # [B, Hkv, g, G*bq, S]; hidden keys and empty rows -> 0
    p_in = p.to(v.dtype)
    dv_win = v.new_empty(B, Hkv, g, S, v.shape[-1])
    dp = p_in.new_empty(p.shape)
    for b_i in range(B):
        for h_i in range(Hkv):
            torch.bmm(p_in[b_i, h_i].transpose(1, 2), do_b[b_i, h_i], out=dv_win[b_i, h_i])  # [g, S, Dv]
            torch.bmm(do_b[b_i, h_i], bs.v_win[b_i, h_i].transpose(1, 2), out=dp[b_i, h_i])  # [g, G*bq, S]
    ds = p.mul_(dp.to(acc_dtype).sub_(delta_b))  # in place: P is not needed any more
    del dp, p_in
    if bs.t is not None:
        ds = ds.mul_(1 - bs.t * bs.t)
    ds_in = ds.to(q.dtype)
    dq_b = q.new_empty(B, Hkv, g, G * bq, q.shape[-1])
    dk_win = k.new_empty(B, Hkv, g, S, k.shape[-1])
    for b_i in range(B):
        for h_i in range(Hkv):
            torch.bmm(ds_in[b_i, h_i], bs.k_win[b_i, h_i].transpose(1, 2), out=dq_b[b_i, h_i])  # [g, G*bq, D]
            torch.baddbmm(dk_win[b_i, h_i], ds_in[b_i, h_i].transpose(1, 2), bs.q_grp[b_i, h_i], beta=0,
                          alpha=r.scale, out=dk_win[b_i, h_i])  # [g, S, D]
    dq[:, :, q_lo:q_lo + R] += dq_b.reshape(B, Hkv, g, G, bq, -1).transpose(2, 3).reshape(B, Hq, R, -1)
    n_blocks = g - 1 + c
    span = slice(band.k_lo, band.k_lo + n_blocks * bq)
    dk_blocks = dk[:, :, span].view(B, Hkv, n_blocks, bq, -1)
    dv_blocks = dv[:, :, span].view(B, Hkv, n_blocks, bq, -1)
    dk_w = dk_win.view(B, Hkv, g, c, bq, -1)
    dv_w = dv_win.view(B, Hkv, g, c, bq, -1)
    for t in range(c):
        dk_blocks[:, :, t:t + g] += dk_w[:, :, :, t]
        dv_blocks[:, :, t:t + g] += dv_w[:, :, :, t]


def accumulate_grads(r: AttnRequest, plan: TilePlan, q: Tensor, k: Tensor, v: Tensor, d_out: Tensor,
                     lse: Tensor, delta: Tensor, dq: Tensor, dk: Tensor, dv: Tensor,
                     captured_grads: list[Tensor | None] | None = None) -> None:
    """Add the gradients of ``r``'s attention to the accumulators ``dq [B, Hq, Nq, D]`` (*without*
    the factor ``scale``: the caller applies it once), ``dk [B, Hkv, Nk, D]``, ``dv [B, Hkv, Nk, Dv]``
    (compute dtype).

    ``lse [B, Hq, Nq]`` is the natural-log LSE and ``delta [B, Hq, Nq]`` the ``rowsum(dO * O)`` of
    each query row's *final* output: when ``r`` covers only some of the keys a row sees (one
    shard of ring attention), the sum of the calls over all shards is the exact gradient.

    With a ``score_mod``, ``captured_grads`` (one slot per ``r.score_mod.captured``, ``None`` = zero)
    receives the gradients of the tensors it captures, summed over tiles (the plan has no bands).
    """
    B, Hq = q.shape[:2]
    done: set[int] = set()
    for band in plan.bands:
        if band.width % plan.block_q:  # the window must split into whole query blocks
            continue
        per = max(1, plan.tiles.backward_band_elems // max(1, B * Hq * plan.block_q * band.width))
        for a in range(0, band.count, per):
            piece = band.part(a, min(per, band.count - a), plan.block_q)
            backward_band(r, plan.block_q, piece, q, k, v, d_out, lse, delta, dq, dk, dv)
        done.update(range(band.first, band.first + band.count))
    for i, chunks in enumerate(plan.rows):
        if chunks and i not in done:
            _backward_block(r, plan, i, chunks, q, k, v, d_out, lse, delta, dq, dk, dv, captured_grads)


def _backward_block(r: AttnRequest, plan: TilePlan, i: int, chunks: tuple[Chunk, ...], q: Tensor, k: Tensor,
                    v: Tensor, d_out: Tensor, lse: Tensor, delta: Tensor, dq: Tensor, dk: Tensor,
                    dv: Tensor, captured_grads: list[Tensor | None] | None = None) -> None:
    """Gradients of query block ``i`` over its key chunks (``dq`` without the scale)."""
    B, Hq, Nq = q.shape[:3]
    acc_dtype = dq.dtype
    unit = score_unit(r)
    q_lo, q_hi = i * plan.block_q, min(Nq, (i + 1) * plan.block_q)
    q_t = fold_q(q, r.hkv, r.group, q_lo, q_hi) * r.scale  # [B, Hkv, G*bq, D], pre-scaled
    do_t = fold_q(d_out, r.hkv, r.group, q_lo, q_hi)  # [B, Hkv, G*bq, Dv]
    lse_t = lse[:, :, q_lo:q_hi].reshape(B, r.hkv, -1, 1)
    lse_t = torch.where(torch.isfinite(lse_t), lse_t * unit, torch.full_like(lse_t, float("inf")))
    q_s = q_t * unit if unit != 1.0 else q_t  # scores in log2 units when plain (exp2 below)
    delta_t = delta[:, :, q_lo:q_hi].reshape(B, r.hkv, -1, 1)
    dq_t = torch.zeros(q_t.shape, dtype=acc_dtype, device=q.device)
    for c in chunks:
        k_c, v_c = k[:, :, c.k_lo:c.k_hi], v[:, :, c.k_lo:c.k_hi]
        if r.score_mod is None:
            s, t = tile_scores(r, q_s, k_c, q_lo, q_hi, c)
        else:  # keep the scores score_mod received: its backward re-runs it on them
            raw, t = raw_tile_scores(r, q_s, k_c)
            s = finish_tile_scores(r, raw, q_lo, q_hi, c)
        p = exp_(s.sub_(lse_t), unit)  # [B, Hkv, G*bq, bk]; rows with no key -> 0
        dv[:, :, c.k_lo:c.k_hi] += torch.matmul(p.transpose(-1, -2).to(v.dtype), do_t)
        dp = torch.matmul(do_t, v_c.transpose(-1, -2)).to(acc_dtype)
        ds = p * (dp - delta_t)
        if r.score_mod is not None:  # through score_mod (recomputed on this tile) to its input
            ds = score_mod_vjp(r.score_mod, as_heads(r, raw), as_heads(r, ds), r.score_index(q_lo, q_hi, c.k_lo, c.k_hi),
                               captured_grads).reshape(ds.shape)
        if t is not None:
            ds = ds * (1 - t * t)
        ds_in = ds.to(q.dtype)
        dq_t += torch.matmul(ds_in, k_c)
        dk[:, :, c.k_lo:c.k_hi] += torch.matmul(ds_in.transpose(-1, -2), q_t)
    dq[:, :, q_lo:q_hi] += unfold_rows(dq_t, Hq, q_hi - q_lo)


def attention_backward(r: AttnRequest, plan: TilePlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             d_out: Tensor, d_lse: Tensor | None, captured_grads: list[Tensor | None] | None = None,
             ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the tiled attention ``(out, lse)`` given the gradients of both (and those of
    a ``score_mod``'s captured tensors into ``captured_grads``, see :func:`accumulate_grads`)."""
    if fp16_grads_may_overflow(r, plan, q, k, v, d_out):  # tile math in float32, grads back in float16
        grads = attention_backward(r, plan, q.float(), k.float(), v.float(), out.float(), lse, d_out.float(), d_lse,
                                   captured_grads)
        return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)
    acc_dtype = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
    delta = (d_out.to(acc_dtype) * out.to(acc_dtype)).sum(dim=-1)  # [B, Hq, Nq]
    if d_lse is not None:  # d lse / d s = p, so a gradient on the LSE shifts delta
        delta = delta - torch.nan_to_num(d_lse.to(acc_dtype), nan=0.0, posinf=0.0, neginf=0.0)
    accumulate_grads(r, plan, q, k, v, d_out, lse, delta, dq, dk, dv, captured_grads)
    # q_t was pre-scaled: dS/dq = scale * k and dk accumulated against scaled q already.
    return dq.mul_(r.scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _max_row_norm(t: Tensor) -> float:
    return float(t.float().norm(dim=-1).amax()) if t.numel() else 0.0


def fp16_grads_may_overflow(r: AttnRequest, plan: TilePlan, q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> bool:
    """Whether a float16 backward tile could leave the float16 range (then it runs in float32).

    Bounds by Cauchy-Schwarz, with ``P`` rows summing to at most 1 and ``R = G * block_q`` rows per
    tile: ``|dP| <= |dO| |V|``, ``|dS| <= 2 |dO| |V|``, a tile of ``dS K`` is at most
    ``2 |dO| |V| |K|``, of ``scale dS^T Q`` at most ``R 2 |dO| |V| scale |Q|`` and of ``P^T dO`` at
    most ``R |dO|`` (norms: the largest row norm of each tensor)."""
    if q.dtype != torch.float16:
        return False
    do_max, ds_max = _max_row_norm(d_out), 2.0 * _max_row_norm(d_out) * _max_row_norm(v)
    rows = plan.block_q * r.group
    bound = max(ds_max, ds_max * _max_row_norm(k), rows * ds_max * r.scale * _max_row_norm(q), rows * do_max)
    return bound > FP16_SAFE_LIMIT
