r"""The ``tiled`` backend: flash-style exact attention in plain PyTorch.

Queries are cut into blocks of ``block_q`` rows; for each query block the keys it can see are
visited in chunks (runs of key tiles that the mask's block map does not prove empty). Online
softmax keeps, per query row, the running maximum :math:`m`, normaliser :math:`\ell` and
unnormalised output :math:`o`. For a new chunk with scores :math:`s_j`:

.. math::

    m' = \max(m, \max_j s_j), \quad
    \ell' = e^{m - m'} \ell + \sum_j e^{s_j - m'}, \quad
    o' = e^{m - m'} o + \sum_j e^{s_j - m'} v_j,

and at the end :math:`\text{out} = o / \ell`, :math:`\text{lse} = m + \log \ell`. Only one
``block_q x chunk`` score tile exists at a time, so memory is ``O(N x block)``, not ``O(N^2)``.
When nothing is added to the scaled scores (no softcap, ALiBi or float mask) the forward pass
folds :math:`\log_2 e` into the scale and uses ``exp2`` (the same numbers; ~1.7x faster than
``exp`` in torch on CPU), converting the LSE back to natural log at the end; the backward pass
recomputes :math:`P = 2^{S \log_2 e - \text{lse} \log_2 e}` the same way.

The backward pass (a custom autograd function) recomputes each tile's probabilities from the
saved LSE, :math:`P = e^{S - \text{lse}}`, and accumulates

.. math::

    dV \mathrel{+}= P^\top dO, \quad dS = P \odot (dO\,V^\top - \delta), \quad
    \delta = \text{rowsum}(dO \odot O), \quad dQ \mathrel{+}= dS\,K, \quad dK \mathrel{+}= dS^\top Q

(times the scale, and the softcap derivative :math:`1 - \tanh^2` when a softcap is set), again
one tile at a time. GQA never expands K/V: the ``G = Hq / Hkv`` query heads of a group are folded
into the row dimension, ``[B, Hkv, G * block_q, D]``, and multiply the shared K/V directly.
Half-precision inputs use half-precision matmuls with float32 softmax, statistics and
accumulators.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from attnzoo.functional._request import AttnRequest
from attnzoo.masks import BLOCK_EMPTY, BLOCK_FULL

__all__ = ["TilePlan", "plan_for", "tile_plan", "tiled_attention"]

#: Query rows per block and key tile size used for the block map. With chunks of at most 512
#: keys a score tile (128 x 512 float32 per head) stays in a core's L2 cache: measured on the
#: 2-core AVX2 machine (B=1, H=8, D=64, causal N=4096) the forward ran 10-20% and forward+backward
#: 25% faster than with 256-row blocks and 2048-key chunks.
BLOCK_Q = 128
BLOCK_K = 128
#: Longest key chunk processed at once; neighbouring runs shorter than MERGE_K are merged.
MAX_CHUNK_K = 512
MERGE_K = 512


@dataclass(frozen=True)
class Chunk:
    k_lo: int
    k_hi: int
    needs_mask: bool


@dataclass(frozen=True)
class TilePlan:
    """Which key chunks every query block visits."""

    block_q: int
    block_k: int
    n_q_blocks: int
    n_k_blocks: int
    n_tiles: int  # non-empty (q_block, k_block) tiles
    rows: tuple[tuple[Chunk, ...], ...]  # per query block
    bands: tuple[Band, ...] = ()  # runs of query blocks computed together (forward)


@dataclass(frozen=True)
class Band:
    """``count`` consecutive query blocks from ``first``, each seeing one chunk of ``width`` keys
    that starts ``block_q`` keys after the previous one (a sliding window's interior)."""

    first: int
    count: int
    k_lo: int
    width: int
    needs_mask: bool

    def part(self, offset: int, count: int, block_q: int) -> Band:
        """The ``count`` blocks of this band from its ``offset``-th block (their window slides along)."""
        return Band(self.first + offset, count, self.k_lo + offset * block_q, self.width, self.needs_mask)


#: Plans kept for requests whose pattern is fully described by plain values (see ``tile_plan``).
PLAN_CACHE_SIZE = 64
_plan_cache: OrderedDict[tuple, TilePlan] = OrderedDict()
_plan_cache_lock = threading.Lock()


def tile_plan(r: AttnRequest, block_q: int | None = None, block_k: int | None = None) -> TilePlan:
    """Plan the visit of ``r``: skip tiles empty for every (batch, head), mask only partial ones.

    Plans of requests whose pattern is only ``causal`` / ``window`` (no mask tensor or ``Mask``
    object) depend on a few integers, so the last ``PLAN_CACHE_SIZE`` are kept and reused, as a
    FlexAttention user keeps a block mask: a repeated call at one shape builds no plan (no time,
    no memory). Plans are immutable."""
    block_q = block_q or BLOCK_Q
    block_k = block_k or BLOCK_K
    if r.mask_tensor is not None or r.mask_obj is not None:
        return _build_plan(r, block_q, block_k)
    key = (r.causal, r.window, r.q_offset, r.batch, r.hq, r.nq, r.nk, block_q, block_k,
           MAX_CHUNK_K, MERGE_K, BAND_ELEMS)  # the module's tuning knobs too (tests change them)
    with _plan_cache_lock:
        plan = _plan_cache.get(key)
        if plan is not None:
            _plan_cache.move_to_end(key)
            return plan
    plan = _build_plan(r, block_q, block_k)
    with _plan_cache_lock:
        _plan_cache[key] = plan
        while len(_plan_cache) > PLAN_CACHE_SIZE:
            _plan_cache.popitem(last=False)
    return plan


def _build_plan(r: AttnRequest, block_q: int, block_k: int) -> TilePlan:
    n_qb = -(-r.nq // block_q)
    n_kb = -(-r.nk // block_k)
    s = r.structure
    if s is None:
        cls = torch.full((n_qb, n_kb), BLOCK_FULL, dtype=torch.int8)
    else:
        bm = s.block_map(r.batch, r.hq if _head_dependent(s) else 1, r.nq, r.nk, block_q, block_k,
                         q_offset=r.q_offset)
        # Reduce over batch and heads: empty only if empty everywhere, full only if full everywhere.
        lo = bm.amin(dim=(0, 1))
        hi = bm.amax(dim=(0, 1))
        cls = torch.where(hi == BLOCK_EMPTY, BLOCK_EMPTY, torch.where(lo == BLOCK_FULL, BLOCK_FULL, 1)).to(torch.int8)
    if r.bool_mask is not None:  # a dense bool tensor is not analysed: its tiles are partial
        cls = torch.where(cls == BLOCK_FULL, torch.ones_like(cls), cls)
    # Visit the non-empty tiles only (row-major, so columns ascend within a row): a window over a
    # long sequence has a few tiles per row out of thousands.
    nz = (cls != BLOCK_EMPTY).nonzero()  # [T, 2]
    tile_i, tile_j = nz[:, 0].tolist(), nz[:, 1].tolist()
    tile_kind = cls[nz[:, 0], nz[:, 1]].tolist()
    n_tiles = len(tile_i)
    row_runs: list[list[list[int]]] = [[] for _ in range(n_qb)]  # per row: [k_block_lo, k_block_hi, kind]
    for i, j, c in zip(tile_i, tile_j, tile_kind, strict=True):
        runs = row_runs[i]
        kind = 0 if c == BLOCK_FULL else 1
        if runs and runs[-1][1] == j and runs[-1][2] == kind:
            runs[-1][1] = j + 1
        else:
            runs.append([j, j + 1, kind])
    rows: list[tuple[Chunk, ...]] = []
    for runs in row_runs:
        # Merge adjacent short runs (fewer, larger matmuls beat skipping a mask on a few tiles).
        merged: list[list[int]] = []
        for run in runs:
            if merged and merged[-1][1] == run[0] and (run[1] - merged[-1][0]) * block_k <= MERGE_K:
                merged[-1][1] = run[1]
                merged[-1][2] = max(merged[-1][2], run[2])
            else:
                merged.append(list(run))
        chunks: list[Chunk] = []
        per = max(1, MAX_CHUNK_K // block_k)
        for j0, j1, kind in merged:
            for a in range(j0, j1, per):
                b = min(j1, a + per)
                chunks.append(Chunk(a * block_k, min(r.nk, b * block_k), bool(kind)))
        rows.append(tuple(chunks))
    bands = _find_bands(r, rows, block_q) if r.mask_tensor is None else ()
    return TilePlan(block_q, block_k, n_qb, n_kb, n_tiles, tuple(rows), bands)


#: Smallest query block used for sliding-window bands.
MIN_BAND_BLOCK = 32
#: Upper bound on score elements of one band batch (float32: 4 bytes each).
BAND_ELEMS = 1 << 22


def _find_bands(r: AttnRequest, rows: list[tuple[Chunk, ...]], block_q: int) -> tuple[Band, ...]:
    """Group query blocks whose single key chunk slides by ``block_q`` with a constant width."""
    bands: list[Band] = []
    i = 0
    n = len(rows)
    while i < n:
        row = rows[i]
        if len(row) != 1 or (i + 1) * block_q > r.nq:
            i += 1
            continue
        c = row[0]
        width = c.k_hi - c.k_lo
        per_block = r.batch * r.hq * block_q * width
        cap = max(1, BAND_ELEMS // max(1, per_block))
        j = i + 1
        while (j < n and j - i < cap and len(rows[j]) == 1 and (j + 1) * block_q <= r.nq
               and rows[j][0].k_hi - rows[j][0].k_lo == width
               and rows[j][0].k_lo == c.k_lo + (j - i) * block_q):
            j += 1
        if j - i >= 2:
            bands.append(Band(i, j - i, c.k_lo, width, any(rows[t][0].needs_mask for t in range(i, j))))
        i = j
    return tuple(bands)


def _head_dependent(m: object) -> bool:
    # Builders never read the head index; a custom predicate might, so give it every head.
    from attnzoo.masks import Mask

    assert isinstance(m, Mask)
    return any(leaf._tiles is None and leaf.name != "document" for leaf in m._leaves())


# ---------------------------------------------------------------------------- helpers
def _fold(t: Tensor | None, hkv: int, group: int, rows: int, cols: int) -> Tensor | None:
    """``[b, Hq|1, bq|1, bk|1]`` -> ``[b, Hkv|1, G*bq, bk]`` matching the folded query rows."""
    if t is None:
        return None
    t = t.expand(t.shape[0], t.shape[1], rows, cols)
    b, h, bq, bk = t.shape
    if h == 1:
        if group == 1:
            return t
        return t.unsqueeze(2).expand(b, 1, group, bq, bk).reshape(b, 1, group * bq, bk)
    return t.reshape(b, hkv, group * bq, bk)


def _tile_scores(r: AttnRequest, q_t: Tensor, k_c: Tensor, q_lo: int, q_hi: int, chunk: Chunk,
                 ) -> tuple[Tensor, Tensor | None]:
    """Scaled, capped, biased and masked float32 scores of one tile ``[B, Hkv, G*bq, bk]``.

    Also returns ``tanh(raw / softcap)`` when a softcap is set (for the backward pass)."""
    s = torch.matmul(q_t, k_c.transpose(-1, -2))  # [B, Hkv, G*bq, bk] (q_t is pre-scaled)
    if s.dtype != torch.float32 and s.dtype != torch.float64:
        s = s.float()
    t: Tensor | None = None
    if r.softcap is not None:
        t = torch.tanh(s / r.softcap)
        s = t * r.softcap
    rows, cols = q_hi - q_lo, chunk.k_hi - chunk.k_lo
    bias = _fold(r.bias(q_lo, q_hi, chunk.k_lo, chunk.k_hi), r.hkv, r.group, rows, cols)
    if bias is not None:
        s = s + bias
    if chunk.needs_mask:
        allowed = _fold(r.allowed(q_lo, q_hi, chunk.k_lo, chunk.k_hi), r.hkv, r.group, rows, cols)
        if allowed is not None:
            s = s.masked_fill_(~allowed, float("-inf"))
    return s, t


def _fold_q(x: Tensor, hkv: int, group: int, lo: int, hi: int) -> Tensor:
    """Rows ``lo:hi`` of ``[B, Hq, N, E]`` as ``[B, Hkv, G*(hi-lo), E]``."""
    b, _, _, e = x.shape
    return x[:, :, lo:hi].reshape(b, hkv, group * (hi - lo), e)


def _unfold_rows(x: Tensor, hq: int, rows: int) -> Tensor:
    """``[B, Hkv, G*rows, ...]`` -> ``[B, Hq, rows, ...]``."""
    return x.reshape(x.shape[0], hq, rows, *x.shape[3:])


#: Largest bound on |score| for which the exponentials need no max-subtraction (float32 safe:
#: e^60 times any realistic key count stays far below the float32 maximum ~e^88, and e^-60 far
#: above the smallest normal number ~e^-87).
STATIC_SHIFT_BOUND = 60.0

LOG2E = 1.0 / math.log(2.0)


def _score_unit(r: AttnRequest) -> float:
    """Factor folded into the forward's score scale: ``log2(e)`` when nothing is added to the
    scaled scores (no softcap, ALiBi or float mask), so the softmax runs on ``exp2`` (torch's
    ``exp2`` is ~1.7x faster than ``exp`` on CPU; ``2^(s log2 e) = e^s``, same overflow range);
    1 otherwise. Masked scores are ``-inf`` in either unit."""
    plain = r.softcap is None and r.alibi_slopes is None and r.float_mask is None
    return LOG2E if plain else 1.0


def _exp_(x: Tensor, unit: float) -> Tensor:
    """Exponential in place in the scores' unit (see ``_score_unit``): ``2^x`` in log2 units, else ``e^x``."""
    return x.exp2_() if unit != 1.0 else x.exp_()


def _log(x: Tensor, unit: float) -> Tensor:
    """Inverse of ``_exp_``'s base: ``log2`` in log2 units, else the natural log."""
    return torch.log2(x) if unit != 1.0 else torch.log(x)


class _ScoreBound:
    """Per-row upper bound on |score| by Cauchy-Schwarz, evaluated one block of rows at a time
    (|q_i| * max_j |k_j| * scale, capped by the softcap), so no ``[B, H, Nq]`` tensor stays alive."""

    def __init__(self, r: AttnRequest, q: Tensor, k: Tensor) -> None:
        self.r, self.q = r, q
        self.k_max = k.float().norm(dim=-1).amax(dim=-1)  # [B, Hkv]

    def static(self, q_lo: int, q_hi: int) -> bool:
        """Whether every score of rows ``q_lo:q_hi`` is within ``STATIC_SHIFT_BOUND`` of zero."""
        r = self.r
        q_norm = self.q[:, :, q_lo:q_hi].float().norm(dim=-1).amax(dim=-1)  # [B, Hq]
        bound = float((q_norm.view(q_norm.shape[0], r.hkv, r.group) * self.k_max.unsqueeze(-1)).amax()) * r.scale
        if r.softcap is not None:
            bound = min(bound, r.softcap)
        return bound <= STATIC_SHIFT_BOUND


def _score_bound(r: AttnRequest, q: Tensor, k: Tensor) -> _ScoreBound | None:
    """The Cauchy-Schwarz bound of ``r``, or ``None`` if biases could push scores beyond it
    (float masks, negative ALiBi slopes)."""
    if r.float_mask is not None or (r.alibi_slopes is not None and bool((r.alibi_slopes < 0).any())):
        return None
    return _ScoreBound(r, q, k)


#: Smallest query sub-block the last band pieces shrink to.
MIN_TAIL_BLOCK = 8


def _band_pieces(band: Band, bq: int, nq: int, dv: int) -> list[tuple[int, Band]]:
    """Split ``band`` so that each piece's score buffer fits in the output rows not written yet.

    Returns ``(query block size, piece)`` pairs. The output is allocated empty and filled band
    after band, so its pages are touched only as rows are written; a piece whose ``bq x S`` scores
    per block take no more room than the rows after it keeps the peak at about the output's size.
    Far from the end that is the whole band; near the end the pieces shrink to one block, and
    where even one block does not fit, to sub-blocks of that block (down to ``MIN_TAIL_BLOCK``
    rows; each sees the block's whole key window, so the result is unchanged)."""
    def fits(rows: int, q_lo: int) -> bool:
        return rows * (band.width + dv) <= (nq - q_lo) * dv

    pieces: list[tuple[int, Band]] = []
    a = 0
    while a < band.count:
        q_lo = (band.first + a) * bq
        fit = (nq - q_lo) * dv // (bq * (band.width + dv))
        if fit >= 1 or bq % 2 or bq <= MIN_TAIL_BLOCK:
            n = min(band.count - a, max(1, fit))
            pieces.append((bq, band.part(a, n, bq)))
            a += n
            continue
        block = band.part(a, 1, bq)  # one block, cut into sub-blocks over its key window
        lo = q_lo
        while lo < q_lo + bq:
            sub = bq
            while sub // 2 >= MIN_TAIL_BLOCK and sub % 2 == 0 and (lo % sub or not fits(sub, lo)):
                sub //= 2
            pieces.append((sub, Band(lo // sub, 1, block.k_lo, block.width, block.needs_mask)))
            lo += sub
        a += 1
    return pieces


def _forward(r: AttnRequest, plan: TilePlan, q: Tensor, k: Tensor, v: Tensor,
             need_lse: bool = True) -> tuple[Tensor, Tensor | None]:
    """Online-softmax forward. Returns ``out [B, Hq, Nq, Dv]`` (input dtype) and float32 ``lse``
    (``None`` unless ``need_lse``).

    When every score of a query block is provably within ``STATIC_SHIFT_BOUND`` of zero, the
    block skips the running maximum entirely (shift 0: exact, and two passes over each tile
    fewer); otherwise it runs the classic max-tracking recurrence.
    """
    B, Hq, Nq, _ = q.shape
    Dv = v.shape[-1]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(B, Hq, Nq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Nq, dtype=acc_dtype, device=q.device) if need_lse else None
    bound = _score_bound(r, q, k)
    unit = _score_unit(r)  # scores in units of log2 when plain: exp2 below
    in_band = {i for band in plan.bands for i in range(band.first, band.first + band.count)}
    # Blocks outside bands first, bands last (in order): each band piece then finds the output rows
    # after it still unwritten (untouched pages) and sizes itself to fit there (_band_pieces).
    def row(i: int, chunks: tuple[Chunk, ...]) -> None:  # one query block (its temporaries die on return)
        q_lo, q_hi = i * plan.block_q, min(Nq, (i + 1) * plan.block_q)
        rows = q_hi - q_lo
        if not chunks:
            out[:, :, q_lo:q_hi] = 0
            if lse is not None:
                lse[:, :, q_lo:q_hi] = float("-inf")
            return
        q_t = _fold_q(q, r.hkv, r.group, q_lo, q_hi) * (r.scale * unit)  # [B, Hkv, G*bq, D], pre-scaled
        static = bound is not None and bound.static(q_lo, q_hi)
        m: Tensor | None = None
        acc: Tensor | None = None  # [B, Hkv, G*bq, Dv]: unnormalised output
        ell: Tensor | None = None  # [B, Hkv, G*bq, 1]: its normaliser
        for c in chunks:
            s, _ = _tile_scores(r, q_t, k[:, :, c.k_lo:c.k_hi], q_lo, q_hi, c)  # [B, Hkv, G*bq, bk]
            if static:
                p = _exp_(s, unit)  # shift 0; hidden keys -> 0
            else:
                m_c = s.amax(dim=-1, keepdim=True)
                m_new = m_c if m is None else torch.maximum(m, m_c)  # running max, -inf if nothing seen
                m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
                p = _exp_(s.sub_(m_safe), unit)  # in place on the tile; hidden keys -> 0
            # P V and the row sums as two calls: a V with a column of ones (one matmul) is slower,
            # as matmuls with Dv + 1 columns run ~20% below those with Dv = 64, plus the copy.
            pv = torch.matmul(p.to(v.dtype), v[:, :, c.k_lo:c.k_hi]).to(acc_dtype)  # [B, Hkv, G*bq, Dv]
            ell_c = p.sum(dim=-1, keepdim=True, dtype=acc_dtype)
            if acc is None or ell is None:
                acc, ell = pv, ell_c
            else:
                if m is not None:  # max-tracking: rescale old statistics; exp(-inf) = 0
                    alpha = _exp_(m - m_safe, unit)
                    acc, ell = acc.mul_(alpha), ell.mul_(alpha)
                acc, ell = acc.add_(pv), ell.add_(ell_c)
            if not static:
                m = m_new
        assert acc is not None and ell is not None
        ok = ell > 0
        safe_ell = torch.where(ok, ell, torch.ones_like(ell))
        o = acc.div_(safe_ell)
        shift = torch.zeros_like(ell) if m is None else torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        out[:, :, q_lo:q_hi] = _unfold_rows(o, Hq, rows).to(q.dtype)
        if lse is not None:
            row_lse = torch.where(ok, (shift + _log(safe_ell, unit)) / unit, torch.full_like(ell, float("-inf")))
            lse[:, :, q_lo:q_hi] = _unfold_rows(row_lse.squeeze(-1), Hq, rows)

    for i, chunks in enumerate(plan.rows):
        if i not in in_band:
            row(i, chunks)
    for band in plan.bands:
        for bq, piece in _band_pieces(band, plan.block_q, Nq, Dv):
            _forward_band(r, bq, piece, q, k, v, bound, out, lse)
    return out, lse


def _true_runs(flags: Tensor) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of consecutive True entries of a 1-d bool tensor."""
    f = flags.to(torch.int8).cpu()
    edges = torch.diff(f, prepend=f.new_zeros(1), append=f.new_zeros(1)).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2], strict=True))


@dataclass
class _BandScores:
    """A band's scaled, capped, biased and masked scores and the operand views that made them."""

    q_grp: Tensor  # [B, Hkv, g, G*bq, D] (a view of q without GQA)
    k_win: Tensor  # [B, Hkv, g, D, S] overlapping key windows (a strided view of k)
    v_win: Tensor  # [B, Hkv, g, S, Dv] overlapping value windows (a strided view of v)
    s: Tensor  # [B, Hkv, g, G*bq, S] float32/64 scores, -inf where hidden
    t: Tensor | None  # tanh(raw / softcap) when a softcap is set (for the backward pass)


def _band_scores(r: AttnRequest, bq: int, band: Band, q: Tensor, k: Tensor, v: Tensor,
                 unit: float = 1.0) -> _BandScores:
    """Scores of a band of query blocks in one batched matmul per KV head, times ``unit`` (see
    ``_score_unit``; only for requests without softcap or biases)."""
    B, Hq = q.shape[:2]
    Hkv, G, g, S = r.hkv, r.group, band.count, band.width
    q_lo = band.first * bq
    R = g * bq
    # [B, Hkv, g, G*bq, D]: a view without GQA; the scale is applied inside the matmul (alpha)
    q_grp = q[:, :, q_lo:q_lo + R].reshape(B, Hkv, G, g, bq, -1).transpose(2, 3).reshape(B, Hkv, g, G * bq, -1)
    span = slice(band.k_lo, band.k_lo + (g - 1) * bq + S)
    # Overlapping windows as strided views: torch.bmm reads them in place, whereas torch.matmul on
    # 5-d operands would first copy every window (S / bq times the band's keys and values).
    k_win = k[:, :, span].unfold(2, S, bq)  # [B, Hkv, g, D, S] (a view)
    v_win = v[:, :, span].unfold(2, S, bq).transpose(-1, -2)  # [B, Hkv, g, S, Dv] (a view)
    s = q_grp.new_empty(B, Hkv, g, G * bq, S)
    for b_i in range(B):
        for h_i in range(Hkv):
            # s = scale * q k^T  [g, G*bq, S]; beta=0 ignores the uninitialised input
            torch.baddbmm(s[b_i, h_i], q_grp[b_i, h_i], k_win[b_i, h_i], beta=0, alpha=r.scale * unit, out=s[b_i, h_i])
    if s.dtype not in (torch.float32, torch.float64):
        s = s.float()
    t: Tensor | None = None
    if r.softcap is not None:
        t = torch.tanh(s / r.softcap)
        s = t * r.softcap
    dev = q.device
    q_pos = (torch.arange(q_lo, q_lo + R, device=dev) + r.q_offset).view(1, 1, R, 1)

    def key_positions() -> Tensor:  # [1, 1, R, S] absolute key positions (only when needed: R x S int64)
        return (band.k_lo + torch.arange(g, device=dev).repeat_interleave(bq).view(1, 1, R, 1) * bq
                + torch.arange(S, device=dev).view(1, 1, 1, S))

    def fold(t: Tensor) -> Tensor:  # [b, Hq|1, R, S] -> [b, Hkv|1, g, G*bq, S]
        b, h = t.shape[:2]
        t = t.expand(b, h, R, S)
        if h == 1:
            return t.reshape(b, 1, g, 1, bq, S).expand(b, 1, g, G, bq, S).reshape(b, 1, g, G * bq, S)
        return t.reshape(b, Hkv, G, g, bq, S).transpose(2, 3).reshape(b, Hkv, g, G * bq, S)

    if r.alibi_slopes is not None:
        dist = (q_pos - key_positions()).abs().to(s.dtype)  # [1, 1, R, S]
        s = s + fold(-r.alibi_slopes.view(1, -1, 1, 1).to(s.dtype) * dist)
    if band.needs_mask and r.structure is not None:
        b_idx = torch.arange(r.batch, device=dev).view(-1, 1, 1, 1)
        h_idx = torch.arange(Hq, device=dev).view(1, -1, 1, 1)
        if r.structure.relative:  # the same pattern in every block of the band: evaluate one
            k_pos0 = (band.k_lo + torch.arange(S, device=dev)).view(1, 1, 1, S)  # the band's first block
            hidden = ~r.structure.fn(b_idx, h_idx, q_pos[:, :, :bq], k_pos0)
            hidden = hidden.reshape((1,) * (4 - hidden.dim()) + tuple(hidden.shape))
            b, h = hidden.shape[:2]
            hidden = hidden.expand(b, h, bq, S)
            if h == 1:
                hidden = hidden.unsqueeze(2).expand(b, 1, G, bq, S).reshape(b, 1, 1, G * bq, S)
            else:
                hidden = hidden.reshape(b, Hkv, 1, G * bq, S)
            # Fill only the key columns where something is hidden (a window's two edges).
            for c_lo, c_hi in _true_runs(hidden.reshape(-1, S).any(dim=0)):
                s[..., c_lo:c_hi].masked_fill_(hidden[..., c_lo:c_hi], float("-inf"))
        else:
            allowed = r.structure.fn(b_idx, h_idx, q_pos, key_positions())
            allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
            s.masked_fill_(~fold(allowed), float("-inf"))
    return _BandScores(q_grp, k_win, v_win, s, t)


def _forward_band(r: AttnRequest, bq: int, band: Band, q: Tensor, k: Tensor, v: Tensor,
                  bound: _ScoreBound | None, out: Tensor, lse: Tensor | None) -> None:
    """Forward of a band of query blocks in one batched matmul (K/V windows are strided views)."""
    B, Hq = q.shape[:2]
    Hkv, G, g = r.hkv, r.group, band.count
    q_lo = band.first * bq
    R = g * bq
    unit = _score_unit(r)  # log2 units when plain: exp2 below
    bs = _band_scores(r, bq, band, q, k, v, unit)
    s, v_win = bs.s, bs.v_win
    static = bound is not None and bound.static(q_lo, q_lo + R)
    shift: Tensor | None = None
    if not static:
        m = s.amax(dim=-1, keepdim=True)
        shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        s.sub_(shift)
    p = _exp_(s, unit)
    ell = p.sum(dim=-1, keepdim=True)  # [B, Hkv, g, G*bq, 1]
    p_v = p.to(v.dtype)
    Dv = v.shape[-1]
    # Without GQA and in the accumulation dtype, P V goes straight into the output rows (no copy).
    acc_dtype = s.dtype
    direct = G == 1 and out.dtype == acc_dtype == p_v.dtype
    acc = out[:, :, q_lo:q_lo + R].view(B, Hkv, g, bq, Dv) if direct else p_v.new_empty(B, Hkv, g, G * bq, Dv)
    for b_i in range(B):
        for h_i in range(Hkv):
            torch.bmm(p_v[b_i, h_i], v_win[b_i, h_i], out=acc[b_i, h_i])  # [g, G*bq, Dv]
    acc = acc.to(acc_dtype)
    ok = ell > 0
    safe = torch.where(ok, ell, torch.ones_like(ell))
    o = acc.div_(safe)

    def unfold_rows(t: Tensor) -> Tensor:  # [B, Hkv, g, G*bq, E] -> [B, Hq, R, E]
        return t.reshape(B, Hkv, g, G, bq, -1).transpose(2, 3).reshape(B, Hq, R, -1)

    if not direct:
        out[:, :, q_lo:q_lo + R] = unfold_rows(o).to(out.dtype)
    if lse is not None:
        row_lse = torch.where(ok, (_log(safe, unit) + (0 if shift is None else shift)) / unit,
                              torch.full_like(ell, float("-inf")))
        lse[:, :, q_lo:q_lo + R] = unfold_rows(row_lse).squeeze(-1)


def _backward_band(r: AttnRequest, bq: int, band: Band, q: Tensor, k: Tensor, v: Tensor, d_out: Tensor,
                   lse: Tensor, delta: Tensor, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Backward of a band: recompute its scores, then dQ for its rows and the overlapping
    windows' dK/dV (added back block by block: window slot ``t`` of block ``j`` is key block
    ``j + t``). ``dq`` gets ``dS K`` without the scale (the caller applies it once)."""
    B, Hq = q.shape[:2]
    Hkv, G, g, S = r.hkv, r.group, band.count, band.width
    q_lo = band.first * bq
    R = g * bq
    c = S // bq
    unit = _score_unit(r)  # log2 units when plain: exp2 below
    bs = _band_scores(r, bq, band, q, k, v, unit)
    acc_dtype = bs.s.dtype

    def fold_rows(x: Tensor) -> Tensor:  # [B, Hq, R, E] -> [B, Hkv, g, G*bq, E]
        return x.reshape(B, Hkv, G, g, bq, -1).transpose(2, 3).reshape(B, Hkv, g, G * bq, -1)

    lse_b = fold_rows(lse[:, :, q_lo:q_lo + R].unsqueeze(-1))
    lse_b = torch.where(torch.isfinite(lse_b), lse_b * unit, torch.full_like(lse_b, float("inf")))
    delta_b = fold_rows(delta[:, :, q_lo:q_lo + R].unsqueeze(-1))
    do_b = fold_rows(d_out[:, :, q_lo:q_lo + R])  # [B, Hkv, g, G*bq, Dv]
    p = _exp_(bs.s.sub_(lse_b), unit)  # [B, Hkv, g, G*bq, S]; hidden keys and empty rows -> 0
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


#: Score elements of one backward band piece (it keeps about four band-sized buffers alive).
BACKWARD_BAND_ELEMS = 1 << 21


def _backward(r: AttnRequest, plan: TilePlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              d_out: Tensor, d_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    B, Hq, Nq, _ = q.shape
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
    delta = (d_out.to(acc_dtype) * out.to(acc_dtype)).sum(dim=-1)  # [B, Hq, Nq]
    if d_lse is not None:  # d lse / d s = p, so a gradient on the LSE shifts delta
        delta = delta - torch.nan_to_num(d_lse.to(acc_dtype), nan=0.0, posinf=0.0, neginf=0.0)
    unit = _score_unit(r)
    done: set[int] = set()
    for band in plan.bands:
        if band.width % plan.block_q:  # the window must split into whole query blocks
            continue
        per = max(1, BACKWARD_BAND_ELEMS // max(1, B * Hq * plan.block_q * band.width))
        for a in range(0, band.count, per):
            piece = band.part(a, min(per, band.count - a), plan.block_q)
            _backward_band(r, plan.block_q, piece, q, k, v, d_out, lse, delta, dq, dk, dv)
        done.update(range(band.first, band.first + band.count))
    for i, chunks in enumerate(plan.rows):
        if not chunks or i in done:
            continue
        q_lo, q_hi = i * plan.block_q, min(Nq, (i + 1) * plan.block_q)
        q_t = _fold_q(q, r.hkv, r.group, q_lo, q_hi) * r.scale  # [B, Hkv, G*bq, D], pre-scaled
        do_t = _fold_q(d_out, r.hkv, r.group, q_lo, q_hi)  # [B, Hkv, G*bq, Dv]
        lse_t = lse[:, :, q_lo:q_hi].reshape(B, r.hkv, -1, 1)
        lse_t = torch.where(torch.isfinite(lse_t), lse_t * unit, torch.full_like(lse_t, float("inf")))
        q_s = q_t * unit if unit != 1.0 else q_t  # scores in log2 units when plain (exp2 below)
        delta_t = delta[:, :, q_lo:q_hi].reshape(B, r.hkv, -1, 1)
        dq_t = torch.zeros(q_t.shape, dtype=acc_dtype, device=q.device)
        for c in chunks:
            k_c, v_c = k[:, :, c.k_lo:c.k_hi], v[:, :, c.k_lo:c.k_hi]
            s, t = _tile_scores(r, q_s, k_c, q_lo, q_hi, c)
            p = _exp_(s.sub_(lse_t), unit)  # [B, Hkv, G*bq, bk]; rows with no key -> 0
            dv[:, :, c.k_lo:c.k_hi] += torch.matmul(p.transpose(-1, -2).to(v.dtype), do_t)
            dp = torch.matmul(do_t, v_c.transpose(-1, -2)).to(acc_dtype)
            ds = p * (dp - delta_t)
            if t is not None:
                ds = ds * (1 - t * t)
            ds_in = ds.to(q.dtype)
            dq_t += torch.matmul(ds_in, k_c)
            dk[:, :, c.k_lo:c.k_hi] += torch.matmul(ds_in.transpose(-1, -2), q_t)
        dq[:, :, q_lo:q_hi] = _unfold_rows(dq_t, Hq, q_hi - q_lo)
    # q_t was pre-scaled: dS/dq = scale * k and dk accumulated against scaled q already.
    return dq.mul_(r.scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, r: AttnRequest, plan: TilePlan):  # type: ignore[override]
        out, lse = _forward(r, plan, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.r, ctx.plan = r, plan
        return out, lse

    @staticmethod
    def backward(ctx, d_out: Tensor, d_lse: Tensor | None):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.r, ctx.plan, q, k, v, out, lse, d_out.contiguous(), d_lse)
        return dq, dk, dv, None, None


@functools.cache
def native_half_matmul(dtype: torch.dtype, device_type: str) -> bool:
    """Whether ``device_type`` multiplies ``dtype`` (float16/bfloat16) matrices natively.

    CUDA: yes. CPU: only with the AVX-512/AMX half-precision instructions (read from
    ``/proc/cpuinfo``); without them torch's CPU half matmuls are orders of magnitude slower than
    float32 ones, so the tiled backend computes each tile in float32 instead.
    """
    if device_type != "cpu":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:  # pragma: no cover - non-Linux
        return False
    wanted = {"avx512_bf16", "amx_bf16"} if dtype == torch.bfloat16 else {"avx512_fp16", "amx_fp16"}
    return bool(flags & wanted)


def plan_for(r: AttnRequest, block_q: int | None = None, block_k: int | None = None) -> TilePlan:
    """The plan ``tiled_attention`` runs ``r`` with (also used by the custom operators of
    ``attnzoo.functional.tiled_ops``, whose backward recomputes it from the same request)."""
    plan = tile_plan(r, block_q or BLOCK_Q, block_k or BLOCK_K)
    if block_q is None and plan.bands and 2 * sum(b.count for b in plan.bands) >= plan.n_q_blocks:
        # A sliding window: smaller query blocks waste fewer masked scores per band row
        # (width = block + window), and bands keep the number of Python steps small.
        reach = max(b.width for b in plan.bands) - plan.block_q
        bq = max(MIN_BAND_BLOCK, min(plan.block_q, 1 << max(0, (max(1, reach) - 1).bit_length() - 2)))
        if bq < plan.block_q:
            plan = tile_plan(r, bq, min(bq, plan.block_k))
    return plan


def tiled_attention(r: AttnRequest, block_q: int | None = None,
                    block_k: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Exact attention by key tiles. Returns ``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq] float32)``;
    ``lse`` is ``None`` for a forward-only request without ``return_lse`` (not computed then).

    Gradients flow to q, k and v from both outputs (a gradient on the LSE is what merging
    partial results needs); not to float masks or ALiBi slopes (the dispatcher routes requests
    that need those gradients elsewhere)."""
    plan = plan_for(r, block_q, block_k)
    q, k, v = r.q, r.k, r.v
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half and not native_half_matmul(q.dtype, q.device.type):
        q, k, v = q.float(), k.float(), v.float()  # tile math in float32; memory stays O(N x block)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _TiledAttention.apply(q, k, v, r, plan)
    else:
        out, lse = _forward(r, plan, q, k, v, need_lse=r.return_lse)
    return out.to(r.q.dtype), lse
