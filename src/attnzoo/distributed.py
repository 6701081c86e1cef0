r"""Context parallelism on ``torch.distributed``: ring attention and sequence sharding.

A sequence too long for one device is cut along its length and every rank of a process group
holds one shard of the queries, keys and values. :func:`ring_attention` then computes exact
softmax attention over the *whole* sequence: the K/V shards travel around the ring of ranks
(rank ``r`` sends to ``r + 1`` and receives from ``r - 1``) while every rank attends its queries
to the shard it holds, and the partial results are combined by their log-sum-exp
(:func:`attnzoo.merge_attention`). Sends and receives of the next shard run while the current one
is being used. Besides its own, a rank holds at most two K/V shards at a time (the one in use and
the one arriving; in the backward also their float32 ``dK, dV`` buffers), so per-rank memory for
attention grows as ``N / world_size`` (with a memory-linear backend such as ``tiled``; measured by
``benchmarks/bench_ring.py``, see ``docs/distributed.md``).

Layouts (which global positions a rank holds; ``P`` ranks, global length ``N``):

* ``"contiguous"``: rank ``r`` holds one run of positions, split like ``torch.tensor_split``
  (the first ``N % P`` ranks hold one token more). Uneven shards are handled.
* ``"zigzag"``: the sequence is cut into ``2P`` chunks of ``c = N / (2P)`` tokens and rank ``r``
  holds chunks ``r`` and ``2P - 1 - r``. Under a causal mask every rank then does the same amount
  of work (with ``"contiguous"`` the last rank does ``P`` times the work of the first).
  ``N`` must be divisible by ``2P``.

Backward: a custom autograd function. The K/V shards circulate again, each travelling with the
gradient buffers ``dK, dV`` of its owner; every rank adds its contribution for the shard it holds
and passes the buffer on, so after ``P`` hops each buffer is back home complete. The per-pair
gradients are the flash-attention backward given the *global* log-sum-exp of each query row:

.. math::

    P = e^{S - \text{lse}}, \quad dV \mathrel{+}= P^\top dO, \quad
    dS = P \odot (dO\,V^\top - \delta), \quad \delta = \text{rowsum}(dO \odot O), \quad
    dQ \mathrel{+}= s\,dS\,K, \quad dK \mathrel{+}= s\,dS^\top Q

computed ``block`` query rows at a time (``O(block x N / P)`` memory). GQA never expands K/V:
the ``G = Hq / Hkv`` query heads of a group are folded into the row dimension.

Failure handling: before any send, the ranks exchange the shapes, dtypes and options of their
inputs with one small ``all_gather``; a rank whose inputs are invalid or disagree with the others
makes *every* rank raise ``ValueError`` (no rank is left waiting for a shard that never comes).
Every wait on the network has a timeout (``timeout=`` or the process group's), and a peer that
died or timed out becomes a ``RuntimeError`` naming the rank, the ring step and the peer.

Positions follow ``docs/conventions.md``: key ``j`` is visible to query ``p`` under ``causal``
iff ``j <= p``, under ``window=(left, right)`` iff ``p - left <= j <= p + right``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnzoo.functional._request import Window, check_qkv, normalize_window
from attnzoo.functional.attention import attention, merge_attention

__all__ = [
    "LAYOUTS",
    "ContextParallel",
    "context_parallel",
    "gather_sequence",
    "ring_attention",
    "shard_positions",
    "shard_sequence",
    "work_per_rank",
]

#: Sequence layouts understood by every function of this module.
LAYOUTS = ("contiguous", "zigzag")

#: Query rows per block in the backward pass (memory ``O(BACKWARD_BLOCK x local N)``).
BACKWARD_BLOCK = 256

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HIDDEN, _PARTIAL, _FULL = 0, 1, 2


# ----------------------------------------------------------------------------- process groups
def _require_dist(fn: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{fn} needs an initialised torch.distributed process group "
                           "(launch with torchrun, or call torch.distributed.init_process_group)")


def _rank_and_size(group: Any, rank: int | None, world_size: int | None, fn: str) -> tuple[int, int]:
    """``(rank, world_size)`` from explicit arguments or from the process group."""
    if (rank is None) != (world_size is None):
        raise ValueError(f"{fn}: pass both rank and world_size or neither, got rank={rank!r}, "
                         f"world_size={world_size!r}")
    if rank is None or world_size is None:
        _require_dist(fn)
        return dist.get_rank(group), dist.get_world_size(group)
    for name, x in (("rank", rank), ("world_size", world_size)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{fn}: {name} must be an int, got {type(x).__name__} ({x!r})")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{fn}: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def _check_layout(layout: object, fn: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")
    assert isinstance(layout, str)
    return layout


def _timeout(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, a timedelta or None, got {timeout!r}")
    return timedelta(seconds=float(timeout))


# ----------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class _Segment:
    """A run of ``length`` tokens stored at ``local_lo ..`` in a shard, at ``global_lo ..`` in the sequence."""

    local_lo: int
    length: int
    global_lo: int


def _contiguous_lengths(seq_len: int, world_size: int) -> list[int]:
    base, extra = divmod(seq_len, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def _segments(layout: str, lengths: Sequence[int], rank: int) -> list[_Segment]:
    """The runs of global positions held by ``rank`` given every rank's shard length."""
    if layout == "contiguous":
        return [_Segment(0, lengths[rank], sum(lengths[:rank]))]
    p = len(lengths)
    c = lengths[rank] // 2
    return [_Segment(0, c, rank * c), _Segment(c, c, (2 * p - 1 - rank) * c)]


def _check_seq_len(seq_len: int, world_size: int, layout: str, fn: str) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"{fn}: seq_len must be an int, got {type(seq_len).__name__}")
    if seq_len < world_size:
        raise ValueError(f"{fn}: a sequence of {seq_len} tokens cannot give every one of "
                         f"{world_size} ranks a token")
    if layout == "zigzag" and seq_len % (2 * world_size):
        raise ValueError(f"{fn}: the zigzag layout needs the sequence length divisible by 2 * world_size = "
                         f"{2 * world_size}, got {seq_len}; pad the sequence (and mask the padding) or use "
                         f"layout='contiguous'")


def shard_positions(
    seq_len: int,
    *,
    group: Any = None,
    layout: str = "contiguous",
    rank: int | None = None,
    world_size: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Global positions of the tokens this rank holds, in local order (``int64 [n]``).

    Feed them to rotary embeddings (``positions=``) or use them to pick the matching targets.

    Args:
        seq_len: global sequence length ``N``.
        group: process group (default: the world); ignored when ``rank``/``world_size`` are given.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).
        rank, world_size: compute the shard of another rank without a process group.
        device: device of the result.
    """
    fn = "shard_positions"
    layout = _check_layout(layout, fn)
    r, p = _rank_and_size(group, rank, world_size, fn)
    _check_seq_len(seq_len, p, layout, fn)
    lengths = _contiguous_lengths(seq_len, p) if layout == "contiguous" else [seq_len // p] * p
    parts = [torch.arange(s.global_lo, s.global_lo + s.length, device=device) for s in _segments(layout, lengths, r)]
    return torch.cat(parts)


def shard_sequence(
    x: Tensor,
    dim: int = 1,
    *,
    group: Any = None,
    layout: str = "contiguous",
    rank: int | None = None,
    world_size: int | None = None,
) -> Tensor:
    """This rank's shard of a full sequence held by every rank (e.g. a batch of tokens).

    Args:
        x: any tensor with the sequence along ``dim`` (``[B, N, C]`` with ``dim=1``,
            ``[B, H, N, D]`` with ``dim=2``, tokens ``[B, N]`` with ``dim=1``).
        dim: the sequence dimension.
        group, layout, rank, world_size: as in :func:`shard_positions`.

    Returns:
        The tokens at :func:`shard_positions` along ``dim`` (a new contiguous tensor). No
        communication happens: every rank must already hold the same ``x``.
    """
    fn = "shard_sequence"
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < max(1, x.dim()):
        raise ValueError(f"{fn}: dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    pos = shard_positions(x.shape[dim], group=group, layout=layout, rank=rank, world_size=world_size,
                          device=x.device)
    return x.index_select(dim, pos)


class _GatherSequence(torch.autograd.Function):
    """all_gather along a dimension, reordered to global positions; backward: sum over ranks, slice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Any, layout: str, timeout: timedelta | None) -> Tensor:  # type: ignore[override]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        x = x.contiguous()
        n_local = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
        lengths_t = [torch.zeros_like(n_local) for _ in range(size)]
        _wait(dist.all_gather(lengths_t, n_local, group=group, async_op=True), timeout, rank,
              "gather_sequence: the all_gather of shard lengths")
        lengths = [int(t.item()) for t in lengths_t]
        if layout == "zigzag" and (len(set(lengths)) != 1 or lengths[0] % 2):
            raise ValueError(f"gather_sequence: the zigzag layout needs equal, even shard lengths on every "
                             f"rank, got {lengths}")
        n_max = max(lengths)
        shape = list(x.shape)
        shape[dim] = n_max
        padded = x.new_zeros(shape)
        padded.narrow(dim, 0, x.shape[dim]).copy_(x)
        bufs = [torch.empty_like(padded) for _ in range(size)]
        _wait(dist.all_gather(bufs, padded, group=group, async_op=True), timeout, rank,
              "gather_sequence: the all_gather of shards")
        pieces = [b.narrow(dim, 0, n) for b, n in zip(bufs, lengths, strict=True)]
        pos = torch.cat([torch.arange(s.global_lo, s.global_lo + s.length, device=x.device)
                         for r in range(size) for s in _segments(layout, lengths, r)])
        full = torch.cat(pieces, dim=dim).index_select(dim, torch.argsort(pos))
        ctx.dim, ctx.group, ctx.timeout = dim, group, timeout
        ctx.my_pos = torch.cat([torch.arange(s.global_lo, s.global_lo + s.length, device=x.device)
                                for s in _segments(layout, lengths, rank)])
        return full

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        g = grad.contiguous().clone()
        _wait(dist.all_reduce(g, group=ctx.group, async_op=True), ctx.timeout, dist.get_rank(ctx.group),
              "gather_sequence backward: the all_reduce of gradients")
        return g.index_select(ctx.dim, ctx.my_pos), None, None, None, None


def gather_sequence(
    x: Tensor,
    dim: int = 1,
    *,
    group: Any = None,
    layout: str = "contiguous",
    timeout: float | timedelta | None = None,
) -> Tensor:
    """The full sequence from every rank's shard (inverse of :func:`shard_sequence`), on every rank.

    Args:
        x: this rank's shard, sequence along ``dim``; shards may differ in length along ``dim``
            (``"contiguous"``), every other dimension must agree.
        dim: the sequence dimension.
        group: process group (default: the world).
        layout: the layout the shards were cut with.
        timeout: seconds (or a timedelta) to wait for the other ranks; default: the group's.

    Returns:
        ``x`` with the whole sequence along ``dim``, in global order. Differentiable: the gradient
        of a shard is the sum over ranks of the gradients at its positions (so if every rank
        computes the same loss from the gathered tensor, gradients are ``world_size`` times the
        single-process ones; compute the loss on local shards instead).
    """
    fn = "gather_sequence"
    _require_dist(fn)
    layout = _check_layout(layout, fn)
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < max(1, x.dim()):
        raise ValueError(f"{fn}: dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    out = _GatherSequence.apply(x, dim % x.dim(), group, layout, _timeout(timeout))
    assert isinstance(out, Tensor)
    return out


# ----------------------------------------------------------------------------- communication
def _wait(work: Any, timeout: timedelta | None, rank: int, what: str) -> None:
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout as RuntimeError
        raise RuntimeError(f"rank {rank}: {what} failed ({str(e).strip().splitlines()[0] if str(e).strip() else e!r}). "
                           "A peer process may have died, timed out, or called this with different "
                           "arguments.") from e


class _Ring:
    """Point-to-point exchange with the neighbours of this rank in a process group's ring."""

    def __init__(self, group: Any, timeout: timedelta | None) -> None:
        self.group = group
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process "
                             f"group passed as group=")
        self.size = dist.get_world_size(group)
        pg = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(pg, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(pg, (self.rank - 1) % self.size)

    def start(self, send: Sequence[Tensor], recv_like: Sequence[tuple[tuple[int, ...], torch.dtype]],
              tag: int, what: str) -> _Pending:
        """Send ``send`` to the next rank and receive tensors of the given shapes from the previous one."""
        send = [t.contiguous() for t in send]
        bufs = [torch.empty(shape, dtype=dt, device=send[0].device) for shape, dt in recv_like]
        # One batch per exchange: NCCL needs matching sends/receives grouped to avoid deadlock.
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group, tag + i) for i, b in enumerate(bufs)]
        works = dist.batch_isend_irecv(ops)
        return _Pending(works, bufs, send, what)

    def finish(self, p: _Pending) -> list[Tensor]:
        for w in p.works:
            _wait(w, self.timeout, self.rank,
                  f"ring exchange of {p.what} with ranks {self.prev} (recv) / {self.next} (send)")
        return p.bufs


@dataclass
class _Pending:
    works: list[Any]
    bufs: list[Tensor]
    keep: list[Tensor]  # tensors being sent, kept alive until the send completes
    what: str


# ----------------------------------------------------------------------------- metadata check
_META_FIELDS = ("ok", "B", "Hq", "Hkv", "Nq", "Nk", "D", "Dv", "dtype", "layout", "causal",
                "left", "right", "scale", "needs_grad", "softcap", "alibi_sum", "alibi_check")


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
        dt = _DTYPES[int(self.dtype)]
        win = None if self.left == -2 else (None if self.left < 0 else int(self.left), None if self.right < 0 else int(self.right))
        grad = ", needs grad" if self.needs_grad else ""
        return (f"q [{int(self.B)}, {int(self.Hq)}, {int(self.Nq)}, {int(self.D)}], k/v [{int(self.B)}, "
                f"{int(self.Hkv)}, {int(self.Nk)}, {int(self.D)}/{int(self.Dv)}], {dt}, layout "
                f"{LAYOUTS[int(self.layout)]!r}, causal={bool(self.causal)}, window={win}, scale={self.scale:.6g}"
                f"{f', softcap={self.softcap:.6g}' if self.softcap else ''}"
                f"{f', alibi slopes sum {self.alibi_sum:.6g}' if self.alibi_check else ''}{grad}")


def _local_meta(q: object, k: object, v: object, layout: str, causal: bool, win: Window | None,
                scale: float | None, softcap: float | None = None, alibi: Tensor | None = None) -> list[float]:
    """Encode this rank's (already validated) request for the cross-rank comparison."""
    check_qkv(q, k, v)
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if Nq != Nk:
        raise ValueError(f"ring_attention shards queries and keys alike, so q and k must have the same "
                         f"local length, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if Nq == 0:
        raise ValueError(f"ring_attention needs at least one token per rank, got q {tuple(q.shape)}")
    if layout == "zigzag" and Nq % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank, so the local length must be "
                         f"even, got q {tuple(q.shape)}")
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    left = -2.0 if win is None else (-1.0 if win[0] is None else float(win[0]))
    right = -2.0 if win is None else (-1.0 if win[1] is None else float(win[1]))
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if alibi is not None and tuple(alibi.shape) != (Hq,):
        raise ValueError(f"alibi_slopes must have shape [Hq] = [{Hq}], got {tuple(alibi.shape)}")
    # two checksums of the slopes: their sum and an order-sensitive one (1 + sum_h h * slope_h; 0 = none)
    a_sum = 0.0 if alibi is None else float(alibi.double().sum())
    a_chk = 0.0 if alibi is None else 1.0 + float((alibi.double().cpu() * torch.arange(1, Hq + 1)).sum())
    vals = [1.0, B, Hq, Hkv, Nq, Nk, D, Dv, _DTYPES.index(q.dtype), LAYOUTS.index(layout),
            float(causal), left, right, sc, float(needs_grad), 0.0 if softcap is None else float(softcap), a_sum,
            a_chk]
    return [float(x) for x in vals]


def _exchange_meta(ring: _Ring, vals: list[float] | None, err: Exception | None,
                   device: torch.device) -> list[_Meta]:
    """All-gather every rank's request; raise on every rank if any is invalid or they disagree."""
    mine = torch.tensor(vals if vals is not None else [0.0] * len(_META_FIELDS), dtype=torch.float64,
                        device=device)
    bufs = [torch.empty_like(mine) for _ in range(ring.size)]
    _wait(dist.all_gather(bufs, mine, group=ring.group, async_op=True), ring.timeout, ring.rank,
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


# ----------------------------------------------------------------------------- the math per shard pair
def _classify(q_lo: int, nq: int, k_lo: int, nk: int, causal: bool, win: Window | None) -> int:
    """Whether global query rows ``q_lo..`` see none, some or all of global keys ``k_lo..``."""
    left, right = win if win is not None else (None, None)
    if causal:
        right = 0
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
    layout = _check_layout(layout, "work_per_rank")
    _check_seq_len(seq_len, world_size, layout, "work_per_rank")
    win = normalize_window(window)
    lengths = _contiguous_lengths(seq_len, world_size) if layout == "contiguous" else [seq_len // world_size] * world_size
    out = []
    for r in range(world_size):
        total = 0
        for src in range(world_size):
            for qs in _segments(layout, lengths, r):
                for ks in _segments(layout, lengths, src):
                    if _classify(qs.global_lo, qs.length, ks.global_lo, ks.length, causal, win) != _HIDDEN:
                        total += qs.length * ks.length
        out.append(total)
    return out


def _visible(q_pos: Tensor, k_pos: Tensor, causal: bool, win: Window | None) -> Tensor:
    """Bool ``[nq, nk]``: key ``k_pos[j]`` visible to query ``q_pos[i]`` (``docs/conventions.md``)."""
    qp, kp = q_pos.view(-1, 1), k_pos.view(1, -1)
    ok = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=q_pos.device)
    if causal:
        ok &= kp <= qp
    if win is not None:
        if win[0] is not None:
            ok &= kp >= qp - win[0]
        if win[1] is not None:
            ok &= kp <= qp + win[1]
    return ok


def _fold(x: Tensor, hkv: int) -> Tensor:
    """``[B, Hq, n, X]`` -> ``[B, Hkv, G * n, X]`` (query heads of a KV group become rows)."""
    B, hq, n = x.shape[:3]
    return x.reshape(B, hkv, (hq // hkv) * n, *x.shape[3:])


def _unfold(x: Tensor, hq: int) -> Tensor:
    """``[B, Hkv, G * n, X]`` -> ``[B, Hq, n, X]``."""
    B, hkv, gn = x.shape[:3]
    return x.reshape(B, hq, gn // (hq // hkv), *x.shape[3:])


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


def _forward_pairs(q: Tensor, k_src: Tensor, v_src: Tensor, q_segs: list[_Segment], k_segs: list[_Segment],
                   out: Tensor, lse: Tensor, cfg: _Config) -> None:
    """Merge attention of the local queries over one (possibly remote) K/V shard into ``out, lse``."""
    for qs in q_segs:
        q_sl = slice(qs.local_lo, qs.local_lo + qs.length)
        outs, lses = [out[:, :, q_sl]], [lse[:, :, q_sl]]
        for ks in k_segs:
            vis = _classify(qs.global_lo, qs.length, ks.global_lo, ks.length, cfg.causal, cfg.window)
            if vis == _HIDDEN:
                continue
            k_sl = slice(ks.local_lo, ks.local_lo + ks.length)
            qq, kk, vv = q[:, :, q_sl], k_src[:, :, k_sl], v_src[:, :, k_sl]
            mods = {"softcap": cfg.softcap, "alibi_slopes": cfg.alibi}
            if vis == _FULL and cfg.alibi is None:  # no mask, no positions: the backend's fastest path
                o, s = attention(qq, kk, vv, scale=cfg.scale, softcap=cfg.softcap, return_lse=True,
                                 backend=cfg.backend)
            elif vis == _FULL:  # ALiBi needs the pair's relative offset, not a mask
                o, s = attention(qq, kk, vv, q_offset=qs.global_lo - ks.global_lo, scale=cfg.scale,
                                 return_lse=True, backend=cfg.backend, **mods)
            else:
                o, s = attention(qq, kk, vv, causal=cfg.causal, window=cfg.window,
                                 q_offset=qs.global_lo - ks.global_lo, scale=cfg.scale, return_lse=True,
                                 backend=cfg.backend, **mods)
            outs.append(o)
            lses.append(s.to(lse.dtype))
        if len(outs) > 1:
            o_m, s_m = merge_attention(outs, lses)
            out[:, :, q_sl] = o_m
            lse[:, :, q_sl] = s_m


def _backward_pairs(q: Tensor, d_out: Tensor, lse: Tensor, delta: Tensor, k_src: Tensor, v_src: Tensor,
                    q_segs: list[_Segment], k_segs: list[_Segment], dq: Tensor, dk: Tensor, dv: Tensor,
                    cfg: _Config) -> None:
    """Accumulate the gradients of attention of the local queries over one K/V shard.

    ``dq [B, Hq, n, D]`` and ``dk, dv [B, Hkv, m, D|Dv]`` are accumulators in the compute dtype.
    """
    cdt = dq.dtype
    hq, hkv = q.shape[1], k_src.shape[1]
    g = hq // hkv
    # Rows whose global LSE is -inf saw no key: P = exp(S - inf) = 0 there.
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf))
    for qs in q_segs:
        for ks in k_segs:
            if _classify(qs.global_lo, qs.length, ks.global_lo, ks.length, cfg.causal, cfg.window) == _HIDDEN:
                continue
            for lo in range(qs.local_lo, qs.local_lo + qs.length, cfg.block):
                hi = min(lo + cfg.block, qs.local_lo + qs.length)
                g_lo = qs.global_lo + (lo - qs.local_lo)  # global position of row `lo`
                # Keys this block of rows can see at all (a band under a window): [k_lo, k_hi).
                k_lo, k_hi = _key_range(g_lo, hi - lo, ks, cfg)
                if k_lo >= k_hi:
                    continue
                vis = _classify(g_lo, hi - lo, ks.global_lo + k_lo - ks.local_lo, k_hi - k_lo, cfg.causal, cfg.window)
                k_sl = slice(k_lo, k_hi)
                kk = k_src[:, :, k_sl].to(cdt)  # [B, Hkv, m, D]
                vv = v_src[:, :, k_sl].to(cdt)  # [B, Hkv, m, Dv]
                qf = _fold(q[:, :, lo:hi].to(cdt), hkv)  # [B, Hkv, G*r, D]
                dof = _fold(d_out[:, :, lo:hi].to(cdt), hkv)  # [B, Hkv, G*r, Dv]
                lse_f = _fold(lse_safe[:, :, lo:hi], hkv).unsqueeze(-1)  # [B, Hkv, G*r, 1]
                delta_f = _fold(delta[:, :, lo:hi], hkv).unsqueeze(-1)  # [B, Hkv, G*r, 1]
                s = torch.matmul(qf, kk.transpose(-1, -2)) * cfg.scale  # [B, Hkv, G*r, m]
                tanh: Tensor | None = None
                if cfg.softcap is not None:  # capped before biases and masks, as in az.attention
                    tanh = torch.tanh(s / cfg.softcap)
                    s = tanh * cfg.softcap
                q_pos = torch.arange(g_lo, g_lo + (hi - lo), device=q.device)
                k_pos = torch.arange(k_lo, k_hi, device=q.device) + (ks.global_lo - ks.local_lo)
                if cfg.alibi is not None:
                    dist_qk = (q_pos[:, None] - k_pos[None, :]).abs().to(cdt)  # [r, m]
                    bias = -cfg.alibi.view(hkv, g, 1, 1) * dist_qk  # [Hkv, G, r, m]
                    s = s + bias.reshape(hkv, g * (hi - lo), k_hi - k_lo)
                if vis == _PARTIAL:
                    ok = _visible(q_pos, k_pos, cfg.causal, cfg.window).repeat(g, 1)  # [G*r, m]
                    s = s.masked_fill(~ok, -math.inf)
                p = torch.exp(s - lse_f)  # [B, Hkv, G*r, m]
                dv[:, :, k_sl] += torch.matmul(p.transpose(-1, -2), dof)  # [B, Hkv, m, Dv]
                ds = p * (torch.matmul(dof, vv.transpose(-1, -2)) - delta_f)  # [B, Hkv, G*r, m]
                if tanh is not None:
                    ds = ds * (1 - tanh * tanh)
                dq[:, :, lo:hi] += _unfold(torch.matmul(ds, kk), hq) * cfg.scale  # [B, Hq, r, D]
                dk[:, :, k_sl] += torch.matmul(ds.transpose(-1, -2), qf) * cfg.scale  # [B, Hkv, m, D]


def _key_range(q_lo: int, nq: int, ks: _Segment, cfg: _Config) -> tuple[int, int]:
    """Local key indices ``[lo, hi)`` of segment ``ks`` that global query rows ``q_lo .. q_lo+nq-1``
    can see under causal/window (empty when ``lo >= hi``)."""
    left, right = cfg.window if cfg.window is not None else (None, None)
    if cfg.causal:
        right = 0
    first = ks.global_lo if left is None else max(ks.global_lo, q_lo - left)
    last = ks.global_lo + ks.length - 1 if right is None else min(ks.global_lo + ks.length - 1, q_lo + nq - 1 + right)
    shift = ks.local_lo - ks.global_lo
    return first + shift, last + 1 + shift


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: _Ring, metas: list[_Meta],  # type: ignore[override]
                cfg: _Config) -> tuple[Tensor, Tensor]:
        P, r = ring.size, ring.rank
        lengths = [int(m.Nq) for m in metas]
        cdt = _compute_dtype(q.dtype)
        B, hq, n, _ = q.shape
        out = torch.zeros(B, hq, n, v.shape[-1], dtype=cdt, device=q.device)  # [B, Hq, n, Dv]
        lse = torch.full((B, hq, n), -math.inf, dtype=cdt, device=q.device)  # [B, Hq, n]
        q_segs = _segments(cfg.layout, lengths, r)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        for t in range(P):
            src = (r - t) % P
            pending = None
            if t < P - 1:  # start moving the next shard before computing on this one
                nxt = (src - 1) % P
                pending = ring.start([k_cur, v_cur], [(_shard_shape(k, lengths[nxt]), k.dtype),
                                                      (_shard_shape(v, lengths[nxt]), v.dtype)],
                                     tag=0, what=f"K/V shards (step {t + 1} of {P})")
            _forward_pairs(q, k_cur, v_cur, q_segs, _segments(cfg.layout, lengths, src), out, lse, cfg)
            if pending is not None:
                k_cur, v_cur = ring.finish(pending)
        out_q = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_q, lse)
        ctx.ring, ctx.lengths, ctx.cfg = ring, lengths, cfg
        ctx.mark_non_differentiable(lse)
        return out_q, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, _d_lse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring, lengths, cfg = ctx.ring, ctx.lengths, ctx.cfg
        P, r = ring.size, ring.rank
        cdt = _compute_dtype(q.dtype)
        d_out = d_out.contiguous()
        delta = (d_out.to(cdt) * out.to(cdt)).sum(-1)  # [B, Hq, n]
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        q_segs = _segments(cfg.layout, lengths, r)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        dkv_pending: _Pending | None = None
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
            _backward_pairs(q, d_out, lse, delta, k_cur, v_cur, q_segs, _segments(cfg.layout, lengths, src),
                            dq, dk, dv, cfg)
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
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _shard_shape(t: Tensor, n: int) -> tuple[int, ...]:
    return (t.shape[0], t.shape[1], n, t.shape[3])


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

    Returns:
        ``out [B, Hq, n, Dv]`` (dtype of ``q``), or ``(out, lse)`` with ``return_lse``.

    Raises:
        RuntimeError: no process group, or a peer died / timed out (names rank, step and peer).
        ValueError / TypeError: invalid inputs on any rank, or ranks that disagree on shapes,
            dtype or options. Raised on *every* rank, before any shard moves.
    """
    fn = "ring_attention"
    _require_dist(fn)
    ring = _Ring(group, _timeout(timeout))
    # Validate locally, but report through the all_gather below so that every rank raises.
    vals: list[float] | None = None
    err: Exception | None = None
    try:
        layout = _check_layout(layout, fn)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        win = normalize_window(window)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"scale must be a finite positive number or None, got {scale!r}")
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                    or not math.isfinite(softcap) or softcap <= 0):
            raise ValueError(f"softcap must be a finite positive number or None, got {softcap!r}")
        if alibi_slopes is not None and (not isinstance(alibi_slopes, Tensor) or alibi_slopes.dim() != 1
                                         or not alibi_slopes.is_floating_point()
                                         or not bool(torch.isfinite(alibi_slopes).all())):
            raise ValueError(f"alibi_slopes must be a finite float tensor [Hq] or None, got "
                             f"{tuple(alibi_slopes.shape) if isinstance(alibi_slopes, Tensor) else alibi_slopes!r}")
        vals = _local_meta(q, k, v, layout, causal, win, scale, softcap, alibi_slopes)
    except (TypeError, ValueError) as e:
        err = e
    if isinstance(q, Tensor):
        device = q.device
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
    metas = _exchange_meta(ring, vals, err, device)
    cfg = _Config(layout=layout, causal=causal, window=win, scale=metas[ring.rank].scale, backend=backend,
                  block=block, softcap=None if softcap is None else float(softcap),
                  alibi=None if alibi_slopes is None else alibi_slopes.detach().to(q.device, _compute_dtype(q.dtype)))
    out, lse = _RingAttention.apply(q, k, v, ring, metas, cfg)
    if return_lse:
        return out, lse.float() if lse.dtype != torch.float64 else lse
    return out


# ----------------------------------------------------------------------------- module wrapper
def _all_lengths(n: int, group: Any, device: torch.device, timeout: timedelta | None) -> list[int]:
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    bufs = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(bufs, mine, group=group, async_op=True), timeout, dist.get_rank(group),
          "ContextParallel: the all_gather of shard lengths")
    return [int(b.item()) for b in bufs]


class ContextParallel(nn.Module):
    """Run a self-attention :class:`~attnzoo.MultiHeadAttention` on a sequence sharded over ranks.

    The wrapped module keeps its parameters (``qkv_proj``, ``out_proj``, RoPE); only the attention
    core changes: local projections, RoPE at the *global* positions of the local tokens, then
    :func:`ring_attention` over the group with the module's ``causal``/``window``/``scale``.
    Parameters are not synchronised: sum their gradients over the group (or wrap the model in
    DistributedDataParallel over the same ranks) as for any data-parallel split.

    Args:
        module: a self-attention ``MultiHeadAttention`` (also GQA/MQA/sliding-window, RoPE or
            ALiBi); attention dropout, cross-attention and local-global patterns are rejected.
        group: process group (default: the world).
        layout: ``"contiguous"`` or ``"zigzag"``: how ``x`` was cut (:func:`shard_sequence`).
        backend: backend for each shard pair (must support ``return_lse``).
        timeout: seconds (or a timedelta) for any single network wait.

    Shapes:
        ``forward(x [B, n, C]) -> [B, n, C]`` where ``x`` is this rank's shard of ``[B, N, C]``.
    """

    def __init__(self, module: nn.Module, *, group: Any = None, layout: str = "contiguous",
                 backend: str = "auto", timeout: float | timedelta | None = None) -> None:
        super().__init__()
        from attnzoo.nn.attention import MultiHeadAttention

        if not isinstance(module, MultiHeadAttention):
            raise TypeError(f"ContextParallel wraps a MultiHeadAttention (or an alias of it), got "
                            f"{type(module).__name__}")
        if module.kv_dim is not None:
            raise ValueError("ContextParallel: a cross-attention module (kv_dim set) is not supported; "
                             "shard the queries only and attend to the full context instead")
        if module._structure() is not None:
            raise ValueError(f"ContextParallel: {type(module).__name__} uses a mask pattern "
                             "(local-global); ring attention supports causal and window only")
        if module.dropout > 0:
            raise ValueError(f"ContextParallel: attention dropout ({module.dropout}) is not supported by "
                             "ring_attention; build the module with dropout=0")
        self.module = module
        self.group = group
        self.layout = _check_layout(layout, "ContextParallel")
        if not isinstance(backend, str):
            raise TypeError(f"ContextParallel: backend must be a str, got {type(backend).__name__}")
        self.backend = backend
        self.timeout = _timeout(timeout)

    def forward(self, x: Tensor, *, positions: Tensor | None = None, mask: Any = None, cache: Any = None) -> Tensor:
        """Attend from this rank's tokens ``x [B, n, C]`` to the whole sharded sequence.

        Args:
            x: the local shard.
            positions: global positions of the local tokens, int ``[n]`` or ``[B, n]`` (default:
                from the layout and every rank's shard length, i.e. :func:`shard_positions`).
                Used for RoPE.
            mask, cache: not supported (``ValueError`` unless ``None``): ring attention takes
                ``causal``/``window`` from the module, and a sharded sequence is not decoded.
        """
        _require_dist("ContextParallel")
        m = self.module
        if mask is not None or cache is not None:
            raise ValueError("ContextParallel: mask= and cache= are not supported (ring attention uses the "
                             "module's causal/window; decode with the unwrapped module)")
        if not isinstance(x, Tensor):
            raise TypeError(f"ContextParallel: x must be a tensor [B, n, C], got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != m.dim:
            raise ValueError(f"ContextParallel: x must have shape [B, n, C] with C = {m.dim}, got {tuple(x.shape)}")
        B, n, _ = x.shape
        H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
        qkv = m.qkv_proj(x)  # [B, n, (H + 2 Hkv) D]
        q_, k_, v_ = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
        q = q_.view(B, n, H, D).transpose(1, 2)  # [B, H, n, D]
        k = k_.view(B, n, Hkv, D).transpose(1, 2)  # [B, Hkv, n, D]
        v = v_.view(B, n, Hkv, D).transpose(1, 2)  # [B, Hkv, n, D]
        if m.rope is not None:
            if positions is None:
                lengths = _all_lengths(n, self.group, x.device, self.timeout)
                rank = dist.get_rank(self.group)
                positions = torch.cat([torch.arange(s.global_lo, s.global_lo + s.length, device=x.device)
                                       for s in _segments(self.layout, lengths, rank)])
            elif (not isinstance(positions, Tensor) or tuple(positions.shape) not in ((n,), (B, n))
                  or positions.is_floating_point()):
                raise ValueError(f"ContextParallel: positions must be an int tensor [n] = [{n}] or [B, n] = "
                                 f"[{B}, {n}], got "
                                 f"{positions if not isinstance(positions, Tensor) else tuple(positions.shape)}")
            cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
            cos, sin = m.rope.cos_sin(positions.to(x.device), cdt)
            q, k = m.rope.rotate(q, cos, sin), m.rope.rotate(k, cos, sin)
        out = ring_attention(q, k, v, group=self.group, causal=m.causal, window=m.window, scale=m.scale,
                             alibi_slopes=m._slopes(x.device), layout=self.layout, backend=self.backend,
                             timeout=self.timeout)
        assert isinstance(out, Tensor)
        return m.out_proj(out.transpose(1, 2).reshape(B, n, H * D))  # [B, n, C]


def context_parallel(
    model: nn.Module,
    *,
    group: Any = None,
    layout: str = "contiguous",
    backend: str = "auto",
    timeout: float | timedelta | None = None,
) -> nn.Module:
    """Wrap every self-attention ``MultiHeadAttention`` inside ``model`` in :class:`ContextParallel`.

    Afterwards the model takes this rank's shard of the tokens and their global positions, e.g.
    ``model(shard_sequence(tokens, 1, layout=...), positions=shard_positions(N, layout=...))`` for a
    :class:`~attnzoo.DecoderLM`, and returns the outputs of the local tokens. Modules that cannot
    run on a ring (cross-attention, dropout, masks) raise ``ValueError`` here, before any
    communication. Parameters are shared, not copied; ``model`` is modified in place and returned.
    """
    from attnzoo.nn.attention import MultiHeadAttention

    if not isinstance(model, nn.Module):
        raise TypeError(f"context_parallel: model must be an nn.Module, got {type(model).__name__}")
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, MultiHeadAttention) and mod.kv_dim is None and name]
    if isinstance(model, MultiHeadAttention):
        raise TypeError("context_parallel: wrap a single attention module with ContextParallel(module)")
    if not targets:
        raise ValueError(f"context_parallel: {type(model).__name__} contains no self-attention MultiHeadAttention")
    wrapped = [(name, ContextParallel(mod, group=group, layout=layout, backend=backend, timeout=timeout))
               for name, mod in targets]  # validate all before changing anything
    for name, cp in wrapped:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, cp)
    return model
