"""Scores of the ``tiled`` backend: one tile (a query block x a key chunk) or one sliding-window
band, scaled, capped, biased and masked, plus the exponent unit and the static-shift bound that
the forward and backward passes share (see the package docstring for the math)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnzoo.functional.backends.tiled.plan import Band, Chunk
from attnzoo.functional.core._request import AttnRequest
from attnzoo.functional.core.rules import alibi_bias


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


def raw_tile_scores(r: AttnRequest, q_t: Tensor, k_c: Tensor) -> tuple[Tensor, Tensor | None]:
    """Scaled and capped float32/64 scores of one tile ``[B, Hkv, G*bq, bk]`` (``q_t`` is pre-scaled),
    and ``tanh(raw / softcap)`` when a softcap is set (for the backward pass)."""
    s = torch.matmul(q_t, k_c.transpose(-1, -2))  # [B, Hkv, G*bq, bk]
    if s.dtype != torch.float32 and s.dtype != torch.float64:
        s = s.float()
    return cap_scores(r, s)


def cap_scores(r: AttnRequest, s: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(softcap * tanh(s / softcap), tanh(s / softcap))`` when ``r`` sets a softcap, else ``(s, None)``."""
    if r.softcap is None:
        return s, None
    t = torch.tanh(s / r.softcap)
    return t * r.softcap, t


def as_heads(r: AttnRequest, s: Tensor) -> Tensor:
    """A tile ``[B, Hkv, G*bq, bk]`` viewed as ``[B, Hq, bq, bk]`` (the folded rows are head-major)."""
    return s.view(s.shape[0], r.hq, -1, s.shape[-1])


def finish_tile_scores(r: AttnRequest, s: Tensor, q_lo: int, q_hi: int, chunk: Chunk) -> Tensor:
    """A tile's scores after the user's ``score_mod``, ALiBi, float mask and structure (``-inf``)."""
    if r.score_mod is not None:
        s = r.modify(as_heads(r, s), q_lo, q_hi, chunk.k_lo, chunk.k_hi).reshape(s.shape)
    rows, cols = q_hi - q_lo, chunk.k_hi - chunk.k_lo
    bias = _fold(r.bias(q_lo, q_hi, chunk.k_lo, chunk.k_hi), r.hkv, r.group, rows, cols)
    if bias is not None:
        s = s + bias
    if chunk.needs_mask:
        allowed = _fold(r.allowed(q_lo, q_hi, chunk.k_lo, chunk.k_hi), r.hkv, r.group, rows, cols)
        if allowed is not None:
            s = s.masked_fill_(~allowed, float("-inf"))
    return s


def tile_scores(r: AttnRequest, q_t: Tensor, k_c: Tensor, q_lo: int, q_hi: int, chunk: Chunk,
                 ) -> tuple[Tensor, Tensor | None]:
    """Scaled, capped, modified, biased and masked float32 scores of one tile ``[B, Hkv, G*bq, bk]``.

    Also returns ``tanh(raw / softcap)`` when a softcap is set (for the backward pass)."""
    s, t = raw_tile_scores(r, q_t, k_c)
    return finish_tile_scores(r, s, q_lo, q_hi, chunk), t


def fold_q(x: Tensor, hkv: int, group: int, lo: int, hi: int) -> Tensor:
    """Rows ``lo:hi`` of ``[B, Hq, N, E]`` as ``[B, Hkv, G*(hi-lo), E]``."""
    b, _, _, e = x.shape
    return x[:, :, lo:hi].reshape(b, hkv, group * (hi - lo), e)


def unfold_rows(x: Tensor, hq: int, rows: int) -> Tensor:
    """``[B, Hkv, G*rows, ...]`` -> ``[B, Hq, rows, ...]``."""
    return x.reshape(x.shape[0], hq, rows, *x.shape[3:])


#: Largest bound on |score| for which the exponentials need no max-subtraction (float32 safe:
#: e^60 times any realistic key count stays far below the float32 maximum ~e^88, and e^-60 far
#: above the smallest normal number ~e^-87).
STATIC_SHIFT_BOUND = 60.0

LOG2E = 1.0 / math.log(2.0)


def score_unit(r: AttnRequest) -> float:
    """Factor folded into the forward's score scale: ``log2(e)`` when nothing is added to the
    scaled scores (no softcap, ALiBi or float mask), so the softmax runs on ``exp2`` (torch's
    ``exp2`` is ~1.7x faster than ``exp`` on CPU; ``2^(s log2 e) = e^s``, same overflow range);
    1 otherwise. Masked scores are ``-inf`` in either unit."""
    plain = r.softcap is None and r.alibi_slopes is None and r.float_mask is None and r.score_mod is None
    return LOG2E if plain else 1.0


def exp_(x: Tensor, unit: float) -> Tensor:
    """Exponential in place in the scores' unit (see ``score_unit``): ``2^x`` in log2 units, else ``e^x``."""
    return x.exp2_() if unit != 1.0 else x.exp_()


def log_(x: Tensor, unit: float) -> Tensor:
    """Inverse of ``exp_``'s base: ``log2`` in log2 units, else the natural log."""
    return torch.log2(x) if unit != 1.0 else torch.log(x)


class ScoreBound:
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


def score_bound(r: AttnRequest, q: Tensor, k: Tensor) -> ScoreBound | None:
    """The Cauchy-Schwarz bound of ``r``, or ``None`` if biases could push scores beyond it
    (float masks, a ``score_mod``, negative ALiBi slopes)."""
    if r.float_mask is not None or r.score_mod is not None or (r.alibi_slopes is not None and bool((r.alibi_slopes < 0).any())):
        return None
    return ScoreBound(r, q, k)



def true_runs(flags: Tensor) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of consecutive True entries of a 1-d bool tensor."""
    f = flags.to(torch.int8).cpu()
    edges = torch.diff(f, prepend=f.new_zeros(1), append=f.new_zeros(1)).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2], strict=True))


@dataclass
class BandScores:
    """A band's scaled, capped, biased and masked scores and the operand views that made them."""

    q_grp: Tensor  # [B, Hkv, g, G*bq, D] (a view of q without GQA)
    k_win: Tensor  # [B, Hkv, g, D, S] overlapping key windows (a strided view of k)
    v_win: Tensor  # [B, Hkv, g, S, Dv] overlapping value windows (a strided view of v)
    s: Tensor  # [B, Hkv, g, G*bq, S] float32/64 scores, -inf where hidden
    t: Tensor | None  # tanh(raw / softcap) when a softcap is set (for the backward pass)


@dataclass(frozen=True)
class _BandGeometry:
    """Positions of a band's ``R = g * bq`` query rows and ``S``-key windows, and the fold of
    ``[b, Hq|1, R, S]`` tensors onto its score layout ``[b, Hkv|1, g, G*bq, S]``."""

    hkv: int
    group: int
    bq: int
    g: int
    S: int
    k_lo: int
    q_pos: Tensor  # [1, 1, R, 1] absolute query positions

    def key_positions(self) -> Tensor:
        """``[1, 1, R, S]`` absolute key positions (only when needed: ``R x S`` int64)."""
        dev, R = self.q_pos.device, self.g * self.bq
        return (self.k_lo + torch.arange(self.g, device=dev).repeat_interleave(self.bq).view(1, 1, R, 1) * self.bq
                + torch.arange(self.S, device=dev).view(1, 1, 1, self.S))

    def fold(self, t: Tensor) -> Tensor:
        G, g, bq, S = self.group, self.g, self.bq, self.S
        b, h = t.shape[:2]
        t = t.expand(b, h, g * bq, S)
        if h == 1:
            return t.reshape(b, 1, g, 1, bq, S).expand(b, 1, g, G, bq, S).reshape(b, 1, g, G * bq, S)
        return t.reshape(b, self.hkv, G, g, bq, S).transpose(2, 3).reshape(b, self.hkv, g, G * bq, S)


def _band_matmul(r: AttnRequest, bq: int, band: Band, q: Tensor, k: Tensor, v: Tensor,
                 unit: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q_grp, k_win, v_win, scale * unit * q k^T)`` of a band, one batched matmul per KV head."""
    B = q.shape[0]
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
    return q_grp, k_win, v_win, s


def _mask_band(r: AttnRequest, geo: _BandGeometry, s: Tensor) -> None:
    """Fill the hidden scores of a band with ``-inf`` in place (``r.structure`` is set)."""
    assert r.structure is not None
    dev = s.device
    b_idx = torch.arange(r.batch, device=dev).view(-1, 1, 1, 1)
    h_idx = torch.arange(r.hq, device=dev).view(1, -1, 1, 1)
    if not r.structure.relative:
        allowed = r.structure.fn(b_idx, h_idx, geo.q_pos, geo.key_positions())
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
        s.masked_fill_(~geo.fold(allowed), float("-inf"))
        return
    # The same pattern in every block of the band: evaluate the band's first block only.
    bq, S, G = geo.bq, geo.S, geo.group
    k_pos0 = (geo.k_lo + torch.arange(S, device=dev)).view(1, 1, 1, S)
    hidden = ~r.structure.fn(b_idx, h_idx, geo.q_pos[:, :, :bq], k_pos0)
    hidden = hidden.reshape((1,) * (4 - hidden.dim()) + tuple(hidden.shape))
    b, h = hidden.shape[:2]
    hidden = hidden.expand(b, h, bq, S)
    if h == 1:
        hidden = hidden.unsqueeze(2).expand(b, 1, G, bq, S).reshape(b, 1, 1, G * bq, S)
    else:
        hidden = hidden.reshape(b, geo.hkv, 1, G * bq, S)
    # Fill only the key columns where something is hidden (a window's two edges).
    for c_lo, c_hi in true_runs(hidden.reshape(-1, S).any(dim=0)):
        s[..., c_lo:c_hi].masked_fill_(hidden[..., c_lo:c_hi], float("-inf"))


def band_scores(r: AttnRequest, bq: int, band: Band, q: Tensor, k: Tensor, v: Tensor,
                unit: float = 1.0) -> BandScores:
    """Scores of a band of query blocks in one batched matmul per KV head, times ``unit`` (see
    ``score_unit``; only for requests without softcap or biases)."""
    q_grp, k_win, v_win, s = _band_matmul(r, bq, band, q, k, v, unit)
    s, t = cap_scores(r, s)
    q_lo, R = band.first * bq, band.count * bq
    q_pos = (torch.arange(q_lo, q_lo + R, device=q.device) + r.q_offset).view(1, 1, R, 1)
    geo = _BandGeometry(r.hkv, r.group, bq, band.count, band.width, band.k_lo, q_pos)
    if r.alibi_slopes is not None:
        s = s + geo.fold(alibi_bias(r.alibi_slopes.view(1, -1, 1, 1).to(s.dtype), q_pos, geo.key_positions()))
    if band.needs_mask and r.structure is not None:
        _mask_band(r, geo, s)
    return BandScores(q_grp, k_win, v_win, s, t)
