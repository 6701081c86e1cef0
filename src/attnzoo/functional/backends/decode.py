r"""Split-KV decoding: a few queries against a long key/value cache, GQA-aware.

Decoding attends ``Nq`` (1 .. a few) new queries to ``Nk`` cached keys. Its cost is reading K and
V; the score matrix is tiny. Two things make a dense kernel slower than that read:

* **GQA**: torch's CPU SDPA with ``enable_gqa`` runs one query head at a time, so each KV head is
  read ``G = Hq / Hkv`` times. Here the ``G`` query heads of a group are stacked as rows,
  ``q [B, Hq, Nq, D] -> [B, Hkv, G*Nq, D]`` (a view when ``q`` allows it), and one matmul per KV
  head and key chunk reads each key once for the whole group; K/V are never expanded.
* **Cache locality** (one thread): the cache is cut into chunks of ``C`` keys (split-KV) so that one chunk's
  scores ``[B, Hkv, G*Nq, C]`` stay in the L2 cache; each chunk is softmaxed against its own
  maximum and the chunks are merged by their log-sum-exp (online: the running output is
  rescaled by ``2^(m_old - m_new)`` as in the tiled backend).

With ``s2 = log2(e) * scale * q.k`` (``log2 e`` folded into the scale, as ``exp2`` is faster than
``exp`` on CPU), per row and chunk ``c``:

.. math::

    m_c = \max_j s2_j, \quad l_c = \sum_j 2^{s2_j - m_c}, \quad o_c = \sum_j 2^{s2_j - m_c} v_j,

    m = \max_c m_c, \quad out = \frac{\sum_c 2^{m_c - m} o_c}{\sum_c 2^{m_c - m} l_c}, \quad
    lse = \ln 2 \cdot (m + \log_2 \textstyle\sum_c 2^{m_c - m} l_c).

Only the keys some query can see are read: under ``causal``/``window`` the cache is cut to the union
of the queries' key intervals, and the visibility rule is evaluated only on the chunks at that
union's edges. A row with no visible key returns zeros and LSE ``-inf``. Softcap is applied to the
chunk's scores. Gradients flow through ordinary autograd (the score matrix of a decode step is small).

:func:`use_split_kv` is the ``auto`` policy (``attnzoo.attention`` asks it after choosing a backend);
its thresholds are measured by ``benchmarks/bench_cpu_kernels.py`` (``docs/performance.md``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import check_optional_int
from attnzoo.functional.backends.halfmath import HALF_DTYPES, half_math
from attnzoo.functional.backends.tiled.native import native_decode
from attnzoo.functional.core._edge import empty_result, is_empty
from attnzoo.functional.core._request import AttnRequest, build_request
from attnzoo.functional.core.rules import compute_dtype, key_bounds, visible

__all__ = ["MAX_QUERIES", "MIN_KEYS", "MIN_KEYS_OTHER", "SCORE_BYTES", "decode_attention", "run_split_kv",
           "split_kv_attention", "use_split_kv"]

#: Most queries per call the ``auto`` policy sends here (decoding and short speculative blocks).
MAX_QUERIES = 8
#: Fewest keys from which ``auto`` sends a GQA decode step here (SDPA's one call wins below: 0.94x
#: at 1,024 keys, 1.47x at 2,048 for 32/8 heads, D=128; ``benchmarks/bench_cpu_kernels.py``).
MIN_KEYS = 2048
#: Fewest keys from which a request ``auto`` would send to ``tiled`` (LSE, softcap) or whose window
#: hides at least half the cache comes here instead (1.6x faster than ``tiled`` at 1,024 keys).
MIN_KEYS_OTHER = 1024
#: Bytes of float32 scores per key chunk (``B * Hkv * G*Nq * C * 4``) on one thread: about half an
#: L2 cache (256 KiB-1 MiB measured within 5% of each other at 32k keys; one chunk of all keys 15%
#: slower on a quiet machine). With more threads the default is one chunk of every visible key:
#: each op of the chunk loop synchronises torch's thread pool, and on a loaded machine (load 21 on
#: 2 cores) the 8-chunk loop ran at 0.29x SDPA's speed, one pass at 1.23x (one thread: 2.09x).
SCORE_BYTES = 1 << 19
#: Key chunks are a multiple of this many keys, at least this many.
_CHUNK_ALIGN = 256
_LOG2E = 1.4426950408889634
_LN2 = math.log(2.0)
#: Features of a request this kernel serves (anything else goes to the chosen backend).
_SERVED = frozenset({"causal", "window", "gqa", "return_lse", "softcap", "Dv != D"})


def use_split_kv(r: AttnRequest, chosen: str) -> bool:
    """Whether ``backend="auto"``, having chosen backend ``chosen`` for ``r``, runs it here instead.

    Only requests of at most :data:`MAX_QUERIES` queries in float32 or half precision (float64 stays
    with the reference oracle) with no tensor/``Mask`` mask, ALiBi or dropout, outside
    ``torch.compile`` (a Python chunk loop). Then, as measured (``docs/performance.md``): GQA
    (each KV head read once for its group, where SDPA reads it once per query head) from
    :data:`MIN_KEYS` keys; requests bound for ``tiled`` (``return_lse``, softcap) or whose window
    hides at least half the cache from :data:`MIN_KEYS_OTHER` keys. Plain or causal MHA decoding
    stays with SDPA (0.7-1.0x here: nothing to share between heads).
    """
    if (tracing() or r.q.dtype == torch.float64 or r.nq > MAX_QUERIES
            or not r.features() <= _SERVED or chosen not in ("sdpa", "tiled")):
        return False
    if r.group > 1 and r.nk >= MIN_KEYS:
        return True
    lo, hi, _, _ = _key_ranges(r)
    return r.nk >= MIN_KEYS_OTHER and (chosen == "tiled" or 2 * (hi - lo) <= r.nk)


def _key_ranges(r: AttnRequest) -> tuple[int, int, int, int]:
    """``(lo, hi, all_lo, all_hi)``: keys ``lo:hi`` are seen by some query, ``all_lo:all_hi`` by every
    query (causal/window; ``hi <= lo`` when no query sees a key)."""
    left, right = key_bounds(r.causal, r.window)
    first, last = r.q_offset, r.q_offset + r.nq - 1  # positions of the first and last query
    lo = 0 if left is None else max(0, first - left)
    hi = r.nk if right is None else min(r.nk, last + right + 1)
    all_lo = 0 if left is None else max(0, last - left)
    all_hi = r.nk if right is None else min(r.nk, first + right + 1)
    return lo, hi, all_lo, all_hi


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    q_offset: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    chunk: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention of a few queries over a long cache by split-KV chunks (module docstring).

    Args:
        q: queries ``[B, Hq, Nq, D]`` (any ``Nq``; fast for small ``Nq``).
        k: keys ``[B, Hkv, Nk, D]``, ``Hq % Hkv == 0`` (query head ``h`` reads KV head ``h // G``).
        v: values ``[B, Hkv, Nk, Dv]``.
        causal, window, q_offset, scale, softcap: as :func:`attnzoo.attention`
            (``docs/conventions.md``).
        return_lse: also return the natural-log LSE ``[B, Hq, Nq]`` (float32; float64 for float64).
        chunk: keys per chunk (default: :data:`SCORE_BYTES` of scores per chunk).

    Returns:
        ``out [B, Hq, Nq, Dv]`` in q's dtype, or ``(out, lse)``.

    Raises:
        ValueError / TypeError naming the offending argument.
    """
    r = build_request(q, k, v, mask=None, causal=causal, window=window, q_offset=q_offset, scale=scale,
                      softcap=softcap, alibi_slopes=None, dropout_p=0.0, return_lse=return_lse,
                      return_weights=False)
    check_optional_int(chunk, "chunk")
    out, lse = split_kv_attention(r, chunk)
    return (out, lse) if return_lse else out


def run_split_kv(r: AttnRequest) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`split_kv_attention` with :func:`attnzoo.attention`'s return convention (``out`` or
    ``(out, lse)`` as the request asks): what its ``auto`` dispatch calls."""
    out, lse = split_kv_attention(r)
    return (out, lse) if r.return_lse else out


def split_kv_attention(r: AttnRequest, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq])`` of a validated request without mask tensor,
    ``Mask``, ALiBi or dropout (what :func:`use_split_kv` admits)."""
    if is_empty(r):
        out, lse, _ = empty_result(r)
        return out, lse
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (r.q, r.k, r.v))
    if chunk is None and not grad and (fast := native_decode(r)) is not None:  # compiled, when built
        return fast
    B, Hq, Nq, D = r.q.shape
    Hkv, G, Dv, Nk = r.hkv, r.group, r.v.shape[-1], r.nk
    cdt = compute_dtype(r.q.dtype)
    mdt = half_math(r.q.dtype, r.q.device) if r.q.dtype in HALF_DTYPES else r.q.dtype  # matmul dtype
    lo, hi, all_lo, all_hi = _key_ranges(r)
    if hi <= lo:  # no query sees anything: one masked key keeps the graph (zeros, LSE -inf)
        lo = min(max(lo, 0), Nk - 1)
        hi, all_lo, all_hi = lo + 1, Nk, 0
    rows = G * Nq
    if chunk is None and torch.get_num_threads() > 1:
        chunk = hi - lo  # one pass: each op a thread-pool sync, which collapses on shared cores
    elif chunk is None:
        chunk = max(_CHUNK_ALIGN, SCORE_BYTES // (4 * B * Hkv * rows) // _CHUNK_ALIGN * _CHUNK_ALIGN)
    exp2 = r.softcap is None
    q_scale = r.scale * _LOG2E if exp2 else r.scale
    qg = (r.q.reshape(B, Hkv, rows, D) * q_scale).to(mdt)  # [B, Hkv, G*Nq, D], row g*Nq + i
    qpos = torch.arange(r.q_offset, r.q_offset + Nq, device=r.q.device).repeat(G).view(rows, 1)  # [G*Nq, 1]
    acc = den = m = ms = None  # running output, sum, maximum (-inf until a key is seen), safe maximum
    for c0 in range(lo, hi, chunk):
        c1 = min(hi, c0 + chunk)
        s = torch.matmul(qg, r.k[:, :, c0:c1].to(mdt).transpose(-1, -2)).to(cdt)  # [B, Hkv, G*Nq, C]
        if r.softcap is not None:
            s = torch.tanh(s * (1.0 / r.softcap)) * (r.softcap * _LOG2E)
        if c0 < all_lo or c1 > all_hi:  # the union's edges: evaluate visibility here only
            kpos = torch.arange(c0, c1, device=r.q.device).view(1, -1)
            s = s.masked_fill(~visible(qpos, kpos, causal=r.causal, window=r.window), float("-inf"))
        m_c = s.detach().amax(dim=-1, keepdim=True)  # [B, Hkv, G*Nq, 1]; a stabiliser only
        m_new = m_c if m is None else torch.maximum(m, m_c)
        ms_new = torch.where(torch.isfinite(m_new), m_new, torch.zeros((), dtype=cdt, device=s.device))
        p = torch.exp2(s - ms_new)  # [B, Hkv, G*Nq, C]; 0 where hidden
        o = torch.matmul(p.to(mdt), r.v[:, :, c0:c1].to(mdt)).to(cdt)  # [B, Hkv, G*Nq, Dv]
        if acc is None:
            acc, den = o, p.sum(dim=-1, keepdim=True)
        else:
            alpha = torch.exp2(ms - ms_new)  # rescales what the earlier chunks summed
            acc, den = acc * alpha + o, den * alpha + p.sum(dim=-1, keepdim=True)
        m, ms = m_new, ms_new
    assert acc is not None and den is not None and ms is not None
    seen = den > 0
    den = torch.where(seen, den, torch.ones((), dtype=cdt, device=den.device))
    out = (acc / den).reshape(B, Hq, Nq, Dv).to(r.q.dtype)  # [B, Hkv, G*Nq, Dv] -> [B, Hq, Nq, Dv]
    lse = torch.where(seen, (ms + torch.log2(den)) * _LN2,
                      torch.full((), float("-inf"), dtype=cdt, device=den.device))
    return out, lse.reshape(B, Hq, Nq)
