r"""Sliding-window forward over every (batch, head) at once: the "flat" band.

A window ``(left, right)`` query block ``i`` of ``b`` rows sees the ``S = b + left + right`` keys
from ``i b - left``. With contiguous ``[B, H, N, D]`` tensors and ``N % b == 0``, block ``i`` of
(batch, head) ``h`` is block ``j = h N / b + i`` of the rows flattened to ``[B H N, D]``, and its key
window starts at flat row ``j b - left``: the windows of all blocks of all heads are one strided
view ``[J, S, D]`` (stride ``b`` rows), so one ``baddbmm``, two ``masked_fill`` (the window's two
edges, the same pattern in every block), one in-place ``softmax`` and one ``bmm`` written straight
into the output rows serve a group of blocks of *every* head; the band path of
:mod:`.forward` issues one matmul per (batch, head) and a max/exp/sum chain instead. Every row
sees its own key, so no row is empty and ``softmax`` is exact (it subtracts the row maximum).

The first ``ceil(left / b)`` and last ``ceil(right / b)`` blocks of each head would read a
neighbouring head's keys: they are computed in the flat groups anyway (wasted, a few blocks per
head) and then overwritten by the per-block path of :mod:`.forward`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo.functional.backends.tiled.plan import TilePlan
from attnzoo.functional.backends.tiled.scores import cap_scores, true_runs
from attnzoo.functional.core._request import AttnRequest

__all__ = ["flat_window", "forward_flat"]


def flat_window(r: AttnRequest, plan: TilePlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int] | None:
    """``(left, right)`` of a request the flat band serves, or ``None``.

    Served: a window with both sides bounded and >= 0 after causality (every row sees its own
    key), no other mask, bias or ``score_mod``, no GQA, ``Nq == Nk`` with ``q_offset == 0``,
    contiguous q/k/v of one float dtype, ``N`` a multiple of the plan's query block and the plan
    made of bands (what ``band_plan`` chose for this window), unless ``flat_elems`` is 0."""
    if (r.window is None or not plan.bands or not plan.tiles.flat_elems or r.group != 1 or r.nq != r.nk or r.q_offset != 0
            or r.mask_tensor is not None or r.mask_obj is not None or r.score_mod is not None
            or r.alibi_slopes is not None):
        return None
    left, right = r.window
    if r.causal:
        right = 0 if right is None else min(right, 0)
    if left is None or right is None or left < 0 or right < 0 or r.nq % plan.block_q:
        return None
    if not (q.dtype == k.dtype == v.dtype and all(t.is_contiguous() for t in (q, k, v))):
        return None
    b = plan.block_q
    interior = r.nq // b - _edge_blocks(left, b) - _edge_blocks(right, b)
    return (left, right) if interior > 0 else None


def _edge_blocks(reach: int, b: int) -> int:
    return -(-reach // b)


def edge_rows(plan: TilePlan, window: tuple[int, int]) -> list[int]:
    """The query blocks (of every head) the flat band leaves to the per-block path."""
    left, right = window
    lo, hi = _edge_blocks(left, plan.block_q), _edge_blocks(right, plan.block_q)
    return [*range(lo), *range(plan.n_q_blocks - hi, plan.n_q_blocks)]


def forward_flat(r: AttnRequest, plan: TilePlan, window: tuple[int, int], q: Tensor, k: Tensor, v: Tensor,
                 out: Tensor, lse: Tensor | None) -> None:
    """Write every interior window block of every (batch, head) into ``out`` (and ``lse``), in groups
    of about ``plan.tiles.flat_elems`` scores. ``out`` is contiguous ``[B, H, N, Dv]``."""
    left, right = window
    b, D, Dv = plan.block_q, q.shape[-1], v.shape[-1]
    S = b + left + right
    rows = torch.arange(b, device=q.device).view(b, 1)
    cols = torch.arange(S, device=q.device).view(1, S)
    hidden = (cols < rows) | (cols > rows + left + right)  # [b, S], the same in every block
    # -inf added where hidden (3x faster than masked_fill_ with a broadcast mask; keys are finite
    # here: attnzoo.attention cleans non-finite hidden keys before any backend runs)
    bias = torch.zeros(b, S, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
    runs = [(c0, c1, bias[:, c0:c1]) for c0, c1 in true_runs(hidden.any(dim=0))]
    q_f, k_f, v_f = q.view(-1, D), k.view(-1, D), v.view(-1, Dv)  # [B*H*N, E]
    o_f = out.view(-1, Dv)
    lse_f = lse.view(-1) if lse is not None else None
    first = _edge_blocks(left, b)
    last = q_f.shape[0] // b - _edge_blocks(right, b)  # flat blocks [first, last) read real keys
    per = max(1, plan.tiles.flat_elems // (b * S))
    for j in range(first, last, per):
        n = min(per, last - j)
        rows_j = slice(j * b, (j + n) * b)
        k_win = k_f.as_strided((n, S, D), (b * D, D, 1), k_f.storage_offset() + (j * b - left) * D)
        v_win = v_f.as_strided((n, S, Dv), (b * Dv, Dv, 1), v_f.storage_offset() + (j * b - left) * Dv)
        s = torch.baddbmm(q_f.new_empty(n, b, S), q_f[rows_j].view(n, b, D), k_win.transpose(1, 2),
                          beta=0, alpha=r.scale)  # [n, b, S]
        s = cap_scores(r, s)[0]
        for c0, c1, edge in runs:  # the window's edges only
            s[..., c0:c1].add_(edge)
        if lse_f is not None:
            lse_f[rows_j] = torch.logsumexp(s, dim=-1).flatten()
        torch.bmm(torch.softmax(s, dim=-1, out=s), v_win, out=o_f[rows_j].view(n, b, Dv))
