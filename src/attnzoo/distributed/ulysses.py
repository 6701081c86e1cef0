"""Ulysses attention: exact softmax attention over a sequence sharded across ranks, by an
all-to-all from sequence shards to head shards, one ordinary attention call on the whole
sequence per rank (for ``H / P`` heads), and the reverse all-to-all.

Where ring attention moves K/V ``P - 1`` times around the ring, Ulysses moves every one of
``q, k, v, out`` once (an all-to-all each way); each rank then holds the *whole* sequence for
its heads, so anything :func:`attnzoo.attention` supports works unchanged (masks, documents,
ALiBi, softcap, sinks). It needs ``Hq`` divisible by the ranks; K/V heads are sharded the same
way when ``Hkv`` is divisible too, and each K/V head is replicated to the ``P / Hkv`` ranks whose
query heads read it when ``Hkv < P`` (``P % Hkv == 0``): never more copies than that.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnzoo._validate import Window, check_bool, normalize_window
from attnzoo.distributed.comm import agree, all_to_all_grad, as_timeout, require_dist, resolve_group
from attnzoo.distributed.sharding import (
    DTYPES,
    LAYOUTS,
    check_layout,
    check_local_shards,
    check_score,
    cu_checksum,
    global_cu_seqlens,
    global_document_ids,
    head_values_checksum,
    positions_of,
    window_and_scale,
)
from attnzoo.functional.core._request import check_qkv
from attnzoo.functional.core.score_mod import ScoreModFn
from attnzoo.functional.softmax.attention import attention
from attnzoo.functional.softmax.sigmoid import sigmoid_attention
from attnzoo.masks import Mask, document

__all__ = ["ulysses_attention"]

# entries of the cross-rank check; all but "n" (contiguous layout) must agree
_FIELDS = ("B", "Hq", "Hkv", "n", "D", "Dv", "dtype", "layout", "causal", "left", "right", "scale", "softcap",
           "alibi", "needs_grad", "cu_len", "cu_sum", "cu_chk", "sigmoid", "bias", "sinks", "score_mod", "mask")


def _local_checks(q: object, k: object, v: object, world: int, layout: str, causal: object, win: Window | None,
                  scale: object, softcap: object, alibi_slopes: object, sinks: object,
                  cu_seqlens: object, score: object, bias: object, score_mod: object, mask: object) -> list[float]:
    check_qkv(q, k, v)
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    check_bool(causal, "causal")
    check_local_shards(q, k, layout)
    B, hq, n, d = q.shape
    hkv = k.shape[1]
    if hq % world:
        raise ValueError(f"Ulysses attention shards query heads over the {world} ranks, so Hq must be divisible by "
                         f"{world}, got Hq={hq} (use ring attention)")
    if hkv % world and world % hkv:
        raise ValueError(f"Ulysses attention needs Hkv divisible by the {world} ranks or dividing it (KV heads "
                         f"replicated), got Hkv={hkv}")
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != (hq,) or not t.is_floating_point()):
            raise ValueError(f"{name} must be a float tensor [Hq] = [{hq}] or None, got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else t!r}")
    sig = check_score(score, bias, sinks, score_mod, mask)
    cu = [0.0, 0.0, 0.0] if cu_seqlens is None else cu_checksum(global_cu_seqlens(cu_seqlens, "ulysses_attention"))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return [B, hq, hkv, n, d, v.shape[3], DTYPES.index(q.dtype), LAYOUTS.index(layout), float(bool(causal)),
            *window_and_scale(win, scale, d), 0.0 if softcap is None else float(softcap),  # type: ignore[arg-type]
            head_values_checksum(alibi_slopes, hq), float(needs_grad), *cu, *sig]  # type: ignore[arg-type]


def _describe(row: list[float]) -> str:
    return ", ".join(f"{name}={val:g}" for name, val in zip(_FIELDS, row, strict=True))


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Any = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    layout: str = "contiguous",
    cu_seqlens: Tensor | None = None,
    mask: Mask | None = None,
    backend: str = "auto",
    timeout: float | timedelta | None = None,
    score: str = "softmax",
    bias: float | None = None,
    score_mod: ScoreModFn | None = None,
) -> Tensor:
    """Exact attention over a sharded sequence by two all-to-alls (DeepSpeed-Ulysses style).

    Every rank passes its shard and gets back its rows of ``az.attention`` (``score="sigmoid"``:
    :func:`attnzoo.sigmoid_attention`) on the gathered sequence, forward and backward (the
    backward of each all-to-all is the reverse all-to-all).

    Args:
        q: local queries ``[B, Hq, n, D]``; ``Hq`` divisible by the number of ranks ``P``.
        k: local keys ``[B, Hkv, n, D]``; ``Hkv % P == 0`` (sharded) or ``P % Hkv == 0``
            (each K/V head replicated to the ``P / Hkv`` ranks that read it).
        v: local values ``[B, Hkv, n, Dv]``.
        group: a ProcessGroup or a 1-D DeviceMesh (default: the world).
        causal, window, scale, softcap: as in :func:`attnzoo.attention`, global positions.
        alibi_slopes, sinks: ``[Hq]``, the same on every rank; each rank uses its heads' entries
            (``sinks.grad`` holds this rank's heads: sum it over ranks like other gradients).
        layout: ``"contiguous"`` (uneven shards allowed) or ``"zigzag"``.
        cu_seqlens: global document boundaries ``[S+1]`` (int; ends at the global length): a
            query sees keys of its own document only.
        mask: an :class:`attnzoo.masks.Mask` over *global* positions (position patterns such as
            local-global; every rank holds the whole sequence for its heads). Not a tensor.
        backend: the :func:`attnzoo.attention` backend of the per-rank call.
        timeout: seconds (or a timedelta) for any network wait (default: the group's).
        score: ``"softmax"`` or ``"sigmoid"`` (no normaliser; no ``sinks``).
        bias: the sigmoid bias (``score="sigmoid"`` only); default ``-log(N)`` of the *whole*
            sequence, as one process computes it.
        score_mod: as in :func:`attnzoo.attention` (softmax only), seeing *global* positions and
            *global* query heads ``h`` (the same function on every rank; the tensors it captures
            get this rank's heads' share of their gradients).

    Returns:
        ``out [B, Hq, n, Dv]``.

    Raises:
        ValueError / TypeError on every rank (before any data moves) when one rank's inputs are
        invalid or the ranks disagree; RuntimeError when a peer dies or times out.
    """
    fn = "ulysses_attention"
    require_dist(fn)
    pg = resolve_group(group, fn)
    tmo = as_timeout(timeout)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    vals: list[float] | None = None
    err: Exception | None = None
    win: Window | None = None
    try:
        layout = check_layout(layout, fn)
        win = normalize_window(window)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        if mask is not None and not isinstance(mask, Mask):
            raise TypeError(f"mask must be an attnzoo.masks.Mask over global positions or None, got "
                            f"{type(mask).__name__} (a dense mask does not shard)")
        vals = _local_checks(q, k, v, world, layout, causal, win, scale, softcap, alibi_slopes, sinks, cu_seqlens,
                             score, bias, score_mod, mask)
        if score_mod is not None and (score != "softmax" or not callable(score_mod)):
            raise TypeError(f"score_mod must be a callable with score='softmax' or None, got {score_mod!r} "
                            f"with score={score!r}")
    except (TypeError, ValueError) as e:
        err = e
    same = [i for i, f in enumerate(_FIELDS) if f != "n" or layout == "zigzag"]
    rows = agree(pg, vals, err, fn, tmo, same=same, describe=_describe, names=_FIELDS)
    lengths = [int(r[_FIELDS.index("n")]) for r in rows]
    if cu_seqlens is not None:
        docs = document(global_document_ids(cu_seqlens, lengths, fn, rank, q.device))
        mask = docs if mask is None else mask & docs
    return _exchange_and_attend(q, k, v, pg, tmo, layout, lengths, mask, causal=causal, window=win, scale=scale,
                                softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, backend=backend,
                                score=score, bias=bias, score_mod=score_mod)


def _at_heads(mod: ScoreModFn | None, h0: int) -> ScoreModFn | None:
    """``mod`` for this rank's heads ``h0 ..``: the function sees global query heads."""
    if mod is None or h0 == 0:
        return mod

    def shifted(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mod(s, b, h + h0, q_idx, kv_idx)

    return shifted


def _exchange_and_attend(q: Tensor, k: Tensor, v: Tensor, pg: Any, tmo: timedelta | None, layout: str,
                         lengths: list[int], mask: Mask | None, *, causal: bool, window: Window | None,
                         scale: float | None, softcap: float | None, alibi_slopes: Tensor | None,
                         sinks: Tensor | None, backend: str, score: str, bias: float | None,
                         score_mod: ScoreModFn | None) -> Tensor:
    """Sequence shards -> head shards (global order), attention, and back (all validated)."""
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    win = window
    hq, hkv = q.shape[1], k.shape[1]
    if hkv % world:  # fewer KV heads than ranks: each head goes to the P / Hkv ranks that read it
        k, v = (t.repeat_interleave(world // hkv, dim=1) for t in (k, v))
    # rank order of the gathered sequence -> global order (identity for contiguous)
    order = torch.cat([positions_of(layout, lengths, r) for r in range(world)])
    to_global = None if layout == "contiguous" else torch.argsort(order).to(q.device)

    def to_heads(t: Tensor) -> Tensor:  # [B, H, n, D] -> [B, H / P, N, D] in global order
        h = t.shape[1] // world
        out = all_to_all_grad(t, 1, 2, [h] * world, lengths, pg, tmo)
        return out if to_global is None else out.index_select(2, to_global)

    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    heads = slice(rank * hq // world, (rank + 1) * hq // world)
    slopes = None if alibi_slopes is None else alibi_slopes[heads]
    if score == "sigmoid":  # no normaliser: the same call as one process, for this rank's heads
        out = sigmoid_attention(qh, kh, vh, bias=bias, mask=mask, causal=causal, window=win, scale=scale,
                                softcap=softcap, alibi_slopes=slopes, backend=backend)
    else:
        out = attention(qh, kh, vh, mask=mask, causal=causal, window=win, scale=scale, softcap=softcap,
                        alibi_slopes=slopes, sinks=None if sinks is None else sinks[heads], backend=backend,
                        score_mod=_at_heads(score_mod, heads.start))
    assert isinstance(out, Tensor)
    if to_global is not None:  # back to rank order
        out = out.index_select(2, order.to(q.device))
    return all_to_all_grad(out, 2, 1, lengths, [hq // world] * world, pg, tmo)  # [B, Hq, n, Dv]
