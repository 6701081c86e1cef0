"""Token mixers side by side: ``y = mixer_1(x) + mixer_2(x) + ...`` on the same input.

Falcon-H1's layers run a Mamba-2 mixer and attention in parallel on the normed input and add
their outputs (Hymba does the same with attention and SSM heads). :class:`ParallelMixers` is that
sum as one mixer, so a :class:`~attnzoo.TransformerBlock` holds it where it would hold one
attention module::

    mixer = ParallelMixers([Mamba2(512, 8), MultiHeadAttention(512, 8, causal=True, rope=True)])
    block = TransformerBlock(512, layers=BlockLayers(attention=lambda: mixer, feed_forward=..., norm=...))

It follows the attention protocol of its parts: ``mask`` (a key-padding ``Mask`` or tensor),
``cache`` (a :class:`ParallelCache` holding every part's cache), ``positions`` (for the parts with
rotary embeddings) and ``cu_seqlens`` (packed sequences: each part's fused path, or one sequence at
a time) are passed to every part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.masks import Mask
from attnzoo.nn.cache import CacheList
from attnzoo.nn.packing import run_packed

__all__ = ["ParallelCache", "ParallelMixers"]


class ParallelCache(CacheList):
    """The decode cache of a :class:`ParallelMixers`: one cache per part (in the parts' order),
    with the cache protocol (``length``, ``batch_size``, ``reset()``, ``mark()``/``rollback()``/
    ``commit()`` over every part)."""

    def __repr__(self) -> str:
        return f"ParallelCache(parts={[type(c).__name__ for c in self.layers]}, length={self.length})"


class ParallelMixers(nn.Module):
    """Token mixers on the same input, outputs summed: ``[B, N, C] -> [B, N, C]``.

    Args:
        mixers: two or more modules, each ``[B, N, C] -> [B, N, C]`` following the attention protocol
            (``forward(x, *, mask=, cache=, positions=)``, ``init_cache``); scale factors of a family
            (Falcon-H1's ``ssm_out_multiplier``, ...) belong in the parts' weights.

    Decode cache: :class:`ParallelCache` (every part's own cache).
    """

    def __init__(self, mixers: Sequence[nn.Module]) -> None:
        super().__init__()
        if isinstance(mixers, nn.Module) or not isinstance(mixers, Sequence):
            raise TypeError(f"ParallelMixers: mixers must be a sequence of modules, got {type(mixers).__name__}")
        bad = [type(m).__name__ for m in mixers if not isinstance(m, nn.Module)]
        if bad:
            raise TypeError(f"ParallelMixers: every mixer must be an nn.Module, got {bad}")
        if len(mixers) < 2:
            raise ValueError(f"ParallelMixers: need at least 2 mixers, got {len(mixers)}")
        self.mixers = nn.ModuleList(mixers)
        self.num_heads = next((m.num_heads for m in mixers if isinstance(getattr(m, "num_heads", None), int)), None)

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> ParallelCache:
        """Every part's decode cache (see each part's ``init_cache``)."""
        return ParallelCache([m.init_cache(batch_size, max_len, device=device, dtype=dtype)  # type: ignore[operator]
                              for m in self.mixers])

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,
                cache: ParallelCache | None = None, positions: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """``sum_i mixers[i](x)``: ``x [B, N, C]`` (with a cache: the new tokens only; with
        ``cu_seqlens``: packed ``[1, T, C]``) -> ``[B, N, C]``."""
        if context is not None:
            raise ValueError("ParallelMixers: self-mixing only; context must be None")
        if cache is not None and (not isinstance(cache, ParallelCache) or len(cache) != len(self.mixers)):
            raise TypeError(f"ParallelMixers: cache must come from init_cache ({len(self.mixers)} parts), "
                            f"got {type(cache).__name__}")
        out: Tensor | None = None
        for i, mixer in enumerate(self.mixers):
            if cu_seqlens is not None:
                y = run_packed(mixer, x, cu_seqlens)
            else:
                kw: dict[str, Any] = {}
                if mask is not None:
                    kw["mask"] = mask
                if cache is not None:
                    kw["cache"] = cache[i]
                if positions is not None:
                    kw["positions"] = positions
                y = mixer(x, **kw)
            out = y if out is None else out + y
        assert out is not None  # at least two mixers
        return out

    def extra_repr(self) -> str:
        return f"parts={len(self.mixers)}"
