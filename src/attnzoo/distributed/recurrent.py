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

Every exchange is differentiable (the backward of an all-gather is an all-reduce of the slot
gradients), so the forward and all gradients equal one process running the whole sequence.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnzoo.distributed.comm import agree, all_gather_grad, as_timeout, require_dist, resolve_group
from attnzoo.distributed.sharding import LAYOUTS, check_layout, segments
from attnzoo.functional._chunked_scan import compute_dtype
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

    def run(self, x: Tensor, state: Tensor, prev: Tensor | None) -> Tensor:
        return self.m._mix(x, None, state, self.convs(prev))[0]


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

    def run(self, x: Tensor, state: Tensor, prev: Tensor | None, *, readout: bool = False) -> Tensor:
        """Outputs from ``state``; ``readout``: from the state alone (every local key hidden)."""
        q, k, v = self._qkv(x)
        pad = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device) if readout else None
        out, _ = self.m._attend(q, k, v, causal=True, state=(state[..., :-1], state[..., -1]),
                                return_state=True, pad=pad)
        return self.m.merge_heads(out)


class ContextParallelRecurrent(nn.Module):
    """Run a recurrent or feature-map mixer on a sequence sharded over ranks (see the module docstring).

    Args:
        module: a :class:`~attnzoo.nn.recurrent.RecurrentMixer` (retnet, gla, deltanet,
            gated_deltanet, kda, mamba2) or a feature-map attention (linear, performer).
        group: a ProcessGroup or a 1-D DeviceMesh (default: the world).
        layout: ``"contiguous"`` or ``"zigzag"`` (how ``x`` was cut).
        timeout: seconds (or a timedelta) for any network wait.

    Shapes:
        ``forward(x [B, n, C]) -> [B, n, C]``, ``x`` this rank's shard of ``[B, N, C]``; every
        segment of a shard needs at least ``conv_size - 1`` tokens.
    """

    def __init__(self, module: nn.Module, *, group: Any = None, layout: str = "contiguous",
                 timeout: float | timedelta | None = None) -> None:
        super().__init__()
        cls = type(module).__name__
        if isinstance(module, RecurrentMixer):
            self._runner: _MixerRunner | _FeatureRunner = _MixerRunner(module)
        elif isinstance(module, _FeatureAttention):
            if getattr(module, "redraw_interval", None) is not None:
                raise ValueError(f"ContextParallelRecurrent: {cls} redraws its random features every "
                                 f"{module.redraw_interval} training calls (redraw_interval); the ranks' draws "  # type: ignore[attr-defined]
                                 "would diverge. Build it with redraw_interval=None")
            self._runner = _FeatureRunner(module)
        else:
            raise TypeError(f"ContextParallelRecurrent wraps a recurrent mixer or a feature-map attention, got {cls}")
        self.module = module
        self.group = resolve_group(group, "ContextParallelRecurrent")
        self.layout = check_layout(layout, "ContextParallelRecurrent")
        self.timeout = as_timeout(timeout)

    def forward(self, x: Tensor, *, positions: Tensor | None = None, mask: Any = None, cache: Any = None) -> Tensor:
        """Mix this rank's tokens ``x [B, n, C]`` as part of the whole sharded sequence.

        ``positions`` is accepted and unused (the recurrence has no positions); ``mask`` and
        ``cache`` must be ``None`` (``ValueError``: decode with the unwrapped module).
        """
        fn = "ContextParallelRecurrent"
        require_dist(fn)
        del positions
        m, run = self.module, self._runner
        pg, tmo = self.group, self.timeout
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        vals, err = self._local_checks(x, mask, cache)
        same = [0, 2, 3] + ([1] if self.layout == "zigzag" else [])
        rows = agree(pg, vals, err, fn, tmo, same=same,
                     describe=lambda r: f"B={r[0]:g}, n={r[1]:g}, layout={LAYOUTS[int(r[2])]}, needs_grad={r[3]:g}")
        lengths = [int(r[1]) for r in rows]
        # every segment of the sequence, in global order: (global_lo, rank, index on that rank)
        order = sorted((s.global_lo, r, i) for r in range(world) for i, s in enumerate(segments(self.layout,
                                                                                              lengths, r)))
        place = {(r, i): g for g, (_, r, i) in enumerate(order)}
        mine = segments(self.layout, lengths, rank)
        xs = [x[:, s.local_lo:s.local_lo + s.length] for s in mine]
        tie = x.new_zeros(())  # every rank's outputs depend on every gathered tensor (collective backward)
        prev: list[Tensor | None] = [None] * len(mine)
        if run.tail:
            tails = all_gather_grad(torch.stack([run.tails(xi) for xi in xs]), pg, tmo,  # type: ignore[misc]
                                    f"{fn}: short-convolution tails")  # [P, segs, B, Ch, k - 1]
            tie = tie + tails.sum() * 0
            for i in range(len(mine)):
                g = place[(rank, i)]
                if g > 0:
                    _, r0, i0 = order[g - 1]
                    prev[i] = tails[r0, i0]
        summaries = [run.summary(xi, pv) for xi, pv in zip(xs, prev, strict=True)]
        c_loc = torch.stack([c for c, _ in summaries])  # [segs, B, H, Dk, W]
        cs = all_gather_grad(c_loc, pg, tmo, f"{fn}: state summaries")  # [P, segs, B, H, Dk, W]
        tie = tie + cs.sum() * 0
        ms = None
        if summaries[0][1] is not None:
            ms = all_gather_grad(torch.stack([mm for _, mm in summaries]), pg, tmo,  # type: ignore[misc]
                                 f"{fn}: state transition maps")  # [P, segs, B, H, Dk, Dk]
            tie = tie + ms.sum() * 0
        causal = getattr(m, "causal", True)
        outs = []
        for i, xi in enumerate(xs):
            if not causal:  # bidirectional feature-map attention: every key of every segment
                assert isinstance(run, _FeatureRunner)
                outs.append(run.run(xi, cs.sum(dim=(0, 1)), None, readout=True))
                continue
            outs.append(run.run(xi, _incoming(place[(rank, i)], order, cs, ms), prev[i]))
        y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return y + tie.to(y.dtype)

    def _local_checks(self, x: object, mask: Any, cache: Any) -> tuple[list[float] | None, Exception | None]:
        """This rank's ``[B, n, layout, needs_grad]`` or its error (reported on every rank by ``agree``)."""
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
            needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in m.parameters()))
            return [x.shape[0], n, LAYOUTS.index(self.layout), float(needs_grad)], None
        except (TypeError, ValueError) as e:
            return None, e

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}"


def _incoming(g: int, order: list[tuple[int, int, int]], cs: Tensor, ms: Tensor | None) -> Tensor:
    """State entering global segment ``g``: the maps of segments ``0 .. g-1`` composed from zeros."""
    state = torch.zeros_like(cs[0, 0])
    for _, r, i in order[:g]:
        state = cs[r, i] + (state if ms is None else torch.matmul(ms[r, i], state))
    return state
