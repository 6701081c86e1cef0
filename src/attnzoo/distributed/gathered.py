"""The context-parallel fallback for a mixer that has no sharded form: gather, run, keep your rows.

Native sparse attention ranks blocks of the whole sequence per query, and Infini-attention reads
and writes a compressive memory segment by segment; neither splits into per-rank pieces that a
ring or a state scan could combine. :class:`ContextParallelGathered` runs such a mixer exactly
inside a context-parallel model: every rank all-gathers the tokens of the whole sequence
(differentiably), puts them in global order, runs the unchanged module on them and keeps the
outputs of its own positions. Forward and gradients equal one process running the whole sequence
(the backward of the gather sums every rank's share into the shard it came from); what it gives
up is the saving: that one mixer holds and computes the whole sequence on every rank.
:func:`~attnzoo.distributed.context_parallel` uses it only where nothing sharded applies.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.distributed.comm import agree, all_gather_grad, require_dist, wait
from attnzoo.distributed.sharding import (
    DOCUMENTS,
    LAYOUTS,
    ShardedMixer,
    check_global_end,
    cu_checksum,
    global_cu_seqlens,
    positions_of,
)

__all__ = ["ContextParallelGathered"]


class ContextParallelGathered(ShardedMixer):
    """Run ``module`` on the whole sequence gathered from its shards; return this rank's rows.

    Args:
        module: a self-attention mixer taking ``x [B, N, C]`` (and ``positions=``), e.g.
            :class:`~attnzoo.NativeSparseAttention` or :class:`~attnzoo.InfiniAttention`.
        group: a ProcessGroup or a 1-D DeviceMesh (default: the world).
        layout: ``"contiguous"`` or ``"zigzag"``: how the sequence was cut (:func:`shard_sequence`).
        timeout: seconds (or a timedelta) for any single network wait.

    Shapes:
        ``forward(x [B, n, C]) -> [B, n, C]`` where ``x`` is this rank's shard of ``[B, N, C]``;
        the module sees ``[B, N, C]`` (activation memory of the whole sequence for this mixer).
    """

    def __init__(self, module: nn.Module, *, group: Any = None, layout: str = "contiguous",
                 timeout: float | timedelta | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ContextParallelGathered: module must be an nn.Module, got {type(module).__name__}")
        super().__init__(module, group, layout, timeout, "ContextParallelGathered")

    def forward(self, x: Tensor, *, positions: Tensor | None = None, mask: Any = None, cache: Any = None) -> Tensor:
        """Mix this rank's tokens ``x [B, n, C]`` as part of the whole sharded sequence.

        ``positions`` (int ``[n]`` or ``[B, n]``, the local tokens' positions) are gathered with the
        tokens and passed on; without them the module numbers the whole sequence from 0 as in one
        process. Inside :func:`attnzoo.distributed.documents` (``x [1, n, C]``) the module runs once
        per document (positions restart there, as packed input does). ``mask`` and ``cache`` must be
        ``None``. A bad input on one rank is a ``ValueError`` on every rank (no rank waits).
        """
        fn = "ContextParallelGathered"
        require_dist(fn)
        docs = DOCUMENTS.get()
        vals, err = self._local_checks(x, positions, mask, cache, docs)
        same = [0, 2, 3, 4, 5, 6, 7]  # B, C, positions given, layout, the documents' checksum
        rows = agree(self.group, vals, err, fn, self.timeout, same=same)
        lengths = [int(r[1]) for r in rows]
        cu = None if docs is None else global_cu_seqlens(docs, "documents")
        if cu is not None:
            check_global_end(cu, lengths, fn, dist.get_rank(self.group), name="documents' cu_seqlens")
        B, n, _ = x.shape
        order = torch.cat([positions_of(self.layout, lengths, r) for r in range(len(lengths))]).to(x.device)
        to_global = torch.argsort(order)  # rank-order index -> global order
        every = all_gather_grad(F.pad(x, (0, 0, 0, max(lengths) - n)), self.group, self.timeout,
                                f"{fn}: the tokens")  # [P, B, n_max, C]
        xs = torch.cat([every[r, :, :ln] for r, ln in enumerate(lengths)], dim=1)[:, to_global]  # [B, N, C]
        pos = None if positions is None else self._gather_positions(positions.expand(B, n), lengths)[:, to_global]
        y = self._run(xs, pos, None if cu is None else [int(c) for c in cu.tolist()])  # [B, N, C]
        return y[:, positions_of(self.layout, lengths, dist.get_rank(self.group), device=x.device)]  # [B, n, C]

    def _local_checks(self, x: object, positions: object, mask: Any, cache: Any,
                      docs: Tensor | None) -> tuple[list[float] | None, Exception | None]:
        """This rank's ``[B, n, C, positions given, layout, *documents' checksum]`` or its error."""
        try:
            if mask is not None or cache is not None:
                raise ValueError("mask= and cache= are not supported (documents come from "
                                 "attnzoo.distributed.documents; decode with the unwrapped module)")
            if not isinstance(x, Tensor) or x.dim() != 3:
                raise ValueError(f"x must be a tensor [B, n, C], got "
                                 f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
            B, n, C = x.shape
            if positions is not None and (not isinstance(positions, Tensor) or positions.is_floating_point()
                                          or tuple(positions.shape) not in ((n,), (B, n))):
                raise ValueError(f"positions must be an int tensor [n] = [{n}] or [B, n] = [{B}, {n}], got "
                                 f"{tuple(positions.shape) if isinstance(positions, Tensor) else positions!r}")
            cu = [0.0, 0.0, 0.0]
            if docs is not None:
                cu = cu_checksum(global_cu_seqlens(docs, "documents"))
                if B != 1:
                    raise ValueError(f"packed documents are one row: x must be [1, n, C], got {tuple(x.shape)}")
            return [B, n, C, float(positions is not None), LAYOUTS.index(self.layout), *cu], None
        except (TypeError, ValueError) as e:
            return None, e

    def _run(self, xs: Tensor, pos: Tensor | None, cu: list[int] | None) -> Tensor:
        """The module on the whole sequence ``xs [B, N, C]``, once per document when ``cu`` is given."""
        if cu is None:
            return self.module(xs) if pos is None else self.module(xs, positions=pos)
        outs = [self.module(xs[:, a:b]) if pos is None else self.module(xs[:, a:b], positions=pos[:, a:b])
                for a, b in itertools.pairwise(cu) if b > a]
        return torch.cat(outs, dim=1)  # [1, N, C]

    def _gather_positions(self, positions: Tensor, lengths: list[int]) -> Tensor:
        """``positions [B, n]`` of every rank, concatenated in rank order: ``[B, N]``."""
        padded = F.pad(positions.long(), (0, max(lengths) - positions.shape[1]))
        bufs = [torch.zeros_like(padded) for _ in lengths]
        wait(dist.all_gather(bufs, padded, group=self.group, async_op=True), self.timeout,
             dist.get_rank(self.group), "ContextParallelGathered: the all_gather of positions")
        return torch.cat([b[:, :ln] for b, ln in zip(bufs, lengths, strict=True)], dim=1)

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}, gathered: the whole sequence on every rank"
