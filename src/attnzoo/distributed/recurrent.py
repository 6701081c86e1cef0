r"""Context parallelism for recurrent and feature-map mixers: a scan of state summaries over ranks.

A recurrent mixer (RetNet, GLA, DeltaNet, Gated DeltaNet, Mamba-2: :class:`~attnzoo.nn.recurrent.
RecurrentMixer`) maps the state it starts a run of tokens from to the state it ends with by an
*affine* map, for fixed tokens:

.. math::

    S_{\text{out}} = M\,S_{\text{in}} + C, \qquad S \in \mathbb{R}^{D_k \times D_v},\;
    M \in \mathbb{R}^{D_k \times D_k}

(retention / GLA / Mamba-2: ``M`` is the diagonal product of the decays; the delta rule:
``M = prod_t A_t (I - beta_t k_t k_t^T)``; every column of ``S`` goes through the same ``M``).
Each rank computes, for each of its segments of the sequence, ``C`` (the final state from a zero
start) and ``M`` (the final state from an identity-basis start, minus ``C``: one batched run of
the mixer's own kernel with ``1 + ceil(Dk / Dv)`` copies of the batch); the ranks all-gather the
``(M, C)`` pairs and every segment's incoming state is the composition of the maps of the
segments before it (an exclusive scan, a few ``Dk x Dk`` products per rank); then each rank reruns
its segments from their incoming states. The short convolutions' tails (the last ``kernel - 1``
inputs of each segment) are all-gathered first, since the next segment's first outputs read them.
Feature-map attention (linear, Performer) is the special case ``M = I`` with the state ``(S, z)``;
bidirectional feature-map attention sums every segment's state instead.

Packed documents (:func:`attnzoo.distributed.documents`, global ``cu_seqlens``): a segment in
which a document starts (inside it or on its first token) passes on the final state of its last
document from zeros (``M = 0``: the scan restarts there); its later documents run from zeros (one
packed call of the mixer's kernel), and the convolution tail it receives is zeroed before the
start of its first token's document.

Every exchange is differentiable (the backward of an all-gather is an all-reduce of the slot
gradients), so the forward and all gradients equal one process running the whole sequence.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnzoo.distributed.comm import agree, all_gather_grad, require_dist
from attnzoo.distributed.sharding import (
    DOCUMENTS,
    LAYOUTS,
    Segment,
    ShardedMixer,
    check_global_end,
    cu_checksum,
    global_cu_seqlens,
    segments,
)
from attnzoo.functional.recurrent._chunked_scan import compute_dtype
from attnzoo.nn.feature_attention import _FeatureAttention
from attnzoo.nn.recurrent import RecurrentMixer

__all__ = ["ContextParallelRecurrent"]


class _MixerRunner:
    """The three runs of a :class:`RecurrentMixer` on one segment (through its ``_mix`` seam)."""

    def __init__(self, m: RecurrentMixer) -> None:
        self.m = m
        self.tail = m.conv_size - 1 if m.conv_channels else 0
        self.names = sorted(m.conv_channels)

    def tails(self, x: Tensor) -> Tensor | None:
        """The last ``kernel - 1`` inputs of every short convolution, ``[B, sum Ch, kernel - 1]``."""
        if not self.tail:
            return None
        _, _, conv = self.m._mix(x[:, x.shape[1] - self.tail:], None, None, {})
        return torch.cat([conv[k] for k in self.names], dim=1)

    def convs(self, t: Tensor | None) -> dict[str, Tensor]:
        if t is None:
            return {}
        widths = [self.m.conv_channels[k] for k in self.names]
        return dict(zip(self.names, torch.split(t, widths, dim=1), strict=True))

    def summary(self, x: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``(C [B, H, Dk, Dv], M [B, H, Dk, Dk])`` of this segment's affine state map."""
        B = x.shape[0]
        h, dk, dv = self.m.state_shape
        p = math.ceil(dk / dv)
        cdt = compute_dtype(x.dtype)
        eye = torch.zeros(dk, p * dv, dtype=cdt, device=x.device)
        eye[:, :dk] = torch.eye(dk, dtype=cdt, device=x.device)
        probes = [eye[:, j * dv:(j + 1) * dv].expand(B, h, dk, dv) for j in range(p)]
        s0 = torch.cat([torch.zeros(B, h, dk, dv, dtype=cdt, device=x.device), *probes])  # [(1+p)B, H, Dk, Dv]
        conv = {k: t.repeat(1 + p, 1, 1) for k, t in self.convs(prev).items()}
        _, s, _ = self.m._mix(x.repeat(1 + p, 1, 1), None, s0, conv)
        c = s[:B]
        m = torch.cat([s[(1 + j) * B:(2 + j) * B] - c for j in range(p)], dim=-1)[..., :dk]  # [B, H, Dk, Dk]
        return c, m

    def last_state(self, x: Tensor) -> Tensor:
        """The final state of ``x`` run from zeros (a piece that starts a document)."""
        return self.m._mix(x, None, None, {})[1]

    def reset_summary(self, x: Tensor, cut: _Cut) -> tuple[Tensor, Tensor | None]:
        """A segment in which a document starts: ``C`` is its last document's state, ``M = 0``."""
        c = self.last_state(x[:, cut.bounds[-2]:])
        return c, c.new_zeros(*c.shape[:-1], c.shape[-2])

    def run(self, x: Tensor, state: Tensor, prev: Tensor | None, cut: _Cut) -> Tensor:
        """Outputs of a segment entered with ``state`` and the inputs ``prev`` before it; the
        documents of ``cut`` after its first piece start from zeros (one packed call)."""
        if len(cut.bounds) == 2 and not cut.fresh:
            return self.m._mix(x, None, state, self.convs(prev))[0]
        s = len(cut.bounds) - 1
        first = torch.zeros_like(state) if cut.fresh else state  # [1, H, Dk, Dv]
        init = torch.cat([first, first.new_zeros(s - 1, *first.shape[1:])])
        conv = {k: torch.cat([torch.zeros_like(t) if cut.fresh else t, t.new_zeros(s - 1, *t.shape[1:])])
                for k, t in self.convs(prev).items()}
        cu = torch.tensor(cut.bounds, dtype=torch.int32, device=x.device)
        return self.m._mix(x, None, init, conv, cu)[0]


class _FeatureRunner:
    """Feature-map attention on one segment: the state ``(S, z)`` packed as ``[B, H, F, Dv + 1]``."""

    tail = 0

    def __init__(self, m: _FeatureAttention) -> None:
        self.m = m

    def tails(self, x: Tensor) -> Tensor | None:
        return None

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        k, v = self.m.project_kv(x)
        return self.m.project_q(x), k, v

    def summary(self, x: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor | None]:
        q, k, v = self._qkv(x)
        _, (s, z) = self.m._attend(q, k, v, causal=True, state=None, return_state=True, pad=None)
        return torch.cat((s, z[..., None]), dim=-1), None

    def last_state(self, x: Tensor) -> Tensor:
        return self.summary(x, None)[0]

    def reset_summary(self, x: Tensor, cut: _Cut) -> tuple[Tensor, Tensor | None]:
        return self.last_state(x[:, cut.bounds[-2]:]), None

    def _one(self, x: Tensor, state: Tensor, readout: bool) -> Tensor:
        q, k, v = self._qkv(x)
        pad = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device) if readout else None
        out, _ = self.m._attend(q, k, v, causal=True, state=(state[..., :-1], state[..., -1]),
                                return_state=True, pad=pad)
        return self.m.merge_heads(out)

    def run(self, x: Tensor, state: Tensor, prev: Tensor | None, cut: _Cut) -> Tensor:
        """Outputs of a segment entered with ``state``; every document of ``cut`` after its first
        piece starts from zeros (feature-map attention has no packed kernel: one call per piece)."""
        if len(cut.bounds) == 2 and not cut.fresh:
            return self._one(x, state, False)
        outs = [self._one(x[:, lo:hi], torch.zeros_like(state) if j or cut.fresh else state, False)
                for j, (lo, hi) in enumerate(itertools.pairwise(cut.bounds)) if hi > lo]
        return torch.cat(outs, dim=1)

    def doc_sums(self, x: Tensor, cut: _Cut, num_docs: int) -> Tensor:
        """Bidirectional: this segment's state ``(S, z)`` of each global document ``[S_docs, B, H, F, Dv + 1]``."""
        out: list[Tensor | None] = [None] * num_docs
        for (lo, hi), d in zip(itertools.pairwise(cut.bounds), cut.docs, strict=True):
            if hi > lo:
                out[d] = self.last_state(x[:, lo:hi])
        like = next(t for t in out if t is not None)
        return torch.stack([torch.zeros_like(like) if t is None else t for t in out])

    def readout(self, x: Tensor, states: Tensor, cut: _Cut) -> Tensor:
        """Bidirectional: every token reads the whole state of its document (``states [S_docs, ...]``)."""
        outs = [self._one(x[:, lo:hi], states[d], True)
                for (lo, hi), d in zip(itertools.pairwise(cut.bounds), cut.docs, strict=True) if hi > lo]
        return torch.cat(outs, dim=1)


class ContextParallelRecurrent(ShardedMixer):
    """Run a recurrent or feature-map mixer on a sequence sharded over ranks (see the module docstring).

    Args:
        module: a :class:`~attnzoo.nn.recurrent.RecurrentMixer` (retnet, gla, deltanet,
            gated_deltanet, kda, mamba2) or a feature-map attention (linear, performer).
        group: a ProcessGroup or a 1-D DeviceMesh (default: the world).
        layout: ``"contiguous"`` or ``"zigzag"`` (how ``x`` was cut).
        timeout: seconds (or a timedelta) for any network wait.

    Shapes:
        ``forward(x [B, n, C]) -> [B, n, C]``, ``x`` this rank's shard of ``[B, N, C]`` (``B = 1``
        inside :func:`~attnzoo.distributed.documents`); every segment of a shard needs at least
        ``conv_size - 1`` tokens.
    """

    def __init__(self, module: nn.Module, *, group: Any = None, layout: str = "contiguous",
                 timeout: float | timedelta | None = None) -> None:
        cls = type(module).__name__
        runner: _MixerRunner | _FeatureRunner
        if isinstance(module, RecurrentMixer):
            runner = _MixerRunner(module)
        elif isinstance(module, _FeatureAttention):
            if getattr(module, "redraw_interval", None) is not None:
                raise ValueError(f"ContextParallelRecurrent: {cls} redraws its random features every "
                                 f"{module.redraw_interval} training calls (redraw_interval); the ranks' draws "  # type: ignore[attr-defined]
                                 "would diverge. Build it with redraw_interval=None")
            runner = _FeatureRunner(module)
        else:
            raise TypeError(f"ContextParallelRecurrent wraps a recurrent mixer or a feature-map attention, got {cls}")
        super().__init__(module, group, layout, timeout, "ContextParallelRecurrent")
        self._runner = runner

    def forward(self, x: Tensor, *, positions: Tensor | None = None, mask: Any = None, cache: Any = None) -> Tensor:
        """Mix this rank's tokens ``x [B, n, C]`` as part of the whole sharded sequence.

        ``positions`` is accepted and unused (the recurrence has no positions); ``mask`` and
        ``cache`` must be ``None`` (``ValueError``: decode with the unwrapped module). Inside
        :func:`attnzoo.distributed.documents` (``x [1, n, C]``) every document starts from a zero
        state and zero convolution inputs, wherever its boundary falls.
        """
        fn = "ContextParallelRecurrent"
        require_dist(fn)
        del positions
        run, pg, tmo = self._runner, self.group, self.timeout
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        docs = DOCUMENTS.get()
        vals, err = self._local_checks(x, mask, cache, docs)
        same = [0, 2, 3, 4, 5, 6] + ([1] if self.layout == "zigzag" else [])
        rows = agree(pg, vals, err, fn, tmo, same=same, describe=_describe)
        lengths = [int(r[1]) for r in rows]
        cu = None if docs is None else [int(c) for c in docs.tolist()]
        if cu is not None:
            check_global_end(cu, lengths, fn, rank, name="documents' cu_seqlens")
        # every segment of the sequence, in global order: (global_lo, rank, index on that rank)
        order = sorted((s.global_lo, r, i) for r in range(world) for i, s in enumerate(segments(self.layout,
                                                                                              lengths, r)))
        place = {(r, i): g for g, (_, r, i) in enumerate(order)}
        mine = segments(self.layout, lengths, rank)
        cuts = {(r, i): _cut(s, cu) for r in range(world) for i, s in enumerate(segments(self.layout, lengths, r))}
        xs = [x[:, s.local_lo:s.local_lo + s.length] for s in mine]
        if not getattr(self.module, "causal", True):  # bidirectional feature-map attention
            assert isinstance(run, _FeatureRunner)
            num_docs = 1 if cu is None else len(cu) - 1
            sums = all_gather_grad(torch.stack([run.doc_sums(xi, cuts[(rank, i)], num_docs)
                                                for i, xi in enumerate(xs)]), pg, tmo,
                                   f"{fn}: document states")  # [P, segs, S_docs, B, H, F, Dv + 1]
            states = sums.sum(dim=(0, 1))
            y = torch.cat([run.readout(xi, states, cuts[(rank, i)]) for i, xi in enumerate(xs)], dim=1)
            return y
        tie = x.new_zeros(())  # every rank's outputs depend on every gathered tensor (collective backward)
        prev: list[Tensor | None] = [None] * len(mine)
        if run.tail:
            tails = all_gather_grad(torch.stack([run.tails(xi) for xi in xs]), pg, tmo,  # type: ignore[misc]
                                    f"{fn}: short-convolution tails")  # [P, segs, B, Ch, k - 1]
            tie = tie + tails.sum() * 0
            for i, s in enumerate(mine):
                g = place[(rank, i)]
                if g > 0:
                    _, r0, i0 = order[g - 1]
                    prev[i] = _same_document(tails[r0, i0], s.global_lo, cuts[(rank, i)].start)
        summaries = [run.summary(xi, pv) if not cuts[(rank, i)].reset else run.reset_summary(xi, cuts[(rank, i)])
                     for i, (xi, pv) in enumerate(zip(xs, prev, strict=True))]
        # one exchange for C and M together (two would let the ranks' backward passes, whose graphs
        # differ where documents cut the segments, run their all_reduces in different orders)
        c_loc = torch.stack([c if m is None else torch.cat((c, m), dim=-1) for c, m in summaries])
        if run.tail:  # the tails' backward strictly after the summaries' on every rank
            c_loc = c_loc + tails.sum().to(c_loc.dtype) * 0
        both = all_gather_grad(c_loc, pg, tmo, f"{fn}: state summaries")  # [P, segs, B, H, Dk, W (+ Dk)]
        tie = tie + both.sum() * 0
        width = summaries[0][0].shape[-1]
        cs = both[..., :width]
        ms = None if summaries[0][1] is None else both[..., width:]
        resets = [cuts[(r, i)].reset for _, r, i in order]
        outs = [run.run(xi, _incoming(place[(rank, i)], order, cs, ms, resets), prev[i], cuts[(rank, i)])
                for i, xi in enumerate(xs)]
        y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return y + tie.to(y.dtype)

    def _local_checks(self, x: object, mask: Any, cache: Any,
                      docs: Tensor | None) -> tuple[list[float] | None, Exception | None]:
        """This rank's ``[B, n, layout, needs_grad, *cu checksum]`` or its error (reported on every rank by ``agree``)."""
        m, run = self.module, self._runner
        try:
            if mask is not None or cache is not None:
                raise ValueError("mask= and cache= are not supported under context parallelism")
            if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != m.dim:  # type: ignore[operator]
                raise ValueError(f"x must be a tensor [B, n, C] with C = {m.dim}, got "
                                 f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
            n = x.shape[1]
            parts = 2 if self.layout == "zigzag" else 1
            if n % parts or n // parts < max(1, run.tail):
                raise ValueError(f"{type(m).__name__} needs {'two equal chunks of ' if parts == 2 else ''}at least "
                                 f"{max(1, run.tail)} tokens per segment on every rank (its short convolutions "
                                 f"read the previous {run.tail} inputs), got a local length of {n}")
            cu = [0.0, 0.0, 0.0]
            if docs is not None:
                cu = cu_checksum(global_cu_seqlens(docs, "documents"))
                if x.shape[0] != 1:
                    raise ValueError(f"packed documents are one row: x must be [1, n, C], got {tuple(x.shape)}")
            needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in m.parameters()))
            return [x.shape[0], n, LAYOUTS.index(self.layout), float(needs_grad), *cu], None
        except (TypeError, ValueError) as e:
            return None, e

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}"


def _describe(row: list[float]) -> str:
    return (f"B={row[0]:g}, n={row[1]:g}, layout={LAYOUTS[int(row[2])]}, needs_grad={row[3]:g}, "
            f"documents' cu_seqlens (numel, sum, weighted sum)=({row[4]:g}, {row[5]:g}, {row[6]:g})")


@dataclass(frozen=True)
class _Cut:
    """A segment cut by the documents: ``bounds`` are the local boundaries ``[0, .., length]`` of
    its pieces (one document each), ``docs`` the global document of each piece; ``fresh``: a
    document starts at its first token; ``reset``: a document starts at or after its first token
    (the state it passes on does not depend on the state it gets); ``start``: the global position
    where the document of its first token starts."""

    bounds: list[int]
    docs: list[int]
    fresh: bool
    reset: bool
    start: int


def _cut(seg: Segment, cu: list[int] | None) -> _Cut:
    lo, hi = seg.global_lo, seg.global_lo + seg.length
    if cu is None:
        return _Cut([0, seg.length], [0], False, False, 0)
    inner = sorted({b for b in cu if lo < b < hi})
    bounds = [0, *(b - lo for b in inner), seg.length]
    docs = [bisect.bisect_right(cu, lo + b) - 1 for b in bounds[:-1]]
    return _Cut(bounds, docs, lo in cu, lo in cu or bool(inner), max(b for b in cu if b <= lo))


def _same_document(tail: Tensor, lo: int, start: int) -> Tensor:
    """The inputs ``tail [B, Ch, w]`` at positions ``lo - w .. lo - 1``, zeroed before ``start`` (the
    beginning of the document of position ``lo``): a convolution never reads another document."""
    w = tail.shape[-1]
    if lo - w >= start:
        return tail
    keep = torch.arange(lo - w, lo, device=tail.device) >= start
    return tail * keep.to(tail.dtype)


def _incoming(g: int, order: list[tuple[int, int, int]], cs: Tensor, ms: Tensor | None,
              resets: list[bool]) -> Tensor:
    """State entering global segment ``g``: the maps of segments ``0 .. g-1`` composed from zeros
    (a segment in which a document starts passes on its own summary alone)."""
    state = torch.zeros_like(cs[0, 0])
    for h, (_, r, i) in enumerate(order[:g]):
        state = cs[r, i] if resets[h] else cs[r, i] + (state if ms is None else torch.matmul(ms[r, i], state))
    return state
