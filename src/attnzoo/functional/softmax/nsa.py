"""Native sparse attention (Yuan et al. 2025, DeepSeek): compressed, selected and sliding branches.

Positions follow ``docs/conventions.md``: query row ``i`` sits at ``t = q_offset + i``; key ``j`` at
``j``. Query head ``h`` reads key/value head ``g = h // (H // Hkv)`` (GQA). Three branches:

* **compressed**: block ``i`` covers tokens ``[i d, i d + l)`` (length ``l``, stride ``d``) and is
  summarised into one key and one value (:func:`compress_blocks`: a learned MLP over the block's
  tokens plus an intra-block position embedding, as published). The query at ``t`` sees block ``i``
  iff it **ends** at or before ``t`` (``i d + l - 1 <= t``): nothing from the future.
* **selected**: selection block ``j`` covers ``[j l', (j + 1) l')``. Its importance for the query
  at ``t`` is the sum of the compressed branch's probabilities of the compressed blocks overlapping
  it, summed over the query heads of a GQA group (all heads of a group share their blocks). The
  first block and the ``local_blocks`` most recent blocks are always taken, then the highest scores
  up to ``num_selected`` blocks among those starting at or before ``t``; attention runs over their
  tokens ``<= t``.
* **window**: causal sliding window of ``w`` tokens, ``az.attention(window=(w - 1, 0), causal=True)``.

``out = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win`` with per-head gates ``[B, H, N, 3]`` in (0, 1).

Two forms: ``"reference"`` materialises every branch densely (``[N, N]`` masks, float64 friendly,
written from the definition); ``"fast"`` walks the queries in chunks, attends each chunk over the
compressed blocks it can see, and **gathers only the selected key/value blocks** of every
(group, query): the selected branch costs ``n l'`` keys per query whatever ``N``.

Every size and branch of the fast form comes from Python ints, never from tensor values (no host
sync, no graph break). Under ``torch.compile`` the compressed and selected branches run as one
custom operator, ``attnzoo::nsa_sparse_fwd`` (backward: ``attnzoo::nsa_sparse_bwd``, the softmax
backward of both branches from the probabilities and picks the forward saved), and the window
branch as one batched ``az.attention`` call over blocks of queries (:func:`_window_banded`), as in eager.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import check_choice, check_int
from attnzoo.functional.backends.tiled.native import native_nsa_selected, native_nsa_selected_train
from attnzoo.functional.core.rules import compute_dtype
from attnzoo.functional.softmax.attention import attention

__all__ = ["NSAConfig", "compress_blocks", "nsa_attention", "num_compressed", "pick_blocks"]

FORMS = ("auto", "fast", "reference")


@dataclass(frozen=True)
class NSAConfig:
    """Block sizes of native sparse attention (paper defaults: ``l=32, d=16, l'=64, n=16, w=512``).

    Attributes:
        block_len: ``l``, tokens per compressed block.
        block_stride: ``d``, stride between compressed blocks (``d <= l``: no token skipped).
        select_len: ``l'``, tokens per selection block (``d <= l'``).
        num_selected: ``n``, selected blocks per query (``n >= 1 + local_blocks``).
        window: ``w``, tokens of the sliding window (the query's own included).
        local_blocks: most recent selection blocks always selected (the current one included).
    """

    block_len: int = 32
    block_stride: int = 16
    select_len: int = 64
    num_selected: int = 16
    window: int = 512
    local_blocks: int = 2

    def __post_init__(self) -> None:
        for name in ("block_len", "block_stride", "select_len", "num_selected", "window", "local_blocks"):
            check_int(getattr(self, name), name, minimum=1, owner="NSAConfig")
        if self.block_stride > self.block_len or self.block_stride > self.select_len:
            raise ValueError(f"NSAConfig: block_stride must be <= block_len and <= select_len, got block_stride="
                             f"{self.block_stride}, block_len={self.block_len}, select_len={self.select_len}")
        if self.num_selected < 1 + self.local_blocks:
            raise ValueError(f"NSAConfig: num_selected must be >= 1 + local_blocks = {1 + self.local_blocks} (the "
                             f"first and the local blocks are always selected), got {self.num_selected}")


def num_compressed(n: int, block_len: int, block_stride: int) -> int:
    """Number of complete compressed blocks among the first ``n`` tokens."""
    return 0 if n < block_len else (n - block_len) // block_stride + 1


def compress_blocks(x: Tensor, pos: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                    block_len: int, block_stride: int) -> Tensor:
    """Compress ``x [B, h, N, D]`` into one vector per complete block: ``[B, h, Nc, Do]``.

    ``phi(X_i) = W2 gelu(W1 vec(X_i + pos) + b1) + b2`` with ``X_i = x[..., i d : i d + l, :]``,
    ``pos [l, D]`` the intra-block position embedding, ``w1 [Dh, l D]``, ``w2 [Do, Dh]``.
    """
    B, h, N, D = x.shape
    if tuple(pos.shape) != (block_len, D) or w1.shape[-1] != block_len * D:
        raise ValueError(f"compress_blocks: expected pos [l, D] = {[block_len, D]} and w1 [Dh, l*D = {block_len * D}], "
                         f"got pos {tuple(pos.shape)} and w1 {tuple(w1.shape)}")
    nc = num_compressed(N, block_len, block_stride)
    if nc == 0:
        return x.new_zeros(B, h, 0, w2.shape[0])
    blocks = x.unfold(2, block_len, block_stride)[:, :, :nc]  # [B, h, Nc, D, l]
    flat = (blocks.transpose(-1, -2) + pos).flatten(-2)  # [B, h, Nc, l*D]
    hidden = torch.nn.functional.gelu(torch.nn.functional.linear(flat, w1, b1))
    return torch.nn.functional.linear(hidden, w2, b2)


def _masked_softmax(s: Tensor, allowed: Tensor, empty_rows: bool, first: int = 0) -> Tensor:
    """Softmax over the last axis restricted to ``allowed``; rows with nothing allowed give zeros.

    ``empty_rows`` says (from Python ints, never from tensor data: no host sync, no graph break)
    whether some row may allow nothing; without such rows the plain softmax runs (two passes).
    ``s`` is overwritten (every caller passes freshly computed scores). Columns before ``first`` are
    allowed in every row: only the rest is masked."""
    if s.shape[-1] == 0:
        return s
    s[..., first:].masked_fill_(~allowed[..., first:], float("-inf"))
    if not empty_rows:
        return torch.softmax(s, dim=-1)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    return e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)


def pick_blocks(scores: Tensor, t: Tensor, cfg: NSAConfig) -> tuple[Tensor, Tensor]:
    """The selection rule: ``scores [B, G, Nq, Ns]`` of the queries at ``t [Nq]`` -> ``(idx, ok)``,
    both ``[B, G, Nq, min(n, Ns)]``: block ids and whether each pick is a real (causal) block.

    Block ``j`` may be picked iff ``j l' <= t``; block 0 and the ``local_blocks`` blocks ending at
    ``t``'s own block are always picked; the rest go by score (top-n).
    """
    ns = scores.shape[-1]
    j = torch.arange(ns, device=scores.device)
    valid = j[None, :] * cfg.select_len <= t[:, None]  # [Nq, Ns]
    back = (t // cfg.select_len)[:, None] - j[None, :]
    forced = (j[None, :] == 0) | ((back >= 0) & (back < cfg.local_blocks))
    s = scores.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))
    idx = s.topk(min(cfg.num_selected, ns), dim=-1).indices
    ok = valid.expand_as(s).gather(-1, idx)
    return idx, ok


# --------------------------------------------------------------------------- reference
def _reference(q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor, cfg: NSAConfig,
               q_offset: int, scale: float) -> Tensor:
    """Every branch materialised densely over all ``[Nq, Nk]`` pairs (see the module docstring)."""
    B, H, Nq, _ = q.shape
    G, Nk, Nc = k.shape[1], k.shape[2], k_cmp.shape[2]
    r = H // G
    t = torch.arange(Nq, device=q.device) + q_offset  # [Nq]
    key = torch.arange(Nk, device=q.device)
    # compressed branch: block i visible iff it ends at or before t
    ends = torch.arange(Nc, device=q.device) * cfg.block_stride + cfg.block_len - 1
    p_cmp = _masked_softmax(q @ k_cmp.repeat_interleave(r, 1).transpose(-1, -2) * scale, ends[None, :] <= t[:, None],
                            q_offset < cfg.block_len - 1)
    o_cmp = p_cmp @ v_cmp.repeat_interleave(r, 1)
    # importance of selection block j: compressed blocks overlapping it, summed over the group
    ns = -(-Nk // cfg.select_len)
    starts = torch.arange(Nc, device=q.device)[:, None] * cfg.block_stride
    jl = torch.arange(ns, device=q.device)[None, :] * cfg.select_len
    wide = compute_dtype(q.dtype)  # block scores in float32 at least: bf16 ties flip the top-k
    overlap = ((starts < jl + cfg.select_len) & (starts + cfg.block_len > jl)).to(wide)  # [Nc, Ns]
    imp = (p_cmp.detach().to(wide) @ overlap).view(B, G, r, Nq, ns).sum(2)
    idx, ok = pick_blocks(imp, t, cfg)
    chosen = torch.zeros(B, G, Nq, ns, dtype=torch.bool, device=q.device).scatter(-1, idx, ok)
    tokens = chosen[..., key // cfg.select_len] & (key[None, :] <= t[:, None])  # [B, G, Nq, Nk]
    kk, vv = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    o_slc = _masked_softmax(q @ kk.transpose(-1, -2) * scale, tokens.repeat_interleave(r, 1), False) @ vv  # key 0
    in_window = (key[None, :] <= t[:, None]) & (key[None, :] > t[:, None] - cfg.window)
    o_win = _masked_softmax(q @ kk.transpose(-1, -2) * scale, in_window, False) @ vv  # key t always in
    return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win


# --------------------------------------------------------------------------- fast path
def _overlap_scores(p: Tensor, ns: int, cfg: NSAConfig) -> Tensor:
    """``p [B, G, c, Nc]`` (compressed probabilities) -> importance ``[B, G, c, ns]``: each
    compressed block adds its probability to every selection block it overlaps (banded: at most
    ``ceil((l - 1) / l') + 1`` of them, so a few ``index_add`` calls, no ``[Nc, Ns]`` matrix).

    A block with no ``r``-th overlapped selection block adds an exact ``0`` (to a clamped index)
    instead of being filtered out: the same sums, and no shape read from tensor data."""
    nc = p.shape[-1]
    if nc and cfg.select_len % cfg.block_stride == 0:
        return _overlap_scores_periodic(p, ns, cfg)
    out = p.new_zeros(*p.shape[:-1], ns)
    if nc == 0:
        return out
    start = torch.arange(nc, device=p.device) * cfg.block_stride
    first = start // cfg.select_len
    for r in range(-(-(cfg.block_len - 1) // cfg.select_len) + 1):
        j = first + r
        keep = (j * cfg.select_len <= start + cfg.block_len - 1) & (j < ns)
        out.index_add_(-1, j.clamp_max(ns - 1), torch.where(keep, p, torch.zeros_like(p)))
    return out


def _overlap_scores_periodic(p: Tensor, ns: int, cfg: NSAConfig) -> Tensor:
    """:func:`_overlap_scores` when ``d`` divides ``l'`` (``m = l' / d`` compressed blocks start in each
    selection block): block ``i`` starts in selection block ``i // m`` and reaches ``u`` blocks
    further iff ``u l' <= (i mod m) d + l - 1``, a pattern of period ``m``. So ``p`` is cut into rows
    of ``m`` blocks, one ``[m, U]`` matmul sums each row under every reach ``u``, and the sums are
    added ``u`` selection blocks further: no scatter over the last axis."""
    nc, lp, d = p.shape[-1], cfg.select_len, cfg.block_stride
    m = lp // d
    rows = -(-nc // m)
    reach = torch.arange(-(-(cfg.block_len - 1) // lp) + 1, device=p.device)  # [U]
    phase = torch.arange(m, device=p.device)[:, None] * d
    pattern = (reach[None, :] * lp <= phase + cfg.block_len - 1).to(p.dtype)  # [m, U]
    sums = F.pad(p, (0, rows * m - nc)).unflatten(-1, (rows, m)) @ pattern  # [..., rows, U]
    out = p.new_zeros(*p.shape[:-1], max(ns, rows + reach.numel()))
    for u in range(reach.numel()):
        out[..., u:u + rows] += sums[..., u]
    return out[..., :ns]


def _chunk_compressed(qg: Tensor, k_cmp: Tensor, v_cmp: Tensor, t: Tensor, t0: int, cfg: NSAConfig,
                      scale: float) -> tuple[Tensor, Tensor]:
    """Compressed branch of one query chunk ``qg [B, G, r, c, D]`` at positions ``t = t0 .. t0 + c - 1``
    (``t0`` a Python int): ``(o [B, G, r, c, Dv], p [B, G, r, c, nc])`` over the ``nc`` blocks the
    chunk's last query can see."""
    B, G, r, c, _ = qg.shape
    nc = min(k_cmp.shape[2], num_compressed(t0 + c, cfg.block_len, cfg.block_stride))
    if nc == 0:
        return qg.new_zeros(B, G, r, c, v_cmp.shape[-1]), qg.new_zeros(B, G, r, c, 0)
    ends = torch.arange(nc, device=qg.device) * cfg.block_stride + cfg.block_len - 1
    s = torch.einsum("bgrcd,bgnd->bgrcn", qg * scale, k_cmp[:, :, :nc])  # scaled once, on the queries
    first = min(nc, num_compressed(t0 + 1, cfg.block_len, cfg.block_stride))  # seen by every query of the chunk
    p = _masked_softmax(s, ends[None, :] <= t[:, None], t0 < cfg.block_len - 1, first)
    return torch.einsum("bgrcn,bgnd->bgrcd", p, v_cmp[:, :, :nc]), p


def _chunk_selected(qg: Tensor, kb: Tensor, vb: Tensor, idx: Tensor, ok: Tensor, t: Tensor, cfg: NSAConfig,
                    scale: float) -> tuple[Tensor, Tensor]:
    """Selected branch of one chunk: gather the picked blocks ``idx [B, G, c, n]`` of
    ``kb, vb [B, G, Ns, l', D]`` and attend over their tokens ``<= t`` only: ``(o [B, G, r, c, Dv],
    p [B, G, r, c, n l'])``."""
    ksel, vsel = _gather_blocks(kb, idx), _gather_blocks(vb, idx)  # [B, G, c, n*l', D]
    kpos = (idx[..., None] * cfg.select_len + torch.arange(cfg.select_len, device=kb.device)).flatten(3)
    allowed = ok.repeat_interleave(cfg.select_len, -1) & (kpos <= t[:, None])  # [B, G, c, n*l']
    if qg.dtype == torch.float16:  # scaled first: unscaled float16 scores overflow (to inf, then NaN rows)
        s = torch.einsum("bgrcd,bgcmd->bgrcm", qg * scale, ksel)
    else:  # the compiled kernel's order (its operator and this eager form agree to rounding)
        s = torch.einsum("bgrcd,bgcmd->bgrcm", qg, ksel) * scale
    p = _masked_softmax(s, allowed[:, :, None], False)  # block 0 is always picked, and key 0 <= t
    return torch.einsum("bgrcm,bgcmd->bgrcd", p, vsel), p


def _flat_blocks(idx: Tensor, ns: int) -> Tensor:
    """Picks ``idx [B, G, c, n]`` as rows of the ``[B G Ns, ...]`` block table: ``[B G c n]``."""
    B, G = idx.shape[:2]
    base = torch.arange(B * G, device=idx.device).view(B, G, 1, 1) * ns
    return (idx + base).flatten()


def _gather_blocks(kb: Tensor, idx: Tensor) -> Tensor:
    """The picked blocks ``idx [B, G, c, n]`` of ``kb [B, G, Ns, l', D]``: ``[B, G, c, n l', D]``
    (one ``index_select`` of whole blocks: a row copy each, and an ``index_add`` backward)."""
    B, G, ns, lp, D = kb.shape
    rows = kb.reshape(B * G * ns, lp * D).index_select(0, _flat_blocks(idx, ns))
    return rows.view(B, G, idx.shape[2], idx.shape[3] * lp, D)


def _add_to_blocks(db: Tensor, idx: Tensor, grads: Tensor) -> None:
    """The transpose of :func:`_gather_blocks`: add ``grads [B, G, c, n l', D]`` of the picked blocks
    ``idx [B, G, c, n]`` into ``db [B, G, Ns, l', D]`` (contiguous) in place, one ``index_add``."""
    B, G, ns, lp, D = db.shape
    rows = _flat_blocks(idx, ns)
    db.view(B * G * ns, lp * D).index_add_(0, rows, grads.reshape(rows.numel(), lp * D))


def _blocks(x: Tensor, select_len: int) -> Tensor:
    """``x [B, G, Nk, D]`` zero-padded to whole selection blocks: ``[B, G, Ns, l', D]``."""
    B, G, Nk, D = x.shape
    ns = -(-Nk // select_len)
    pad = ns * select_len - Nk
    if pad:
        x = torch.cat([x, x.new_zeros(B, G, pad, D)], dim=2)
    return x.view(B, G, ns, select_len, D)


def _fast(q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor, cfg: NSAConfig,
          q_offset: int, scale: float, query_chunk: int, backend: str) -> Tensor:
    """Compressed and selected branches one query chunk at a time (one operator, ``nsa_sparse_fwd``,
    when compiled); the window through az.attention."""
    if tracing():  # one node, not a loop over chunks unrolled into the graph
        args = (q, k, v, k_cmp, v_cmp, gates, *(getattr(cfg, name) for name in _CONFIG_FIELDS), q_offset, scale,
                query_chunk)
        if torch.is_grad_enabled() and any(t.requires_grad for t in args[:6]):
            sparse = nsa_sparse_fwd(*args)[0]  # saves what its backward reads
        else:
            sparse = nsa_sparse(*args)  # inference: the output only
    else:
        sparse = _sparse(q, k, v, k_cmp, v_cmp, gates, cfg, q_offset, scale, query_chunk)
    return sparse + gates[..., 2:3] * _window(q, k, v, cfg, q_offset, scale, query_chunk, backend)


def _sparse(q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor, cfg: NSAConfig,
            q_offset: int, scale: float, query_chunk: int, keep: list[tuple[Tensor, ...]] | None = None) -> Tensor:
    """``g_cmp o_cmp + g_slc o_slc [B, H, Nq, Dv]``, one query chunk at a time (see the module docstring).

    ``keep``: a list that receives, per chunk, ``(o_cmp, o_slc, p_cmp, p_slc, idx)`` (what the
    analytic backward :func:`_sparse_bwd` reads)."""
    H, Nq = q.shape[1], q.shape[2]
    G = k.shape[1]
    r = H // G
    kb, vb = _blocks(k, cfg.select_len), _blocks(v, cfg.select_len)
    if keep is None and Nq >= BLOCK_MAJOR_MIN_QUERIES and not tracing():
        return _sparse_block_major(q, kb, vb, k_cmp, v_cmp, gates, cfg, q_offset, scale, query_chunk)
    outs = []
    for a in range(0, Nq, query_chunk):
        qg = q[:, :, a:a + query_chunk].unflatten(1, (G, r))  # [B, G, r, c, D]
        t0, t1 = q_offset + a, q_offset + min(Nq, a + query_chunk)  # chunk positions [t0, t1), Python ints
        t = torch.arange(t0, t1, device=q.device)
        o_cmp, p = _chunk_compressed(qg, k_cmp, v_cmp, t, t0, cfg, scale)
        with torch.no_grad():
            imp = _overlap_scores(p.detach().to(compute_dtype(p.dtype)).sum(2), (t1 - 1) // cfg.select_len + 1, cfg)
            idx, ok = pick_blocks(imp, t, cfg)
        o_slc, p_slc = _chunk_selected(qg, kb, vb, idx, ok, t, cfg, scale)
        g = gates[:, :, a:a + query_chunk].unflatten(1, (G, r))
        outs.append(g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc)
        if keep is not None:
            keep.append((o_cmp, o_slc, p, p_slc, idx))
    return torch.cat(outs, dim=3).flatten(1, 2)


#: Queries from which the eager fast form runs the selected branch block-major
#: (:func:`_selected_block_major`); fewer queries (decoding) gather each query's blocks.
BLOCK_MAJOR_MIN_QUERIES = 256
#: Queries of one block-major tile (the rows that share one gathered key block).
BLOCK_TILE = 16
#: Queries of one tile of the inference form (:func:`_selected_tiles`).
SDPA_TILE = 64
#: Queries per pass of the inference form (bounds its gathered query tiles: ``~ G n r D 4`` bytes a query).
SDPA_PASS = 4096
#: Queries per block-major pass (bounds the pass's score tiles: ``~ G n r l' 4`` bytes a query).
BLOCK_MAJOR_CHUNK = 1024
_LOG2E = 1.4426950408889634


def _sparse_block_major(q: Tensor, kb: Tensor, vb: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor,
                        cfg: NSAConfig, q_offset: int, scale: float, query_chunk: int) -> Tensor:
    """:func:`_sparse` for many queries (eager, no saved tensors): the compressed branch and the
    picks in chunks of at least :data:`BLOCK_MAJOR_CHUNK` queries, then the selected branch block-major over passes of
    :data:`BLOCK_MAJOR_CHUNK` queries (:func:`_selected_block_major`)."""
    H, Nq = q.shape[1], q.shape[2]
    G = kb.shape[1]
    r = H // G
    qg_all = q.unflatten(1, (G, r))  # [B, G, r, Nq, D]
    o_cmp, picks, oks = [], [], []
    step = max(query_chunk, BLOCK_MAJOR_CHUNK)  # few large ops (each one a thread-pool sync); exact for any step
    for a in range(0, Nq, step):
        t0, t1 = q_offset + a, q_offset + min(Nq, a + step)
        t = torch.arange(t0, t1, device=q.device)
        o, p = _chunk_compressed(qg_all[:, :, :, a:a + step], k_cmp, v_cmp, t, t0, cfg, scale)
        o_cmp.append(o)
        with torch.no_grad():
            imp = _overlap_scores(p.detach().to(compute_dtype(p.dtype)).sum(2), (t1 - 1) // cfg.select_len + 1, cfg)
            idx, ok = pick_blocks(imp, t, cfg)
        n = min(cfg.num_selected, kb.shape[2])  # pad every chunk's picks to n (padding: ok = False)
        picks.append(F.pad(idx, (0, n - idx.shape[-1])))
        oks.append(F.pad(ok, (0, n - ok.shape[-1])))
    idx_all, ok_all = torch.cat(picks, 2), torch.cat(oks, 2)  # [B, G, Nq, n]
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, kb, vb))
    native = (native_nsa_selected_train if grad else native_nsa_selected)(q, kb, vb, idx_all, ok_all, q_offset, scale)
    if native is not None:  # the compiled twin of _selected_tiles / _selected_block_major (when built)
        o_slc = [native.unflatten(1, (G, r))]
    else:
        o_slc = []
        tiles = not grad and vb.shape[-1] == kb.shape[-1]  # torch's CPU flash kernel takes Dv == D only
        selected, c = (_selected_tiles, SDPA_PASS) if tiles else (_selected_block_major, BLOCK_MAJOR_CHUNK)
        for a in range(0, Nq, c):
            sl = slice(a, a + c)
            t = torch.arange(q_offset + a, q_offset + min(Nq, a + c), device=q.device)
            o_slc.append(selected(qg_all[:, :, :, sl], kb, vb, idx_all[:, :, sl], ok_all[:, :, sl], t, cfg, scale))
    g = gates.unflatten(1, (G, r))  # [B, G, r, Nq, 3]
    out = g[..., 0:1] * torch.cat(o_cmp, 3) + g[..., 1:2] * torch.cat(o_slc, 3)
    return out.flatten(1, 2)


def _pairs(qg: Tensor, idx: Tensor, ok: Tensor, ns: int) -> tuple[Tensor, Tensor, Tensor]:
    """The real (query row, picked block) pairs of ``idx, ok [B, G, c, n]``: flat block ids
    ``[pairs]`` (rows of ``kb.reshape(B G Ns, l', D)``), query rows ``[pairs]`` (``(b, g, i)``
    flattened) and the query rows ``[B G c + 1, r, D]`` of ``qg [B, G, r, c, D]`` with one zero
    row last (what padding slots read). A host sync (the pair count): eager only."""
    B, G, r, c, D = qg.shape
    base = torch.arange(B * G, device=qg.device).view(B, G, 1, 1)
    blk = (base * ns + idx).flatten()  # [B G c n] flat block ids
    row = (base * c + torch.arange(c, device=qg.device).view(1, 1, c, 1)).expand_as(idx).flatten()
    keep = ok.flatten()
    q_rows = torch.cat((qg.permute(0, 1, 3, 2, 4).reshape(B * G * c, r, D), qg.new_zeros(1, r, D)))
    return blk[keep], row[keep], q_rows


def _selected_tiles(qg: Tensor, kb: Tensor, vb: Tensor, idx: Tensor, ok: Tensor, t: Tensor, cfg: NSAConfig,
                    scale: float) -> Tensor:
    """:func:`_selected_block_major` for inference (no autograd through it): each tile of
    :data:`SDPA_TILE` queries of one key block is one batch entry of torch's CPU flash attention
    (``_scaled_dot_product_flash_attention_for_cpu``: fused scores, softmax and ``P V``, and the
    tile's log-sum-exp), and the tiles of a query merge by their log-sum-exps:
    ``o = sum_t exp(lse_t - lse) o_t``, ``lse = log sum_t exp(lse_t)``. A block before the query's
    own is wholly visible (no mask); the pairs of a query's own block form separate tiles that get a
    causal mask. Returns ``[B, G, r, c, Dv]``."""
    B, G, r, c, D = qg.shape
    ns, lp, Dv = kb.shape[2], kb.shape[3], vb.shape[-1]
    nb, n_rows, P = B * G * ns, B * G * c, SDPA_TILE
    t_rows = torch.cat((t.repeat(B * G), t.new_full((1,), ns * lp)))  # position of each row; padding sees all
    blk, row, q_rows = _pairs(qg, idx, ok, ns)
    own = blk % ns == t_rows[row] // lp  # the query's own block (its later keys hidden)
    tile_grp, slot_row = _pair_tiles(blk + nb * (~own).long(), row, 2 * nb, n_rows, P)  # own-block tiles first
    n_own = int((tile_grp < nb).sum())
    tile_blk = tile_grp % nb
    qt = q_rows.index_select(0, slot_row).view(-1, 1, P * r, D)  # [T, 1, P r, D]
    kt = kb.reshape(nb, lp, D).index_select(0, tile_blk).unsqueeze(1)  # [T, 1, l', D]
    vt = vb.reshape(nb, lp, Dv).index_select(0, tile_blk).unsqueeze(1)
    kpos = (tile_blk[:n_own] % ns).view(-1, 1, 1, 1) * lp + torch.arange(lp, device=qg.device)  # [To, 1, 1, l']
    hidden = kpos > t_rows.index_select(0, slot_row[:n_own * P]).view(n_own, P, 1, 1)  # [To, P, 1, l']
    bias = qg.new_zeros(n_own, P, r, lp).masked_fill_(hidden, float("-inf")).view(n_own, 1, P * r, lp)
    parts = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qt[sl], kt[sl], vt[sl], 0.0, False, attn_mask=m, scale=scale)
        for sl, m in ((slice(0, n_own), bias), (slice(n_own, None), None)) if sl.stop != sl.start]
    lse = torch.cat([x[1] for x in parts]).reshape(-1, r)  # [T P, r]
    m_row = torch.full((n_rows + 1, r), float("-inf"), dtype=lse.dtype, device=qg.device)
    m_row = m_row.scatter_reduce_(0, slot_row.view(-1, 1).expand(-1, r), lse, "amax")  # finite: own block
    w = torch.exp(lse - m_row.index_select(0, slot_row)).to(vb.dtype)  # [T P, r]
    num = qg.new_zeros(n_rows + 1, r, Dv)
    den = qg.new_zeros(n_rows + 1, r).index_add_(0, slot_row, w)
    start = 0
    for o, _ in parts:  # no concatenated copy of the tiles' outputs: each part weighted in place, added
        o = o.view(-1, r, Dv)  # [T' P, r, Dv]
        rows = slice(start, start + o.shape[0])
        num.index_add_(0, slot_row[rows], o.mul_(w[rows].unsqueeze(-1)))
        start = rows.stop
    out = num[:n_rows] / den[:n_rows].unsqueeze(-1)  # den >= 1: the pair holding the row's maximum
    return out.view(B, G, c, r, Dv).permute(0, 1, 3, 2, 4)


def _pair_tiles(group: Tensor, row: Tensor, n_groups: int, n_rows: int, size: int) -> tuple[Tensor, Tensor]:
    """Cut (query row, group) pairs ``row, group [pairs]`` into tiles of ``size`` slots, each tile
    holding pairs of one group (group ids in ``[0, n_groups)``, tiles in group order): returns
    ``tile_group [T]`` and ``slot_row [T size]``, the query row of every slot (``n_rows`` for the
    padding slots of a group's last tile). A host sync (the tile count): eager only."""
    # float keys (exact below 2^53): a comparison sort; torch sorts 1-D integer keys by a parallel
    # radix sort that waits for every pool thread at each pass (2 loaded threads: 169 ms vs 27 ms)
    order = torch.sort(group.double(), stable=True).indices
    group, row = group[order], row[order]
    counts = torch.bincount(group, minlength=n_groups)  # pairs per group
    tiles_per = (counts + size - 1) // size
    tile_start = torch.cumsum(tiles_per, 0) - tiles_per  # first tile of each group
    pair_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(group.numel(), device=group.device) - pair_start[group]  # position among its group's pairs
    slot = (tile_start[group] + rank // size) * size + rank % size  # [pairs] -> slot of the tile table
    n_tiles = int(tiles_per.sum())
    tile_group = torch.repeat_interleave(torch.arange(n_groups, device=group.device), tiles_per,
                                         output_size=n_tiles)
    slot_row = torch.full((n_tiles * size,), n_rows, dtype=torch.long, device=group.device)
    return tile_group, slot_row.index_put_((slot,), row)


def _selected_block_major(qg: Tensor, kb: Tensor, vb: Tensor, idx: Tensor, ok: Tensor, t: Tensor, cfg: NSAConfig,
                          scale: float) -> Tensor:
    """The selected branch of queries ``qg [B, G, r, c, D]`` at ``t [c]`` over their picks ``idx, ok
    [B, G, c, n]``, organised by key block instead of by query: the (query, block) pairs are sorted
    by block and cut into tiles of :data:`BLOCK_TILE` queries of one block, so each tile gathers one
    key block ``[l', D]`` for its queries (a query row is copied per pick: ``r D`` numbers, where a
    per-query gather copies ``n l' D``) and one batched matmul scores every tile. The softmax runs
    over each query's ``n l'`` picked keys (its maximum reduced over the query's pairs), ``P V`` per
    tile, and the tiles' outputs are added back to their queries. Returns ``[B, G, r, c, Dv]``."""
    B, G, r, c, D = qg.shape
    ns, lp, Dv = kb.shape[2], kb.shape[3], vb.shape[-1]
    dev, P = qg.device, BLOCK_TILE
    n_rows = B * G * c  # query rows (b, g, i); one more row takes the padding slots
    blk, row, q_rows = _pairs(qg, idx, ok, ns)
    tile_blk, slot_row = _pair_tiles(blk, row, B * G * ns, n_rows, P)
    n_tiles = tile_blk.numel()
    qt = q_rows.index_select(0, slot_row).view(n_tiles, P * r, D)  # [T, P r, D]
    kt = kb.reshape(B * G * ns, lp, D).index_select(0, tile_blk)  # [T, l', D]
    s = torch.bmm(qt, kt.transpose(1, 2)) * (scale * _LOG2E)  # [T, P r, l'], base-2 scores (exp2 is faster)
    t_rows = torch.cat((t.repeat(B * G), t.new_full((1,), -1)))  # position of each row; padding sees nothing
    kpos = (tile_blk % ns).view(-1, 1, 1, 1) * lp + torch.arange(lp, device=dev)  # [T, 1, 1, l']
    hidden = kpos > t_rows.index_select(0, slot_row).view(n_tiles, P, 1, 1)  # [T, P, 1, l'] causal
    s = s.view(n_tiles, P, r, lp).masked_fill(hidden, float("-inf"))
    m = s.detach().amax(-1)  # [T, P, r]
    m_row = torch.full((n_rows + 1, r), float("-inf"), dtype=s.dtype, device=dev)
    m_row = m_row.scatter_reduce_(0, slot_row.view(-1, 1).expand(-1, r), m.view(-1, r), "amax")  # per query row
    m_row = torch.where(torch.isfinite(m_row), m_row, torch.zeros_like(m_row))
    e = torch.exp2(s - m_row.index_select(0, slot_row).view(n_tiles, P, r, 1))  # [T, P, r, l']
    vt = vb.reshape(B * G * ns, lp, Dv).index_select(0, tile_blk)  # [T, l', Dv]
    o = torch.bmm(e.view(n_tiles, P * r, lp), vt).view(n_tiles * P, r, Dv)
    num = qg.new_zeros(n_rows + 1, r, Dv).index_add(0, slot_row, o)
    den = qg.new_zeros(n_rows + 1, r).index_add(0, slot_row, e.sum(-1).view(-1, r))
    out = num[:n_rows] / den[:n_rows].clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1)  # block 0: key 0 <= t
    return out.view(B, G, c, r, Dv).permute(0, 1, 3, 2, 4)


def _chunk_sizes(a: int, c: int, nq: int, nc: int, cfg: NSAConfig, q_offset: int) -> tuple[int, int]:
    """``(compressed blocks, picked blocks)`` of the chunk of queries ``a .. a + c - 1`` (Python ints,
    as :func:`_chunk_compressed` and :func:`pick_blocks` size them)."""
    t1 = q_offset + min(nq, a + c)  # one past the chunk's last position
    return min(nc, num_compressed(t1, cfg.block_len, cfg.block_stride)), min(cfg.num_selected,
                                                                              (t1 - 1) // cfg.select_len + 1)


def _softmax_bwd(p: Tensor, dp: Tensor, do: Tensor, o: Tensor) -> Tensor:
    """Gradient of softmax scores from the probabilities: ``p (dp - rowsum(do * o))`` (masked and
    empty rows have ``p = 0`` and get 0)."""
    return p * (dp - (do * o).sum(-1, keepdim=True))


def _sparse_bwd(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor,
                saved: Sequence[Tensor], cfg: NSAConfig, q_offset: int, scale: float, query_chunk: int,
                ) -> tuple[Tensor, ...]:
    """Analytic gradients of :func:`_sparse` for ``(q, k, v, k_cmp, v_cmp, gates)`` from the saved
    ``o_cmp, o_slc [B, G, r, Nq, Dv]``, ``p_cmp [B, G, r, Nq, Nc]``, ``p_slc [B, G, r, Nq, n l']``,
    ``idx [B, G, Nq, n]`` (chunks padded to the widest): the softmax backward of each branch, the
    selected keys' gradients added back into their blocks. Nothing of the forward runs again."""
    o_cmp, o_slc, p_cmp, p_slc, idx = saved
    H, Nq = q.shape[1], q.shape[2]
    G, Nk, Nc = k.shape[1], k.shape[2], k_cmp.shape[2]
    r, lp = H // G, cfg.select_len
    kb, vb = _blocks(k, lp), _blocks(v, lp)
    dkb, dvb, dkc, dvc = (x.new_zeros(x.shape) for x in (kb, vb, k_cmp, v_cmp))  # contiguous
    do_all, g_all = d_out.unflatten(1, (G, r)), gates.unflatten(1, (G, r))
    dqs, dgs = [], []
    for a in range(0, Nq, query_chunk):
        sl = slice(a, a + query_chunk)
        nc, ns = _chunk_sizes(a, query_chunk, Nq, Nc, cfg, q_offset)
        qg, do, g = q[:, :, sl].unflatten(1, (G, r)), do_all[:, :, :, sl], g_all[:, :, :, sl]
        oc, os_ = o_cmp[:, :, :, sl], o_slc[:, :, :, sl]
        dgs.append(torch.stack([(do * oc).sum(-1), (do * os_).sum(-1), torch.zeros_like(oc[..., 0])], -1))
        do_c, do_s = g[..., 0:1] * do, g[..., 1:2] * do
        p = p_cmp[:, :, :, sl, :nc]  # compressed branch
        ds = _softmax_bwd(p, torch.einsum("bgrcd,bgnd->bgrcn", do_c, v_cmp[:, :, :nc]), do_c, oc) * scale
        dq = torch.einsum("bgrcn,bgnd->bgrcd", ds, k_cmp[:, :, :nc])
        dkc[:, :, :nc] += torch.einsum("bgrcn,bgrcd->bgnd", ds, qg)
        dvc[:, :, :nc] += torch.einsum("bgrcn,bgrcd->bgnd", p, do_c)
        pick = idx[:, :, sl, :ns]  # selected branch, over the picked blocks' tokens
        ps = p_slc[:, :, :, sl, :ns * lp]
        vsel = _gather_blocks(vb, pick)
        ds = _softmax_bwd(ps, torch.einsum("bgrcd,bgcmd->bgrcm", do_s, vsel), do_s, os_) * scale
        dq = dq + torch.einsum("bgrcm,bgcmd->bgrcd", ds, _gather_blocks(kb, pick))
        _add_to_blocks(dkb, pick, torch.einsum("bgrcm,bgrcd->bgcmd", ds, qg))  # back into the picked blocks
        _add_to_blocks(dvb, pick, torch.einsum("bgrcm,bgrcd->bgcmd", ps, do_s))
        dqs.append(dq)
    dk, dv = (x.flatten(2, 3)[:, :, :Nk] for x in (dkb, dvb))
    return (torch.cat(dqs, 3).flatten(1, 2), dk, dv, dkc, dvc, torch.cat(dgs, 3).flatten(1, 2))


#: Queries per window block (at most; more if ``query_chunk`` is larger): a block of ``c`` scores
#: ``c + w - 1`` keys for ``w`` visible ones, so ``w = 512`` wastes half at ``c = w`` and a fifth at
#: ``c = 128`` (measured at N=16384, one thread: 0.30 s at 128 queries, 0.34 s at 256, 0.43 s at 512).
WINDOW_QUERIES = 128


def window_chunk(query_chunk: int, window: int) -> int:
    """Queries per block of the window branch: ``max(query_chunk, min(window, WINDOW_QUERIES))``."""
    return max(query_chunk, min(window, WINDOW_QUERIES))


def _window(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, q_offset: int, scale: float, query_chunk: int,
            backend: str) -> Tensor:
    """Window branch: ``az.attention(window=(w - 1, 0), causal=True)`` as one batched call over blocks
    of :func:`window_chunk` queries (:func:`_window_banded`: ``c + w - 1`` keys a block, O(N w))."""
    return _window_banded(q, k, v, cfg.window, q_offset, scale, backend, window_chunk(query_chunk, cfg.window))


def _window_banded(q: Tensor, k: Tensor, v: Tensor, w: int, q_offset: int, scale: float, backend: str,
                   block: int | None = None) -> Tensor:
    """The window branch as one batched call (no loop whose trip count would depend on the length:
    one graph when compiled, and one kernel call instead of a call per chunk, which a loaded thread
    pool makes each wait). Queries in blocks of ``c = block`` (default ``w``); block ``j`` (positions
    ``t0 .. t0 + c - 1``) attends over the ``c + w - 1`` keys from ``t0 - w + 1``, where query ``i``
    sees slab key ``m`` iff ``i <= m <= i + w - 1`` (the same band for every block), and only keys
    inside ``0 .. Nk - 1``. ``O(N (c + w))`` work, exact."""
    B, H, nq, D = q.shape
    G, nk = k.shape[1], k.shape[2]
    c = w if block is None else block
    nb, span = -(-nq // c), c + w - 1
    lo = q_offset - w + 1  # position of block 0's first slab key
    slab = torch.arange(span, device=q.device)

    def slabs(x: Tensor) -> Tensor:  # [B, G, Nk, d] -> [B nb, G, c + w - 1, d], zero keys padded on both ends
        xs = F.pad(x, (0, 0, w - 1, max(0, q_offset + nb * c - nk)))[:, :, lo + w - 1:lo + w - 1 + (nb - 1) * c + span]
        return xs.unfold(2, span, c).permute(0, 2, 1, 4, 3).reshape(B * nb, G, span, x.shape[-1])

    band = (slab[None, :] >= slab[:c, None]) & (slab[None, :] <= slab[:c, None] + w - 1)  # [c, c + w - 1]
    pos = lo + torch.arange(nb, device=q.device)[:, None] * c + slab  # [nb, c + w - 1] key positions
    mask = band & ((pos >= 0) & (pos < nk))[:, None, :]  # [nb, c, c + w - 1]
    qb = F.pad(q, (0, 0, 0, nb * c - nq)).view(B, H, nb, c, D).transpose(1, 2).reshape(B * nb, H, c, D)
    o = attention(qb, slabs(k), slabs(v), mask=mask[:, None].repeat(B, 1, 1, 1), scale=scale, backend=backend)
    return o.view(B, nb, H, c, -1).transpose(1, 2).reshape(B, H, nb * c, -1)[:, :, :nq]  # type: ignore[union-attr]


# --------------------------------------------------------------------------- compiled form
_CONFIG_FIELDS = ("block_len", "block_stride", "select_len", "num_selected", "window", "local_blocks")


@torch.library.custom_op("attnzoo::nsa_sparse", mutates_args=())
def nsa_sparse(q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor, block_len: int,
               block_stride: int, select_len: int, num_selected: int, window: int, local_blocks: int, q_offset: int,
               scale: float, query_chunk: int) -> Tensor:
    """Inference form of :func:`nsa_sparse_fwd` (a compiled graph without gradients calls it): the
    gated output ``[B, H, Nq, Dv]`` only, nothing saved for a backward."""
    cfg = NSAConfig(block_len, block_stride, select_len, num_selected, window, local_blocks)
    return _sparse(q, k, v, k_cmp, v_cmp, gates, cfg, q_offset, scale, query_chunk).contiguous()


@nsa_sparse.register_fake
def _nsa_sparse_fake(q: Tensor, k: Tensor, v: Tensor, *args: object) -> Tensor:
    return q.new_empty(*q.shape[:3], v.shape[-1])


@torch.library.custom_op("attnzoo::nsa_sparse_fwd", mutates_args=())
def nsa_sparse_fwd(q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor, block_len: int,
                   block_stride: int, select_len: int, num_selected: int, window: int, local_blocks: int,
                   q_offset: int, scale: float, query_chunk: int,
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The compressed and selected branches of the fast form, gated, as one operator (what a
    compiled graph calls): ``g_cmp o_cmp + g_slc o_slc [B, H, Nq, Dv]`` first, then what its
    backward reads (:func:`_sparse_bwd`): ``o_cmp, o_slc [B, G, r, Nq, Dv]``, the probabilities
    ``p_cmp [B, G, r, Nq, Nc]`` and ``p_slc [B, G, r, Nq, n l']`` and the picked blocks
    ``idx [B, G, Nq, n]``, every chunk zero-padded to the widest. Arguments as
    :func:`nsa_attention` with the :class:`NSAConfig` fields spelled out."""
    cfg = NSAConfig(block_len, block_stride, select_len, num_selected, window, local_blocks)
    keep: list[tuple[Tensor, ...]] = []
    out = _sparse(q, k, v, k_cmp, v_cmp, gates, cfg, q_offset, scale, query_chunk, keep)
    widths = _saved_widths(q.shape[2], k_cmp.shape[2], cfg, q_offset)
    saved = []
    for i, dim in enumerate((3, 3, 3, 3, 2)):  # o_cmp, o_slc, p_cmp, p_slc (chunk axis 3); idx (axis 2)
        parts = [c[i] for c in keep]
        if i >= 2:  # ragged last axis: pad every chunk to the widest
            parts = [F.pad(x, (0, widths[i - 2] - x.shape[-1])) for x in parts]
        saved.append(torch.cat(parts, dim).contiguous())
    return (out.contiguous(), *saved)  # type: ignore[return-value]


def _saved_widths(nq: int, nc: int, cfg: NSAConfig, q_offset: int) -> tuple[int, int, int]:
    """Last-axis widths of the saved ``p_cmp``, ``p_slc`` and ``idx``: the last chunk's (the widest)."""
    picks = _chunk_sizes(nq - 1, 1, nq, nc, cfg, q_offset)[1]
    return nc, picks * cfg.select_len, picks


@nsa_sparse_fwd.register_fake
def _nsa_sparse_fwd_fake(q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor, block_len: int,
                         block_stride: int, select_len: int, num_selected: int, window: int, local_blocks: int,
                         q_offset: int, scale: float, query_chunk: int,
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, H, Nq, _ = q.shape
    G, dv = k.shape[1], v.shape[-1]
    cfg = NSAConfig(block_len, block_stride, select_len, num_selected, window, local_blocks)
    wc, ws, wi = _saved_widths(Nq, k_cmp.shape[2], cfg, q_offset)
    r = H // G
    return (q.new_empty(B, H, Nq, dv), q.new_empty(B, G, r, Nq, dv), q.new_empty(B, G, r, Nq, dv),
            q.new_empty(B, G, r, Nq, wc), q.new_empty(B, G, r, Nq, ws), q.new_empty(B, G, Nq, wi, dtype=torch.long))


@torch.library.custom_op("attnzoo::nsa_sparse_bwd", mutates_args=())
def nsa_sparse_bwd(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor,
                   o_cmp: Tensor, o_slc: Tensor, p_cmp: Tensor, p_slc: Tensor, idx: Tensor,
                   block_len: int, block_stride: int, select_len: int, num_selected: int, window: int,
                   local_blocks: int, q_offset: int, scale: float, query_chunk: int,
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`nsa_sparse_fwd` for ``(q, k, v, k_cmp, v_cmp, gates)`` from what its
    forward saved (:func:`_sparse_bwd`: the softmax backward of both branches, no recomputation)."""
    cfg = NSAConfig(block_len, block_stride, select_len, num_selected, window, local_blocks)
    grads = _sparse_bwd(d_out, q, k, v, k_cmp, v_cmp, gates, (o_cmp, o_slc, p_cmp, p_slc, idx), cfg, q_offset,
                        scale, query_chunk)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@nsa_sparse_bwd.register_fake
def _nsa_sparse_bwd_fake(d_out: Tensor, *args: object) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.new_empty(t.shape) for t in args[:6])  # type: ignore[return-value,union-attr]


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs[:6], *output[1:])
    ctx.scalars = inputs[6:]


def _backward_formula(ctx, d_out: Tensor, *unused: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    return (*nsa_sparse_bwd(d_out, *ctx.saved_tensors, *ctx.scalars), *(None,) * len(ctx.scalars))


nsa_sparse_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


# --------------------------------------------------------------------------- entry point
def _check(q: object, k: object, v: object, k_cmp: object, v_cmp: object, gates: object) -> None:
    names = ("q", "k", "v", "k_cmp", "v_cmp", "gates")
    for name, x in zip(names, (q, k, v, k_cmp, v_cmp, gates), strict=True):
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() != 4:
            got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"nsa_attention: {name} must be a floating 4-D tensor, got {got}")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    assert isinstance(k_cmp, Tensor) and isinstance(v_cmp, Tensor) and isinstance(gates, Tensor)
    B, H, Nq, D = q.shape
    G, Nk = k.shape[1], k.shape[2]
    want = {"k": (B, G, Nk, D), "v": (B, G, Nk, v.shape[-1]), "k_cmp": (B, G, k_cmp.shape[2], D),
            "v_cmp": (B, G, k_cmp.shape[2], v.shape[-1]), "gates": (B, H, Nq, 3)}
    for name, x in (("k", k), ("v", v), ("k_cmp", k_cmp), ("v_cmp", v_cmp), ("gates", gates)):
        if tuple(x.shape) != want[name] or H % G:
            raise ValueError(f"nsa_attention: with q [B, H, Nq, D] = {list(q.shape)} and k [B, Hkv, Nk, D] "
                             f"(H % Hkv == 0), {name} must have shape {list(want[name])}, got {list(x.shape)}")


def nsa_attention(q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor,
                  config: NSAConfig, *, q_offset: int | None = None, scale: float | None = None,
                  form: str = "auto", query_chunk: int = 128, backend: str = "auto") -> Tensor:
    """Native sparse attention, causal (see the module docstring for the three branches).

    Args:
        q: queries ``[B, H, Nq, D]`` at positions ``q_offset ..``.
        k, v: raw keys ``[B, Hkv, Nk, D]`` and values ``[B, Hkv, Nk, Dv]`` of positions ``0 .. Nk - 1``.
        k_cmp, v_cmp: compressed blocks ``[B, Hkv, Nc, D]`` / ``[B, Hkv, Nc, Dv]`` (block ``i``
            summarises tokens ``[i d, i d + l)``; :func:`compress_blocks`).
        gates: branch gates ``[B, H, Nq, 3]`` (compressed, selected, window), e.g. sigmoids.
        config: block sizes (:class:`NSAConfig`).
        q_offset: position of the first query (default ``Nk - Nq``).
        scale: score scale (default ``1 / sqrt(D)``).
        form: ``"fast"`` (chunked, gathers only the selected blocks), ``"reference"`` (dense
            masks, for float64 checks) or ``"auto"`` (= ``"fast"``).
        query_chunk: queries per chunk of the fast form.
        backend: :func:`attnzoo.attention` backend of the window branch (fast form).

    Returns:
        ``[B, H, Nq, Dv]``.
    """
    _check(q, k, v, k_cmp, v_cmp, gates)
    if not isinstance(config, NSAConfig):
        raise TypeError(f"nsa_attention: config must be an NSAConfig, got {type(config).__name__}")
    check_choice(form, "form", "nsa_attention", choices=FORMS)
    query_chunk = check_int(query_chunk, "query_chunk", minimum=1, owner="nsa_attention")
    Nq, Nk = q.shape[2], k.shape[2]
    q_offset = Nk - Nq if q_offset is None else check_int(q_offset, "q_offset", minimum=0, owner="nsa_attention")
    if q_offset + Nq > Nk:
        raise ValueError(f"nsa_attention: queries at positions {q_offset}..{q_offset + Nq - 1} need their keys, "
                         f"but k holds only Nk = {Nk} positions (causal: q_offset + Nq <= Nk)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if Nq == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    if form == "reference":
        return _reference(q, k, v, k_cmp, v_cmp, gates, config, q_offset, scale)
    return _fast(q, k, v, k_cmp, v_cmp, gates, config, q_offset, scale, query_chunk, backend)
