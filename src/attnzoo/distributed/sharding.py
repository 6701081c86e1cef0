"""Sequence layouts: which global positions every rank holds, and cutting/gathering sequences.

``"contiguous"``: rank ``r`` holds one run of positions, split like ``torch.tensor_split``.
``"zigzag"``: the sequence is cut into ``2P`` chunks and rank ``r`` holds chunks ``r`` and
``2P - 1 - r`` (equal causal work on every rank). See :mod:`attnzoo.distributed`.
"""

from __future__ import annotations

import contextvars
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnzoo._validate import Window, check_choice, check_cu_seqlens, check_int
from attnzoo.distributed.comm import (
    agree,
    as_timeout,
    rank_and_size,
    require_dist,
    resolve_group,
    wait,
)

__all__ = [
    "DOCUMENTS",
    "LAYOUTS",
    "Segment",
    "document_ids",
    "gather_sequence",
    "global_cu_seqlens",
    "segments",
    "shard_positions",
    "shard_sequence",
]

#: Sequence layouts understood by every function of this package.
LAYOUTS = ("contiguous", "zigzag")
#: The dtypes of a sharded attention call, by index in the cross-rank comparison.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


#: The *global* document boundaries ``cu_seqlens [S+1]`` set by
#: :func:`attnzoo.distributed.documents` for the context-parallel modules (``None``: one document).
DOCUMENTS: contextvars.ContextVar[Tensor | None] = contextvars.ContextVar("attnzoo_cp_documents", default=None)


def check_layout(layout: object, fn: str) -> str:
    return check_choice(layout, "layout", fn, choices=LAYOUTS)


@dataclass(frozen=True)
class Segment:
    """A run of ``length`` tokens stored at ``local_lo ..`` in a shard, at ``global_lo ..`` in the sequence."""

    local_lo: int
    length: int
    global_lo: int


def contiguous_lengths(seq_len: int, world_size: int) -> list[int]:
    base, extra = divmod(seq_len, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def segments(layout: str, lengths: Sequence[int], rank: int) -> list[Segment]:
    """The runs of global positions held by ``rank`` given every rank's shard length."""
    if layout == "contiguous":
        return [Segment(0, lengths[rank], sum(lengths[:rank]))]
    p = len(lengths)
    c = lengths[rank] // 2
    return [Segment(0, c, rank * c), Segment(c, c, (2 * p - 1 - rank) * c)]


def global_cu_seqlens(cu_seqlens: object, fn: str) -> Tensor:
    """A *global* ``cu_seqlens`` (any int dtype, from 0, never decreasing; its end, the global length, is
    checked once every rank's shard length is known) as an int64 CPU tensor."""
    return check_cu_seqlens(cu_seqlens, owner=fn, int32=False).long().cpu()


#: The scores of :func:`ring_attention` / :func:`ulysses_attention`.
SCORES = ("softmax", "sigmoid")


def _fingerprint(text: str) -> float:
    """48 bits of a digest of ``text``, exact in a float64 and the same in every process."""
    return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "big"))


def check_score(score: object, bias: object, sinks: object, score_mod: object = None, mask: object = None
                ) -> list[float]:
    """Validate ``score`` / sigmoid ``bias`` (``sinks`` need a softmax) and encode them for the
    cross-rank comparison: ``[is sigmoid, bias or 0, a checksum of the sink logits (0: none),
    a score_mod given, a checksum of the Mask's name (0: none)]`` (a callable cannot be compared
    across processes, so only its presence is; a Mask is compared by its printed expression)."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if score == "sigmoid" and sinks is not None:
        raise ValueError("score='sigmoid' has no normaliser: sinks must be None")
    if bias is not None and score != "sigmoid":
        raise ValueError(f"bias applies to score='sigmoid' only, got score={score!r}")
    if bias is not None and (isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias)):
        raise ValueError(f"bias must be a finite float or None (default -log(N) of the whole sequence), got {bias!r}")
    sink_chk = head_values_checksum(sinks, sinks.numel()) if isinstance(sinks, Tensor) else 0.0
    mask_chk = 0.0 if mask is None else 1.0 + _fingerprint(str(getattr(mask, "name", type(mask).__name__)))
    return [float(score == "sigmoid"), 0.0 if bias is None else float(bias), sink_chk, float(score_mod is not None),
            mask_chk]


def cu_checksum(cu: Tensor) -> list[float]:
    """Three numbers that differ when two ranks pass different ``cu_seqlens`` (length, sum, weighted sum)."""
    w = torch.arange(1, cu.numel() + 1, dtype=torch.float64)
    return [float(cu.numel()), float(cu.double().sum()), float((cu.double() * w).sum())]


def document_ids(cu: Tensor, seq_len: int, device: torch.device | None = None) -> Tensor:
    """Document index of every global position ``[N]`` (int64) from ``cu_seqlens [S+1]``."""
    t = torch.arange(seq_len)
    return torch.searchsorted(cu.long().cpu()[1:], t, right=True).to(device)


def check_local_shards(q: Tensor, k: Tensor, layout: str) -> None:
    """This rank's ``q`` and ``k`` shards hold the same positions (the same local length), at least one
    token, and an even length under the zigzag layout (two equal chunks)."""
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k are shards of the same positions, so they need the same local length, got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[2] == 0:
        raise ValueError(f"every rank needs at least one token, got q {tuple(q.shape)}")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank, so the local length must be even, "
                         f"got q {tuple(q.shape)}")


def window_and_scale(win: Window | None, scale: float | None, head_dim: int) -> list[float]:
    """``[left, right, scale]`` for the cross-rank comparison: ``-1`` for an unbounded side, ``-2`` for
    both without a window; the scale defaults to ``1 / sqrt(head_dim)``."""
    sides = [-2.0, -2.0] if win is None else [-1.0 if w is None else float(w) for w in win]
    return [*sides, 1.0 / math.sqrt(head_dim) if scale is None else float(scale)]


def head_values_checksum(slopes: Tensor | None, num_heads: int) -> float:
    """A per-head tensor (ALiBi slopes, sink logits) for the cross-rank comparison: ``1 +`` a digest of
    its ``num_heads`` values (``0`` without one). A weighted sum let ``[1, -0.5]`` and ``[3, -1.5]``
    agree."""
    if slopes is None:
        return 0.0
    return 1.0 + _fingerprint(str(slopes.detach().double().cpu().reshape(num_heads).tolist()))


def check_global_end(cu: Tensor | Sequence[int], lengths: Sequence[int], fn: str, rank: int, *,
                     name: str = "cu_seqlens") -> None:
    """``ValueError`` unless the global ``cu`` ends at the global length, the sum of every rank's shard
    ``lengths``. Every rank holds the same ``cu`` and lengths, so every rank raises together."""
    total = sum(lengths)
    got = cu.tolist() if isinstance(cu, Tensor) else list(cu)
    if int(got[-1]) != total:
        raise ValueError(f"{fn} on rank {rank}: {name} must end at the global length {total} "
                         f"(the sum of the shards {list(lengths)}), got {got}")


def global_document_ids(cu: Tensor, lengths: Sequence[int], fn: str, rank: int,
                        device: torch.device | None = None) -> Tensor:
    """:func:`document_ids` of the whole sequence, once :func:`check_global_end` holds."""
    check_global_end(cu, lengths, fn, rank)
    return document_ids(cu, sum(lengths), device)


def positions_of(layout: str, lengths: Sequence[int], rank: int, device: torch.device | None = None) -> Tensor:
    """Global positions held by ``rank`` (in local order) given every rank's shard length."""
    return torch.cat([torch.arange(s.global_lo, s.global_lo + s.length, device=device)
                      for s in segments(layout, lengths, rank)])


def check_seq_len(seq_len: int, world_size: int, layout: str, fn: str) -> None:
    check_int(seq_len, "seq_len", fn, minimum=None)
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
    layout = check_layout(layout, fn)
    r, p = rank_and_size(group, rank, world_size, fn)
    check_seq_len(seq_len, p, layout, fn)
    lengths = contiguous_lengths(seq_len, p) if layout == "contiguous" else [seq_len // p] * p
    parts = [torch.arange(s.global_lo, s.global_lo + s.length, device=device) for s in segments(layout, lengths, r)]
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
    if isinstance(dim, bool) or not isinstance(dim, int) or x.dim() == 0 or not -x.dim() <= dim < x.dim():
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
        # the shards must agree on everything but their length: a mismatch made gloo abort the
        # process, or read another dtype's bytes when the sizes happened to match
        others = [s for i, s in enumerate(x.shape) if i != dim]
        vals = [x.shape[dim], _fingerprint(str(x.dtype)), x.dim(), dim, *others]
        names = ("length", "dtype", "ndim", "dim", *(f"size of dim {i}" for i in range(x.dim()) if i != dim))
        rows = agree(group, vals, None, "gather_sequence", timeout, same=range(1, len(vals)), names=names,
                     describe=lambda r: f"{int(r[0])} positions along dim {int(r[3])}, other sizes "
                                        f"{[int(v) for v in r[4:]]}")
        lengths = [int(r[0]) for r in rows]
        if layout == "zigzag" and (len(set(lengths)) != 1 or lengths[0] % 2):
            raise ValueError(f"gather_sequence: the zigzag layout needs equal, even shard lengths on every "
                             f"rank, got {lengths}")
        n_max = max(lengths)
        shape = list(x.shape)
        shape[dim] = n_max
        padded = x.new_zeros(shape)
        padded.narrow(dim, 0, x.shape[dim]).copy_(x)
        bufs = [torch.empty_like(padded) for _ in range(size)]
        wait(dist.all_gather(bufs, padded, group=group, async_op=True), timeout, rank,
              "gather_sequence: the all_gather of shards")
        pieces = [b.narrow(dim, 0, n) for b, n in zip(bufs, lengths, strict=True)]
        pos = torch.cat([torch.arange(s.global_lo, s.global_lo + s.length, device=x.device)
                         for r in range(size) for s in segments(layout, lengths, r)])
        full = torch.cat(pieces, dim=dim).index_select(dim, torch.argsort(pos))
        ctx.dim, ctx.group, ctx.timeout = dim, group, timeout
        ctx.my_pos = torch.cat([torch.arange(s.global_lo, s.global_lo + s.length, device=x.device)
                                for s in segments(layout, lengths, rank)])
        return full

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        g = grad.contiguous().clone()
        wait(dist.all_reduce(g, group=ctx.group, async_op=True), ctx.timeout, dist.get_rank(ctx.group),
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
    require_dist(fn)
    layout = check_layout(layout, fn)
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{fn}: dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    out = _GatherSequence.apply(x, dim % x.dim(), group, layout, as_timeout(timeout))
    assert isinstance(out, Tensor)
    return out


class ShardedMixer(nn.Module):
    """What every context-parallel wrapper holds: the wrapped ``module``, the process ``group`` it
    shards over (resolved from a ProcessGroup or DeviceMesh), the ``layout`` of the shards and the
    ``timeout`` of a network wait; ``owner`` names the wrapper in errors."""

    def __init__(self, module: nn.Module, group: Any, layout: str, timeout: float | timedelta | None,
                 owner: str) -> None:
        super().__init__()
        self.module = module
        self.group = resolve_group(group, owner)
        self.layout = check_layout(layout, owner)
        self.timeout = as_timeout(timeout)
