"""Context parallelism for attention modules: :class:`ContextParallel` runs a self-attention
:class:`~attnzoo.MultiHeadAttention` on a sequence sharded over ranks through :func:`ring_attention`."""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnzoo.distributed.comm import as_timeout, require_dist, wait
from attnzoo.distributed.ring import ring_attention
from attnzoo.distributed.sharding import check_layout, segments
from attnzoo.nn.attention import MultiHeadAttention

__all__ = ["ContextParallel", "context_parallel"]


def _all_lengths(n: int, group: Any, device: torch.device, timeout: timedelta | None) -> list[int]:
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    bufs = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(bufs, mine, group=group, async_op=True), timeout, dist.get_rank(group),
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
        self.layout = check_layout(layout, "ContextParallel")
        if not isinstance(backend, str):
            raise TypeError(f"ContextParallel: backend must be a str, got {type(backend).__name__}")
        self.backend = backend
        self.timeout = as_timeout(timeout)

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
        require_dist("ContextParallel")
        m = self.module
        if mask is not None or cache is not None:
            raise ValueError("ContextParallel: mask= and cache= are not supported (ring attention uses the "
                             "module's causal/window; decode with the unwrapped module)")
        if not isinstance(x, Tensor):
            raise TypeError(f"ContextParallel: x must be a tensor [B, n, C], got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != m.dim:
            raise ValueError(f"ContextParallel: x must have shape [B, n, C] with C = {m.dim}, got {tuple(x.shape)}")
        B, n, _ = x.shape
        if m.rope is not None:
            if positions is None:
                lengths = _all_lengths(n, self.group, x.device, self.timeout)
                rank = dist.get_rank(self.group)
                positions = torch.cat([torch.arange(s.global_lo, s.global_lo + s.length, device=x.device)
                                       for s in segments(self.layout, lengths, rank)])
            elif (not isinstance(positions, Tensor) or tuple(positions.shape) not in ((n,), (B, n))
                  or positions.is_floating_point()):
                raise ValueError(f"ContextParallel: positions must be an int tensor [n] = [{n}] or [B, n] = "
                                 f"[{B}, {n}], got "
                                 f"{positions if not isinstance(positions, Tensor) else tuple(positions.shape)}")
        # The module runs its own forward; only its attend seam is pointed at the ring for this call.
        ring = functools.partial(_ring_attend, group=self.group, layout=self.layout, ring_backend=self.backend,
                                 timeout=self.timeout)
        saved, m.attend_fn = m.attend_fn, ring
        try:
            return m(x, positions=positions)  # [B, n, C]
        finally:
            m.attend_fn = saved


def _ring_attend(q: Tensor, k: Tensor, v: Tensor, *, group: Any, layout: str, ring_backend: str,
                 timeout: timedelta | None, mask: Any = None, causal: bool = False, window: Any = None,
                 scale: float | None = None, softcap: float | None = None, alibi_slopes: Tensor | None = None,
                 dropout_p: float = 0.0, return_weights: bool = False, q_offset: int | None = None,
                 backend: str = "auto", sinks: Tensor | None = None) -> Tensor:
    """The attend seam of a module under :class:`ContextParallel`: ``az.attention``'s keywords in,
    :func:`ring_attention` over the group out (``q_offset`` is ignored: the ring places every
    shard at its global positions from ``layout``)."""
    del q_offset, backend  # the ring places shards by layout; each pair runs on ring_backend
    if mask is not None or return_weights or dropout_p:
        raise ValueError("ContextParallel: masks, return_weights and attention dropout are not supported by "
                         "ring attention")
    out = ring_attention(q, k, v, group=group, causal=causal, window=window, scale=scale, softcap=softcap,
                         alibi_slopes=alibi_slopes, layout=layout, backend=ring_backend, timeout=timeout,
                         sinks=sinks)
    assert isinstance(out, Tensor)
    return out


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
