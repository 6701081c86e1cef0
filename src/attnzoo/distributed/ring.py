"""Ring attention: exact softmax attention over a sequence sharded across the ranks of a group.

K/V shards travel around the ring while every rank attends its queries to the shard it holds;
partial results merge by their log-sum-exp. The backward pass runs the tiled backend's backward
kernel on every visible shard pair (see :mod:`attnzoo.distributed`)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnzoo._validate import Window, check_bool, check_int, check_positive_float, normalize_window
from attnzoo.distributed.comm import Pending, Ring, as_timeout, require_dist, resolve_group, wait
from attnzoo.distributed.sharding import (
    DTYPES,
    LAYOUTS,
    Segment,
    check_layout,
    check_local_shards,
    check_score,
    check_seq_len,
    contiguous_lengths,
    cu_checksum,
    global_cu_seqlens,
    global_document_ids,
    head_values_checksum,
    segments,
    window_and_scale,
)
from attnzoo.functional.backends.tiled import accumulate_grads, tile_plan
from attnzoo.functional.core._request import build_request, check_qkv
from attnzoo.functional.core.rules import compute_dtype, key_bounds
from attnzoo.functional.core.score_mod import ScoreMod, ScoreModFn, check_score_mod
from attnzoo.functional.softmax.attention import attention, merge_attention
from attnzoo.functional.softmax.sigmoid import sigmoid_attention

__all__ = ["BACKWARD_BLOCK", "PAIR_STATS", "ring_attention", "work_per_rank"]

#: Shard pairs (query segment, key segment) of this process's forward passes: ``"computed"`` and
#: ``"skipped"`` (hidden by the causal/window pattern or by documents that span neither).
PAIR_STATS: Counter[str] = Counter()

#: Query rows per block in the backward pass (memory ``O(BACKWARD_BLOCK x local N)``).
BACKWARD_BLOCK = 256

_HIDDEN, _PARTIAL, _FULL = 0, 1, 2

_META_FIELDS = ("ok", "B", "Hq", "Hkv", "Nq", "Nk", "D", "Dv", "dtype", "layout", "causal",
                "left", "right", "scale", "needs_grad", "softcap", "alibi_sum", "alibi_check",
                "cu_len", "cu_sum", "cu_chk", "sigmoid", "bias", "sinks", "score_mod", "mask")


@dataclass(frozen=True)
class _Meta:
    values: tuple[float, ...]

    def __getattr__(self, name: str) -> Any:
        if name in _META_FIELDS:
            return self.values[_META_FIELDS.index(name)]
        raise AttributeError(name)

    def describe(self) -> str:
        if not self.ok:
            return "invalid inputs"
        dt = DTYPES[int(self.dtype)]
        win = None if self.left == -2 else (None if self.left < 0 else int(self.left), None if self.right < 0 else int(self.right))
        grad = ", needs grad" if self.needs_grad else ""
        return (f"q [{int(self.B)}, {int(self.Hq)}, {int(self.Nq)}, {int(self.D)}], k/v [{int(self.B)}, "
                f"{int(self.Hkv)}, {int(self.Nk)}, {int(self.D)}/{int(self.Dv)}], {dt}, layout "
                f"{LAYOUTS[int(self.layout)]!r}, causal={bool(self.causal)}, window={win}, scale={self.scale:.6g}"
                f"{f', softcap={self.softcap:.6g}' if self.softcap else ''}"
                f"{f', alibi slopes sum {self.alibi_sum:.6g}' if self.alibi_check else ''}{grad}")


def _local_meta(q: object, k: object, v: object, layout: str, causal: bool, win: Window | None,
                scale: float | None, softcap: float | None = None, alibi: Tensor | None = None,
                cu: Tensor | None = None, score: list[float] | None = None) -> list[float]:
    """Encode this rank's (already validated) request for the cross-rank comparison."""
    check_qkv(q, k, v)
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    check_local_shards(q, k, layout)
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if alibi is not None and tuple(alibi.shape) != (Hq,):
        raise ValueError(f"alibi_slopes must have shape [Hq] = [{Hq}], got {tuple(alibi.shape)}")
    # two checksums of the slopes: their sum and an order-sensitive one (1 + sum_h h * slope_h; 0 = none)
    a_sum = 0.0 if alibi is None else float(alibi.double().sum())
    vals = [1.0, B, Hq, Hkv, Nq, Nk, D, Dv, DTYPES.index(q.dtype), LAYOUTS.index(layout), float(causal),
            *window_and_scale(win, scale, D), float(needs_grad), 0.0 if softcap is None else float(softcap),
            a_sum, head_values_checksum(alibi, Hq), *([0.0, 0.0, 0.0] if cu is None else cu_checksum(cu)),
            *(score or [0.0] * 5)]
    return [float(x) for x in vals]


def _exchange_meta(ring: Ring, vals: list[float] | None, err: Exception | None,
                   device: torch.device) -> list[_Meta]:
    """All-gather every rank's request; raise on every rank if any is invalid or they disagree."""
    mine = torch.tensor(vals if vals is not None else [0.0] * len(_META_FIELDS), dtype=torch.float64,
                        device=device)
    bufs = [torch.empty_like(mine) for _ in range(ring.size)]
    wait(dist.all_gather(bufs, mine, group=ring.group, async_op=True), ring.timeout, ring.rank,
          "ring_attention: the all_gather of input shapes")
    metas = [_Meta(tuple(b.tolist())) for b in bufs]
    if err is not None:  # this rank's own error, with its own type (TypeError / ValueError)
        raise type(err)(f"ring_attention on rank {ring.rank}: {err}") from err
    bad = [r for r, m in enumerate(metas) if not m.ok]
    if bad:
        raise ValueError(f"ring_attention on rank {ring.rank}: rank(s) {bad} rejected their inputs "
                         "(their own error says why); every rank stops instead of waiting for them")
    ref = metas[0]
    same = [f for f in _META_FIELDS if f not in ("Nq", "Nk")]
    if ref.layout == LAYOUTS.index("zigzag"):
        same += ["Nq"]
    for f in same:
        if len({getattr(m, f) for m in metas}) > 1:
            table = "; ".join(f"rank {r}: {m.describe()}" for r, m in enumerate(metas))
            what = {"Nq": "local sequence lengths (the zigzag layout needs equal shards)",
                    "needs_grad": "whether gradients are needed (every rank must run the backward too)",
                    }.get(f, repr(f))
            raise ValueError(f"ring_attention on rank {ring.rank}: ranks disagree on {what}; {table}")
    return metas


def _classify(q_lo: int, nq: int, k_lo: int, nk: int, causal: bool, win: Window | None) -> int:
    """Whether global query rows ``q_lo..`` see none, some or all of global keys ``k_lo..``."""
    left, right = key_bounds(causal, win)
    q_last, k_last = q_lo + nq - 1, k_lo + nk - 1
    hi_last = math.inf if right is None else q_last + right  # furthest key the last query sees
    lo_first = -math.inf if left is None else q_lo - left  # nearest key the first query sees
    if hi_last < k_lo or lo_first > k_last:
        return _HIDDEN
    lo_last = -math.inf if left is None else q_last - left
    hi_first = math.inf if right is None else q_lo + right
    if lo_last <= k_lo and hi_first >= k_last:
        return _FULL
    return _PARTIAL


def work_per_rank(seq_len: int, world_size: int, *, layout: str = "contiguous", causal: bool = False,
                  window: int | tuple[int | None, int | None] | None = None) -> list[int]:
    """Query-key scores each rank computes in one forward of :func:`ring_attention` (its schedule:
    shard pairs that the mask hides completely are skipped, all others are computed in full).

    With ``causal=True`` the ``"contiguous"`` layout gives rank ``r`` about ``(r + 1) / P`` of the
    last rank's work; ``"zigzag"`` gives every rank the same.
    """
    layout = check_layout(layout, "work_per_rank")
    check_int(world_size, "world_size", "work_per_rank")
    check_bool(causal, "causal", "work_per_rank")
    check_seq_len(seq_len, world_size, layout, "work_per_rank")
    win = normalize_window(window)
    lengths = contiguous_lengths(seq_len, world_size) if layout == "contiguous" else [seq_len // world_size] * world_size
    out = []
    for r in range(world_size):
        total = 0
        for src in range(world_size):
            for qs in segments(layout, lengths, r):
                for ks in segments(layout, lengths, src):
                    if _classify(qs.global_lo, qs.length, ks.global_lo, ks.length, causal, win) != _HIDDEN:
                        total += qs.length * ks.length
        out.append(total)
    return out


@dataclass(frozen=True)
class _Config:
    layout: str
    causal: bool
    window: Window | None
    scale: float
    backend: str
    block: int
    softcap: float | None = None
    alibi: Tensor | None = None  # [Hq] slopes in the compute dtype
    docs: Tensor | None = None  # [N] document id of every global position (cu_seqlens)
    score_mod: ScoreMod | None = None  # az.attention's score_mod, on global positions
    sigmoid_bias: float | None = None  # set: sigmoid scores with this bias (no normaliser)


def _pair(qs: Segment, ks: Segment, cfg: _Config) -> tuple[int, Tensor | None]:
    """Visibility of a shard pair and, when documents split it, its bool mask ``[nq, nk]``."""
    vis = _classify(qs.global_lo, qs.length, ks.global_lo, ks.length, cfg.causal, cfg.window)
    if vis == _HIDDEN or cfg.docs is None:
        return vis, None
    dq = cfg.docs[qs.global_lo:qs.global_lo + qs.length]  # sorted: first/last are min/max
    dk = cfg.docs[ks.global_lo:ks.global_lo + ks.length]
    if int(dq[-1]) < int(dk[0]) or int(dk[-1]) < int(dq[0]):
        return _HIDDEN, None  # no document spans both segments
    if int(dq[0]) == int(dq[-1]) == int(dk[0]) == int(dk[-1]):
        return vis, None  # one document holds both
    return _PARTIAL, dq[:, None] == dk[None, :]


def _forward_pairs(q: Tensor, k_src: Tensor, v_src: Tensor, q_segs: list[Segment], k_segs: list[Segment],
                   out: Tensor, lse: Tensor, cfg: _Config) -> None:
    """Merge attention of the local queries over one (possibly remote) K/V shard into ``out, lse``."""
    for qs in q_segs:
        q_sl = slice(qs.local_lo, qs.local_lo + qs.length)
        outs, lses = [out[:, :, q_sl]], [lse[:, :, q_sl]]
        for ks in k_segs:
            vis, doc_mask = _pair(qs, ks, cfg)
            PAIR_STATS["skipped" if vis == _HIDDEN else "computed"] += 1
            if vis == _HIDDEN:
                continue
            k_sl = slice(ks.local_lo, ks.local_lo + ks.length)
            qq, kk, vv = q[:, :, q_sl], k_src[:, :, k_sl], v_src[:, :, k_sl]
            mods = {"softcap": cfg.softcap, "alibi_slopes": cfg.alibi,
                    "score_mod": _at_keys(cfg.score_mod, ks.global_lo)}
            if vis == _FULL and cfg.alibi is None and cfg.score_mod is None:  # no mask, no positions: the backend's fastest path
                o, s = attention(qq, kk, vv, scale=cfg.scale, softcap=cfg.softcap, return_lse=True,
                                 backend=cfg.backend)
            elif vis == _FULL:  # ALiBi needs the pair's relative offset, not a mask
                o, s = attention(qq, kk, vv, q_offset=qs.global_lo - ks.global_lo, scale=cfg.scale,
                                 return_lse=True, backend=cfg.backend, **mods)
            else:
                o, s = attention(qq, kk, vv, mask=doc_mask, causal=cfg.causal, window=cfg.window,
                                 q_offset=qs.global_lo - ks.global_lo, scale=cfg.scale, return_lse=True,
                                 backend=cfg.backend, **mods)
            outs.append(o)
            lses.append(s.to(lse.dtype))
        if len(outs) > 1:
            o_m, s_m = merge_attention(outs, lses)
            out[:, :, q_sl] = o_m
            lse[:, :, q_sl] = s_m


def _backward_pairs(q: Tensor, d_out: Tensor, lse: Tensor, delta: Tensor, k_src: Tensor, v_src: Tensor,
                    q_segs: list[Segment], k_segs: list[Segment], dq: Tensor, dk: Tensor, dv: Tensor,
                    cfg: _Config, captured_grads: dict[int, Tensor] | None = None) -> None:
    """Accumulate the gradients of attention of the local queries over one K/V shard.

    Each visible (query segment, key segment) pair runs the tiled backend's backward kernel
    (:func:`attnzoo.functional.backends.tiled.accumulate_grads`) with the *global* LSE and
    ``delta = rowsum(dO * O)`` of every row, so the pairs' sums are the exact gradients.
    ``q``, ``d_out`` and the shards are in the compute dtype; ``dq [B, Hq, n, D]`` (without the
    factor ``scale``) and ``dk, dv [B, Hkv, m, D|Dv]`` are accumulators in the compute dtype.
    """
    for qs in q_segs:
        q_sl = slice(qs.local_lo, qs.local_lo + qs.length)
        for ks in k_segs:
            vis, doc_mask = _pair(qs, ks, cfg)
            if vis == _HIDDEN:
                continue
            k_sl = slice(ks.local_lo, ks.local_lo + ks.length)
            r = build_request(q[:, :, q_sl], k_src[:, :, k_sl], v_src[:, :, k_sl], mask=doc_mask, causal=cfg.causal,
                              window=cfg.window, q_offset=qs.global_lo - ks.global_lo, scale=cfg.scale,
                              softcap=cfg.softcap, alibi_slopes=cfg.alibi, dropout_p=0.0, return_lse=False,
                              return_weights=False, score_mod=_at_keys(cfg.score_mod, ks.global_lo))
            plan = tile_plan(r, cfg.block)
            grads: list[Tensor | None] | None = None
            if r.score_mod is not None:
                plan = dataclasses.replace(plan, bands=())  # score_mod tiles are [B, Hq, bq, bk]
                grads = [None] * len(r.score_mod.captured)
            accumulate_grads(r, plan, r.q, r.k, r.v, d_out[:, :, q_sl], lse[:, :, q_sl], delta[:, :, q_sl],
                             dq[:, :, q_sl], dk[:, :, k_sl], dv[:, :, k_sl], grads)
            for t, g in zip(r.score_mod.captured if grads else (), grads or (), strict=True):
                if g is not None and captured_grads is not None and id(t) in captured_grads:  # keyed by the tensor: the pair's probe finds them anew
                    captured_grads[id(t)] += g


def _at_keys(mod: ScoreMod | None, k_lo: int) -> ScoreModFn | None:
    """``mod`` for a shard pair whose keys start at global position ``k_lo`` (the pair's positions
    are relative to it): the function sees global positions."""
    if mod is None:
        return None
    fn = mod.fn
    if k_lo == 0:
        return fn

    def shifted(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return fn(s, b, h, q_idx + k_lo, kv_idx + k_lo)

    return shifted


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: Ring, metas: list[_Meta],  # type: ignore[override]
                cfg: _Config, sinks: Tensor | None, *captured: Tensor) -> tuple[Tensor, Tensor]:
        r = ring.rank
        lengths = [int(m.Nq) for m in metas]
        cdt = compute_dtype(q.dtype)
        B, hq, n, _ = q.shape
        out = torch.zeros(B, hq, n, v.shape[-1], dtype=cdt, device=q.device)  # [B, Hq, n, Dv]
        lse = torch.full((B, hq, n), -math.inf, dtype=cdt, device=q.device)  # [B, Hq, n]
        q_segs = segments(cfg.layout, lengths, r)
        _ring_forward_steps(ring, k, v, lengths, lambda k_cur, v_cur, src: _forward_pairs(
            q, k_cur, v_cur, q_segs, segments(cfg.layout, lengths, src), out, lse, cfg))
        if sinks is not None:
            # Each head's sink logit joins every row's softmax as a key with no value: lse' =
            # logaddexp(lse, z), out' = out exp(lse - lse'). The backward below, run with (out',
            # lse'), then differentiates the sinked softmax exactly (the sink column has no dK/dV).
            z = sinks.detach().to(cdt).view(1, -1, 1)  # [1, Hq, 1]
            sinked = torch.logaddexp(lse, z)
            out = out * torch.exp(lse - sinked).unsqueeze(-1)
            lse = sinked
        out_q = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_q, lse, sinks)
        ctx.ring, ctx.lengths, ctx.cfg, ctx.captured = ring, lengths, cfg, captured
        ctx.mark_non_differentiable(lse)
        return out_q, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, _d_lse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring, lengths, cfg = ctx.ring, ctx.lengths, ctx.cfg
        cdt = compute_dtype(q.dtype)
        d_out = d_out.contiguous().to(cdt)  # the kernel runs in the compute dtype
        delta = (d_out * out.to(cdt)).sum(-1)  # [B, Hq, n]
        q_c = q.to(cdt)
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        q_segs = segments(cfg.layout, lengths, ring.rank)
        captured_grads = {id(t): torch.zeros_like(t) for t in ctx.captured if t.requires_grad}
        dk, dv = _ring_backward_steps(ring, k, v, lengths, cdt, lambda k_cur, v_cur, src, dk, dv: _backward_pairs(
            q_c, d_out, lse, delta, k_cur.to(cdt), v_cur.to(cdt), q_segs, segments(cfg.layout, lengths, src),
            dq, dk, dv, cfg, captured_grads))
        d_sinks = None
        if sinks is not None:  # d z_h = -sum over this rank's rows of p_sink * delta (the sink has v = 0)
            p_sink = torch.exp(sinks.to(cdt).view(1, -1, 1) - lse)  # [B, Hq, n]
            d_sinks = -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
        d_captured = tuple(captured_grads.get(id(t)) for t in ctx.captured)  # this rank's rows' share
        return dq.mul_(cfg.scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, d_sinks, *d_captured


def _ring_forward_steps(ring: Ring, k: Tensor, v: Tensor, lengths: list[int],
                        step: Callable[[Tensor, Tensor, int], None]) -> None:
    """Pass the K/V shards around the ring: ``step(k_src, v_src, src)`` runs on every rank's shard
    in turn (its own first), while the next shard is already on its way."""
    P, r = ring.size, ring.rank
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for t in range(P):
        src = (r - t) % P
        pending = None
        if t < P - 1:  # start moving the next shard before computing on this one
            nxt = (src - 1) % P
            pending = ring.start([k_cur, v_cur], [(_shard_shape(k, lengths[nxt]), k.dtype),
                                                  (_shard_shape(v, lengths[nxt]), v.dtype)],
                                 tag=0, what=f"K/V shards (step {t + 1} of {P})")
        step(k_cur, v_cur, src)
        if pending is not None:
            k_cur, v_cur = ring.finish(pending)


def _ring_backward_steps(ring: Ring, k: Tensor, v: Tensor, lengths: list[int], cdt: torch.dtype,
                         step: Callable[[Tensor, Tensor, int, Tensor, Tensor], None]) -> tuple[Tensor, Tensor]:
    """The backward ring: ``step(k_src, v_src, src, dk, dv)`` adds this rank's contributions to the
    zeroed buffers ``dk, dv`` (compute dtype ``cdt``) of shard ``src``; the buffers travel with the
    shards and come back complete: this rank's ``(dk, dv)``."""
    P, r = ring.size, ring.rank
    k_cur, v_cur = k.contiguous(), v.contiguous()
    dkv_pending: Pending | None = None
    dk = dv = k  # replaced at the first step
    for t in range(P):
        src = (r - t) % P
        nxt = (src - 1) % P
        kv_pending = None
        if t < P - 1:
            kv_pending = ring.start([k_cur, v_cur], [(_shard_shape(k, lengths[nxt]), k.dtype),
                                                     (_shard_shape(v, lengths[nxt]), v.dtype)],
                                    tag=0, what=f"K/V shards (backward step {t + 1} of {P})")
        dk = torch.zeros(_shard_shape(k, lengths[src]), dtype=cdt, device=k.device)
        dv = torch.zeros(_shard_shape(v, lengths[src]), dtype=cdt, device=v.device)
        step(k_cur, v_cur, src, dk, dv)
        if dkv_pending is not None:  # the buffers of shard `src` arrive with its earlier contributions
            dk_in, dv_in = ring.finish(dkv_pending)
            dk += dk_in
            dv += dv_in
        if P > 1:
            dkv_pending = ring.start([dk, dv], [(_shard_shape(k, lengths[nxt]), cdt),
                                                (_shard_shape(v, lengths[nxt]), cdt)],
                                     tag=2, what=f"dK/dV buffers (backward step {t + 1} of {P})")
        if kv_pending is not None:
            k_cur, v_cur = ring.finish(kv_pending)
    if dkv_pending is not None:  # after P hops our own buffers are back, complete
        dk, dv = ring.finish(dkv_pending)
    return dk, dv


def _sigmoid_pair(qq: Tensor, kk: Tensor, vv: Tensor, qs: Segment, ks: Segment, doc_mask: Tensor | None,
                  cfg: _Config) -> Tensor:
    """Sigmoid attention of one shard pair at its global offsets: its share of the rows' sums."""
    out = sigmoid_attention(qq, kk, vv, bias=cfg.sigmoid_bias, mask=doc_mask, causal=cfg.causal, window=cfg.window,
                            q_offset=qs.global_lo - ks.global_lo, scale=cfg.scale, softcap=cfg.softcap,
                            alibi_slopes=cfg.alibi, backend=cfg.backend)
    assert isinstance(out, Tensor)
    return out


def _visible_pairs(q_segs: list[Segment], k_segs: list[Segment], cfg: _Config,
                   count: bool) -> Iterator[tuple[slice, slice, Segment, Segment, Tensor | None]]:
    """The (query slice, key slice, segments, document mask) of every shard pair not hidden."""
    for qs in q_segs:
        for ks in k_segs:
            vis, doc_mask = _pair(qs, ks, cfg)
            if count:
                PAIR_STATS["skipped" if vis == _HIDDEN else "computed"] += 1
            if vis != _HIDDEN:
                yield (slice(qs.local_lo, qs.local_lo + qs.length), slice(ks.local_lo, ks.local_lo + ks.length),
                       qs, ks, doc_mask)


class _RingSigmoid(torch.autograd.Function):
    """Sigmoid attention around the ring: no normaliser, so each row's output is the plain sum of
    its shard pairs' outputs; the backward recomputes every visible pair under autograd."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: Ring, metas: list[_Meta],  # type: ignore[override]
                cfg: _Config) -> Tensor:
        lengths = [int(m.Nq) for m in metas]
        cdt = compute_dtype(q.dtype)
        out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=cdt, device=q.device)  # [B, Hq, n, Dv]
        q_segs = segments(cfg.layout, lengths, ring.rank)

        def step(k_src: Tensor, v_src: Tensor, src: int) -> None:
            for q_sl, k_sl, qs, ks, doc_mask in _visible_pairs(q_segs, segments(cfg.layout, lengths, src), cfg, True):
                out[:, :, q_sl] += _sigmoid_pair(q[:, :, q_sl], k_src[:, :, k_sl], v_src[:, :, k_sl], qs, ks,
                                                 doc_mask, cfg).to(cdt)

        _ring_forward_steps(ring, k, v, lengths, step)
        ctx.save_for_backward(q, k, v)
        ctx.ring, ctx.lengths, ctx.cfg = ring, lengths, cfg
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        ring, lengths, cfg = ctx.ring, ctx.lengths, ctx.cfg
        cdt = compute_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        q_segs = segments(cfg.layout, lengths, ring.rank)

        def step(k_src: Tensor, v_src: Tensor, src: int, dk: Tensor, dv: Tensor) -> None:
            for q_sl, k_sl, qs, ks, doc_mask in _visible_pairs(q_segs, segments(cfg.layout, lengths, src), cfg, False):
                qq, kk, vv = (t.detach().requires_grad_() for t in (q[:, :, q_sl], k_src[:, :, k_sl], v_src[:, :, k_sl]))
                with torch.enable_grad():
                    o = _sigmoid_pair(qq, kk, vv, qs, ks, doc_mask, cfg)
                gq, gk, gv = torch.autograd.grad(o, (qq, kk, vv), d_out[:, :, q_sl].to(o.dtype))
                dq[:, :, q_sl] += gq.to(cdt)
                dk[:, :, k_sl] += gk.to(cdt)
                dv[:, :, k_sl] += gv.to(cdt)

        dk, dv = _ring_backward_steps(ring, k, v, lengths, cdt, step)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _shard_shape(t: Tensor, n: int) -> tuple[int, ...]:
    return (t.shape[0], t.shape[1], n, t.shape[3])


def _check_options(scale: object, return_lse: object, block: object, backend: object, softcap: object,
                   alibi_slopes: object, sinks: object = None,
                   score: tuple[object, object, object] = ("softmax", None, None)) -> list[float]:
    """Local checks of ``ring_attention``'s options (errors travel to every rank); ``score`` is
    ``(score, bias, score_mod)``; returns the score's entries of the cross-rank comparison."""
    if scale is not None:
        check_positive_float(scale, "scale")
    check_bool(return_lse, "return_lse")
    check_int(block, "block", minimum=1)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if softcap is not None:
        check_positive_float(softcap, "softcap")
    if alibi_slopes is not None and (not isinstance(alibi_slopes, Tensor) or alibi_slopes.dim() != 1
                                     or not alibi_slopes.is_floating_point()
                                     or not bool(torch.isfinite(alibi_slopes).all())):
        raise ValueError(f"alibi_slopes must be a finite float tensor [Hq] or None, got "
                         f"{tuple(alibi_slopes.shape) if isinstance(alibi_slopes, Tensor) else alibi_slopes!r}")
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.dim() != 1 or not sinks.is_floating_point()
                              or not bool(torch.isfinite(sinks).all())):
        raise ValueError(f"sinks must be a finite float tensor [Hq] or None, got "
                         f"{tuple(sinks.shape) if isinstance(sinks, Tensor) else sinks!r}")
    return _check_ring_score(score[0], score[1], sinks, score[2], return_lse)


def _ring_sigmoid(q: Tensor, k: Tensor, v: Tensor, ring: Ring, metas: list[_Meta], cfg: _Config,
                  bias: float | None) -> Tensor:
    """Sigmoid attention around the ring (validated); the default bias is ``-log(N)`` of the whole sequence."""
    b = -math.log(sum(int(m.Nq) for m in metas)) if bias is None else float(bias)
    out = _RingSigmoid.apply(q, k, v, ring, metas, dataclasses.replace(cfg, sigmoid_bias=b))
    assert isinstance(out, Tensor)
    return out


def _check_ring_score(score: object, bias: object, sinks: object, score_mod: object, return_lse: object) -> list[float]:
    """:func:`check_score`, and a sigmoid score has no LSE to return and takes no ``score_mod``."""
    sig = check_score(score, bias, sinks, score_mod)
    if score == "sigmoid" and (score_mod is not None or return_lse):
        raise ValueError("score='sigmoid' has no log-sum-exp and takes no score_mod: "
                         "return_lse must be False and score_mod None")
    return sig


def ring_attention(
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
    layout: str = "contiguous",
    backend: str = "auto",
    return_lse: bool = False,
    timeout: float | timedelta | None = None,
    block: int = BACKWARD_BLOCK,
    sinks: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    score_mod: ScoreModFn | None = None,
    score: str = "softmax",
    bias: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded across the ranks of a process group.

    Every rank calls this with its own shard; the result on each rank is its rows of
    ``az.attention`` on the gathered sequence. Differentiable (see the module docstring).

    Args:
        q: local queries ``[B, Hq, n, D]``.
        k: local keys ``[B, Hkv, n, D]`` (same positions as ``q``; ``Hq % Hkv == 0``, GQA/MQA
            without expanding K/V).
        v: local values ``[B, Hkv, n, Dv]``.
        group: process group (default: the world); its ranks form the ring in rank order.
        causal: key ``j`` visible to query ``p`` iff ``j <= p`` (global positions).
        window: ``w`` or ``(left, right)``: key ``j`` visible iff ``p - left <= j <= p + right``.
        scale: score scale, default ``1 / sqrt(D)``.
        softcap: ``s -> softcap * tanh(s / softcap)`` on the scaled scores, as in ``az.attention``.
        alibi_slopes: ``[Hq]``; adds ``-slope * |q_pos - k_pos|`` with *global* positions (the same
            slopes on every rank).
        layout: ``"contiguous"`` (uneven shards allowed) or ``"zigzag"`` (balanced under causal
            masks; equal, even shards). Cut shards with :func:`shard_sequence`.
        backend: ``az.attention`` backend for each shard pair (it must support ``return_lse``:
            ``"auto"`` picks ``tiled``, memory linear in the shard; ``"reference"`` is the oracle).
        return_lse: also return the global log-sum-exp of the local rows ``[B, Hq, n]``
            (float32, float64 for float64 inputs; ``-inf`` where a row sees no key).
        timeout: seconds (or a timedelta) any single wait on the network may take before this
            rank raises; default: the process group's timeout.
        block: query rows per block in the backward pass.
        sinks: ``[Hq]`` learnable sink logits (gpt-oss), as in ``az.attention(..., sinks=)``: each
            row's softmax also runs over its head's sink, whose column carries no value; the LSE
            includes it. Differentiable; each rank's ``sinks.grad`` holds its rows' share (sum it
            over ranks with the other parameters' gradients).
        cu_seqlens: packed documents across ranks: the *global* boundaries ``[S+1]`` (int, from 0
            to the global length, the same on every rank); a query sees keys of its own document
            only. Shard pairs that no document spans are skipped (counted in ``PAIR_STATS``).
        score_mod: as in ``az.attention``, on *global* positions (the same function on every
            rank); the tensors it captures get this rank's rows' share of their gradients.
        score, bias: ``"softmax"``, or ``"sigmoid"`` (:func:`attnzoo.sigmoid_attention` with ``bias``,
            default ``-log(N)`` of the whole sequence): each row sums its shard pairs' outputs, no
            normaliser; not with ``sinks``, ``score_mod`` or ``return_lse``.

    Returns:
        ``out [B, Hq, n, Dv]`` (dtype of ``q``), or ``(out, lse)`` with ``return_lse``.

    Raises:
        RuntimeError: no process group, or a peer died / timed out (names rank, step and peer).
        ValueError / TypeError: invalid inputs on any rank, or ranks that disagree on shapes,
            dtype or options. Raised on *every* rank, before any shard moves.
    """
    fn = "ring_attention"
    require_dist(fn)
    group = resolve_group(group, fn)
    ring = Ring(group, as_timeout(timeout))
    # Validate locally, but report through the all_gather below so that every rank raises.
    vals: list[float] | None = None
    err: Exception | None = None
    win: Window | None = None
    mod: ScoreMod | None = None
    try:
        layout = check_layout(layout, fn)
        check_bool(causal, "causal")
        win = normalize_window(window)
        sig = _check_options(scale, return_lse, block, backend, softcap, alibi_slopes, sinks, (score, bias, score_mod))
        if sinks is not None and sinks.shape[0] != q.shape[1]:
            raise ValueError(f"sinks must have shape [Hq] = [{q.shape[1]}], got {tuple(sinks.shape)}")
        cu = None if cu_seqlens is None else global_cu_seqlens(cu_seqlens, fn)
        vals = _local_meta(q, k, v, layout, causal, win, scale, softcap, alibi_slopes, cu, sig)
        mod = check_score_mod(score_mod, q, q.shape[2], 0)
    except (TypeError, ValueError) as e:
        err = e
    if isinstance(q, Tensor):
        device = q.device
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
    metas = _exchange_meta(ring, vals, err, device)
    docs = None if cu_seqlens is None else global_document_ids(cu_seqlens, [int(m.Nq) for m in metas], fn, ring.rank, q.device)
    cfg = _Config(layout=layout, causal=causal, window=win, scale=metas[ring.rank].scale, backend=backend,
                  block=block, softcap=None if softcap is None else float(softcap),
                  alibi=None if alibi_slopes is None else alibi_slopes.detach().to(q.device, compute_dtype(q.dtype)),
                  docs=docs, score_mod=mod)
    if score == "sigmoid":
        return _ring_sigmoid(q, k, v, ring, metas, cfg, bias)
    out, lse = _RingAttention.apply(q, k, v, ring, metas, cfg, sinks, *(mod.captured if mod is not None else ()))
    if return_lse:
        return out, lse.float() if lse.dtype != torch.float64 else lse
    return out


