"""The forward pass of the ``tiled`` backend: online softmax over the key chunks of each query
block, and sliding-window bands in one batched matmul (see the package docstring for the math)."""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor

from attnzoo.functional.backends.tiled.flat import edge_rows, flat_window, forward_flat
from attnzoo.functional.backends.tiled.plan import Band, Chunk, TilePlan
from attnzoo.functional.backends.tiled.scores import (
    ScoreBound,
    band_scores,
    cap_scores,
    exp_,
    finish_tile_scores,
    fold_q,
    log_,
    score_bound,
    score_unit,
    tile_scores,
    unfold_rows,
)
from attnzoo.functional.core._request import AttnRequest
from attnzoo.functional.core.rules import compute_dtype

__all__ = ["attention_forward", "band_pieces", "forward_band"]


def band_pieces(band: Band, bq: int, nq: int, dv: int, min_tail: int) -> list[tuple[int, Band]]:
    """Split ``band`` so that each piece's score buffer fits in the output rows not written yet.

    Returns ``(query block size, piece)`` pairs. The output is allocated empty and filled band
    after band, so its pages are touched only as rows are written; a piece whose ``bq x S`` scores
    per block take no more room than the rows after it keeps the peak at about the output's size.
    Far from the end that is the whole band; near the end the pieces shrink to one block, and
    where even one block does not fit, to sub-blocks of that block (down to ``min_tail``
    rows; each sees the block's whole key window, so the result is unchanged)."""
    def fits(rows: int, q_lo: int) -> bool:
        return rows * (band.width + dv) <= (nq - q_lo) * dv

    pieces: list[tuple[int, Band]] = []
    a = 0
    while a < band.count:
        q_lo = (band.first + a) * bq
        fit = (nq - q_lo) * dv // (bq * (band.width + dv))
        if fit >= 1 or bq % 2 or bq <= min_tail:
            n = min(band.count - a, max(1, fit))
            pieces.append((bq, band.part(a, n, bq)))
            a += n
            continue
        block = band.part(a, 1, bq)  # one block, cut into sub-blocks over its key window
        lo = q_lo
        while lo < q_lo + bq:
            sub = bq
            while sub // 2 >= min_tail and sub % 2 == 0 and (lo % sub or not fits(sub, lo)):
                sub //= 2
            pieces.append((sub, Band(lo // sub, 1, block.k_lo, block.width, block.needs_mask)))
            lo += sub
        a += 1
    return pieces



def attention_forward(r: AttnRequest, plan: TilePlan, q: Tensor, k: Tensor, v: Tensor,
            need_lse: bool = True) -> tuple[Tensor, Tensor | None]:
    """Online-softmax forward. Returns ``out [B, Hq, Nq, Dv]`` (input dtype) and float32 ``lse``
    (``None`` unless ``need_lse``).

    When every score of a query block is provably within ``STATIC_SHIFT_BOUND`` of zero, the
    block skips the running maximum entirely (shift 0: exact, and two passes over each tile
    fewer); otherwise it runs the classic max-tracking recurrence.
    """
    B, Hq, Nq, _ = q.shape
    Dv = v.shape[-1]
    out = torch.empty(B, Hq, Nq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Nq, dtype=compute_dtype(q.dtype), device=q.device) if need_lse else None
    window = flat_window(r, plan, q, k, v)
    if window is not None:  # every head's window blocks at once, then each head's edge blocks
        forward_flat(r, plan, window, q, k, v, out, lse)
        for i in edge_rows(plan, window):  # a few blocks: no bound (max-tracking), no pass over all keys
            _forward_block(r, plan, i, plan.rows[i], q, k, v, None, out, lse)
        return out, lse
    bound = score_bound(r, q, k)
    in_band = {i for band in plan.bands for i in range(band.first, band.first + band.count)}
    # Blocks outside bands first, bands last (in order): each band piece then finds the output rows
    # after it still unwritten (untouched pages) and sizes itself to fit there (band_pieces).
    for i, chunks in enumerate(plan.rows):
        if i in in_band:
            continue
        if _row_fits(r, plan, i, chunks):
            _forward_row(r, plan, i, chunks, q, k, v, out, lse)
        else:
            _forward_block(r, plan, i, chunks, q, k, v, bound, out, lse)
    for band in plan.bands:
        for bq, piece in band_pieces(band, plan.block_q, Nq, Dv, plan.tiles.min_tail_block):
            forward_band(r, bq, piece, q, k, v, bound, out, lse)
    return out, lse


def _p_times_v(p: Tensor, ell: Tensor, v: Tensor) -> Tensor:
    """``P V`` of a chunk in P's (float32/64) dtype, given P's row sums ``ell``.

    Half-precision V: P is divided by its row sums before the cast, so the half matmul sees
    weights <= 1 (a convex combination cannot overflow float16, and a row with one visible key
    gets exactly its value); the sums are multiplied back in float32."""
    if p.dtype == v.dtype:
        return torch.matmul(p, v)
    w = p.div_(torch.where(ell > 0, ell, torch.ones_like(ell))).to(v.dtype)
    return torch.matmul(w, v).to(ell.dtype).mul_(ell)


def _forward_block(r: AttnRequest, plan: TilePlan, i: int, chunks: tuple[Chunk, ...], q: Tensor, k: Tensor,
                   v: Tensor, bound: ScoreBound | None, out: Tensor, lse: Tensor | None) -> None:
    """Query block ``i`` over its key chunks into ``out`` and ``lse`` (its temporaries die on return)."""
    Hq, Nq = q.shape[1], q.shape[2]
    q_lo, q_hi = i * plan.block_q, min(Nq, (i + 1) * plan.block_q)
    rows = q_hi - q_lo
    if not chunks:
        out[:, :, q_lo:q_hi] = 0
        if lse is not None:
            lse[:, :, q_lo:q_hi] = float("-inf")
        return
    acc_dtype = compute_dtype(q.dtype)
    unit = score_unit(r)  # scores in units of log2 when plain: exp2 below
    q_t = fold_q(q, r.hkv, r.group, q_lo, q_hi) * (r.scale * unit)  # [B, Hkv, G*bq, D], pre-scaled
    static = bound is not None and bound.static(q_lo, q_hi)
    m: Tensor | None = None
    acc: Tensor | None = None  # [B, Hkv, G*bq, Dv]: unnormalised output
    ell: Tensor | None = None  # [B, Hkv, G*bq, 1]: its normaliser
    for c in chunks:
        s, _ = tile_scores(r, q_t, k[:, :, c.k_lo:c.k_hi], q_lo, q_hi, c)  # [B, Hkv, G*bq, bk]
        if static:
            p = exp_(s, unit)  # shift 0; hidden keys -> 0
        else:
            m_c = s.amax(dim=-1, keepdim=True)
            m_new = m_c if m is None else torch.maximum(m, m_c)  # running max, -inf if nothing seen
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = exp_(s.sub_(m_safe), unit)  # in place on the tile; hidden keys -> 0
        # P V and the row sums as two calls: a V with a column of ones (one matmul) is slower,
        # as matmuls with Dv + 1 columns run ~20% below those with Dv = 64, plus the copy.
        ell_c = p.sum(dim=-1, keepdim=True, dtype=acc_dtype)
        pv = _p_times_v(p, ell_c, v[:, :, c.k_lo:c.k_hi])  # [B, Hkv, G*bq, Dv]
        if acc is None or ell is None:
            acc, ell = pv, ell_c
        else:
            if m is not None:  # max-tracking: rescale old statistics; exp(-inf) = 0
                alpha = exp_(m - m_safe, unit)
                acc, ell = acc.mul_(alpha), ell.mul_(alpha)
            acc, ell = acc.add_(pv), ell.add_(ell_c)
        if not static:
            m = m_new
    assert acc is not None and ell is not None
    ok = ell > 0
    safe_ell = torch.where(ok, ell, torch.ones_like(ell))
    o = acc.div_(safe_ell)
    out[:, :, q_lo:q_hi] = unfold_rows(o, Hq, rows).to(q.dtype)
    if lse is not None:
        shift = torch.zeros_like(ell) if m is None else torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        row_lse = torch.where(ok, (shift + log_(safe_ell, unit)) / unit, torch.full_like(ell, float("-inf")))
        lse[:, :, q_lo:q_hi] = unfold_rows(row_lse.squeeze(-1), Hq, rows)


def _row_fits(r: AttnRequest, plan: TilePlan, i: int, chunks: tuple[Chunk, ...]) -> bool:
    """Whether query block ``i`` runs as one whole-row softmax (:func:`_forward_row`): its chunks are
    one contiguous key range whose scores fit in ``row_elems``, one of them is fully visible (so no
    row is empty, where ``softmax`` would give NaN) and nothing can add ``-inf`` outside the
    structure (no float mask or ``score_mod``)."""
    if not chunks or r.float_mask is not None or r.score_mod is not None:
        return False
    if all(c.needs_mask for c in chunks) or any(a.k_hi != b.k_lo for a, b in pairwise(chunks)):
        return False
    rows = min(r.nq, (i + 1) * plan.block_q) - i * plan.block_q
    return r.batch * r.hq * rows * (chunks[-1].k_hi - chunks[0].k_lo) <= plan.tiles.row_elems


def _forward_row(r: AttnRequest, plan: TilePlan, i: int, chunks: tuple[Chunk, ...], q: Tensor, k: Tensor,
                 v: Tensor, out: Tensor, lse: Tensor | None) -> None:
    """Query block ``i`` against all its keys at once: one ``baddbmm`` (scale inside), the biases
    and masks on the partial chunks' columns, one in-place ``softmax`` (exact: it subtracts the
    row maximum) and one ``P V`` matmul, where the online softmax issues six ops per chunk. Each op
    waits for the whole thread pool, so on a busy machine the op count, not the arithmetic, sets
    the time (docs/performance.md, issue 37)."""
    B, Hq, Nq = q.shape[:3]
    q_lo, q_hi = i * plan.block_q, min(Nq, (i + 1) * plan.block_q)
    k_lo, k_hi = chunks[0].k_lo, chunks[-1].k_hi
    q3 = fold_q(q, r.hkv, r.group, q_lo, q_hi).flatten(0, 1)  # [B*Hkv, G*bq, D]
    k3 = k[:, :, k_lo:k_hi].flatten(0, 1)  # [B*Hkv, W, D]
    s = torch.baddbmm(q3.new_empty(q3.shape[0], q3.shape[1], k_hi - k_lo), q3, k3.transpose(1, 2),
                      beta=0, alpha=r.scale)  # q, k are float32/64 here (tiled_attention converts half ones)
    s = cap_scores(r, s.view(B, r.hkv, -1, k_hi - k_lo))[0]  # [B, Hkv, G*bq, W]
    for c in chunks:  # the user's biases and the structure's -inf, column range by column range
        part = s[..., c.k_lo - k_lo:c.k_hi - k_lo]
        done = finish_tile_scores(r, part, q_lo, q_hi, c)
        if done is not part:
            part.copy_(done)
    if lse is not None:
        lse[:, :, q_lo:q_hi] = unfold_rows(torch.logsumexp(s, dim=-1), Hq, q_hi - q_lo)
    p = torch.softmax(s, dim=-1, out=s).to(v.dtype)  # normalised before any half cast (see _p_times_v)
    o = torch.matmul(p, v[:, :, k_lo:k_hi])  # [B, Hkv, G*bq, Dv]
    out[:, :, q_lo:q_hi] = unfold_rows(o, Hq, q_hi - q_lo)


def forward_band(r: AttnRequest, bq: int, band: Band, q: Tensor, k: Tensor, v: Tensor,
                  bound: ScoreBound | None, out: Tensor, lse: Tensor | None) -> None:
    """Forward of a band of query blocks in one batched matmul (K/V windows are strided views)."""
    B, Hq = q.shape[:2]
    Hkv, G, g = r.hkv, r.group, band.count
    q_lo = band.first * bq
    R = g * bq
    unit = score_unit(r)  # log2 units when plain: exp2 below
    bs = band_scores(r, bq, band, q, k, v, unit)
    s, v_win = bs.s, bs.v_win
    static = bound is not None and bound.static(q_lo, q_lo + R)
    shift: Tensor | None = None
    if not static:
        m = s.amax(dim=-1, keepdim=True)
        shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        s.sub_(shift)
    p = exp_(s, unit)
    ell = p.sum(dim=-1, keepdim=True)  # [B, Hkv, g, G*bq, 1]
    ok = ell > 0
    safe = torch.where(ok, ell, torch.ones_like(ell))
    normalised = p.dtype != v.dtype  # half V: weights <= 1 before the cast (see _p_times_v)
    p_v = (p.div_(safe) if normalised else p).to(v.dtype)
    Dv = v.shape[-1]
    # Without GQA and in the accumulation dtype, P V goes straight into the output rows (no copy).
    acc_dtype = s.dtype
    direct = G == 1 and out.dtype == acc_dtype == p_v.dtype
    acc = out[:, :, q_lo:q_lo + R].view(B, Hkv, g, bq, Dv) if direct else p_v.new_empty(B, Hkv, g, G * bq, Dv)
    for b_i in range(B):
        for h_i in range(Hkv):
            torch.bmm(p_v[b_i, h_i], v_win[b_i, h_i], out=acc[b_i, h_i])  # [g, G*bq, Dv]
    acc = acc.to(acc_dtype)
    o = acc if normalised else acc.div_(safe)

    def unfold_rows(t: Tensor) -> Tensor:  # [B, Hkv, g, G*bq, E] -> [B, Hq, R, E]
        return t.reshape(B, Hkv, g, G, bq, -1).transpose(2, 3).reshape(B, Hq, R, -1)

    if not direct:
        out[:, :, q_lo:q_lo + R] = unfold_rows(o).to(out.dtype)
    if lse is not None:
        row_lse = torch.where(ok, (log_(safe, unit) + (0 if shift is None else shift)) / unit,
                              torch.full_like(ell, float("-inf")))
        lse[:, :, q_lo:q_lo + R] = unfold_rows(row_lse).squeeze(-1)


