"""``attention_varlen``'s split path: packed sequences run as per-length batched calls of ``attention``.

The packed path of :mod:`attnzoo.functional.softmax.varlen` runs the whole ``[1, H, T, D]`` packed tensor
through the ``tiled`` backend with a sequence mask: exact, and its work follows ``sum n_q n_k``,
but it is a Python loop over tiles. Where every sequence is a request torch's fused SDPA kernel
serves (no LSE, softcap or sinks), calling :func:`attnzoo.attention` once per sequence is faster
(measured: ``benchmarks/bench_cpu_kernels.py``, ``docs/performance.md``). Consecutive sequences
of equal ``(n_q, n_k)`` are one batched call on a *view* of the packed rows (``[S_run, n, H, D]``:
no copy), so many short sequences of one length cost one call. Each sequence keeps its own
bottom-right alignment (``q_offset = n_k - n_q``), exactly as ``attention_varlen`` defines it.
Inference only (see :func:`split_applies`); it would be differentiable through autograd.

:func:`split_applies` is the ``auto`` policy; :func:`split_varlen` the runner.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo.functional.softmax.attention import attention

__all__ = ["MAX_SPLIT_CALLS", "split_applies", "split_varlen"]

#: Most ``attention`` calls (runs of consecutive sequences of equal lengths) for which ``auto``
#: splits a packed batch instead of running it packed through ``tiled``.
MAX_SPLIT_CALLS = 64


def _runs(bounds_q: list[int], bounds_k: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Maximal runs of consecutive sequences with equal ``(n_q, n_k)``: ``(q0, k0, count, n_q, n_k)``
    (the run's first query and key rows, its number of sequences, their lengths)."""
    runs: list[tuple[int, int, int, int, int]] = []
    for i in range(len(bounds_q) - 1):
        nq, nk = bounds_q[i + 1] - bounds_q[i], bounds_k[i + 1] - bounds_k[i]
        if runs and runs[-1][3:] == (nq, nk):
            q0, k0, count = runs[-1][:3]
            runs[-1] = (q0, k0, count + 1, nq, nk)
        else:
            runs.append((bounds_q[i], bounds_k[i], 1, nq, nk))
    return runs


def split_applies(q: Tensor, k: Tensor, v: Tensor, bounds_q: list[int], bounds_k: list[int], *,
                  softcap: float | None, sinks: Tensor | None, return_lse: bool) -> bool:
    """Whether ``attention_varlen(backend="auto")`` runs the split path: eager inference (no
    gradient: training keeps the packed path's two operators, which measured as fast or faster),
    no softcap, sinks or LSE (what SDPA serves), at most :data:`MAX_SPLIT_CALLS` runs of equal lengths."""
    if tracing() or softcap is not None or sinks is not None or return_lse:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return False
    return len(_runs(bounds_q, bounds_k)) <= MAX_SPLIT_CALLS


def split_varlen(q: Tensor, k: Tensor, v: Tensor, bounds_q: list[int], bounds_k: list[int], *, causal: bool,
                 window: tuple[int | None, int | None] | None, scale: float | None,
                 alibi_slopes: Tensor | None) -> Tensor:
    """``out [Tq, Hq, Dv]`` of packed ``q [Tq, Hq, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]`` with
    sequence ``i`` at rows ``bounds_q[i]:bounds_q[i+1]`` (keys: ``bounds_k``): one
    :func:`attnzoo.attention` call (``backend="auto"``) per run of equal lengths. A sequence without
    keys returns zeros."""
    hq, dv = q.shape[1], v.shape[-1]
    outs: list[Tensor] = []
    for q0, k0, count, nq, nk in _runs(bounds_q, bounds_k):
        if nq == 0:
            continue
        if nk == 0:
            outs.append(q.new_zeros(count * nq, hq, dv) + 0 * v.sum())  # keeps v in the graph
            continue
        qs = q[q0:q0 + count * nq].unflatten(0, (count, nq)).transpose(1, 2)  # [S_run, Hq, n_q, D] (a view)
        ks = k[k0:k0 + count * nk].unflatten(0, (count, nk)).transpose(1, 2)  # [S_run, Hkv, n_k, D]
        vs = v[k0:k0 + count * nk].unflatten(0, (count, nk)).transpose(1, 2)
        o = attention(qs, ks, vs, causal=causal, window=window, scale=scale, alibi_slopes=alibi_slopes)
        assert isinstance(o, Tensor)
        outs.append(o.transpose(1, 2).flatten(0, 1))  # [S_run n_q, Hq, Dv]
    return torch.cat(outs) if outs else q.new_zeros(0, hq, dv)
