"""Longformer-style local + global attention, built from the mask algebra.

Pattern (``docs/conventions.md`` positions): key ``j`` is visible to the query at ``p`` iff
``|p - j| <= window`` (local band) or ``p`` or ``j`` is a global position; with ``causal`` also
``j <= p``. It is one :class:`attnzoo.masks.Mask`::

    sliding_window(w, w) | global_tokens(g)            (& causal() when causal)

handed to :func:`attnzoo.attention`, whose tiled backend evaluates it one tile at a time and skips
the tiles it proves empty, so no ``N x N`` tensor is built and no Python loop runs over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_int
from attnzoo.masks import Mask, sliding_window
from attnzoo.masks import causal as causal_mask
from attnzoo.masks import global_tokens as global_mask
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.costs import softmax_cost
from attnzoo.nn.parts import AttentionParts
from attnzoo.nn.positional import RotaryEmbedding
from attnzoo.nn.spec import Cost, CostShape, VariantConfig, VariantSpec, register
from attnzoo.nn.streaming import padding_offsets, rows_from_first_real

__all__ = ["LocalGlobalAttention"]


class LocalGlobalAttention(MultiHeadAttention):
    """Sliding-window attention plus global tokens that attend to, and are attended by, every position.

    Args:
        dim: model width ``C``.
        num_heads: query heads ``H``.
        window: ``w``: a query sees the keys within ``w`` positions on each side (before it only,
            when causal).
        global_tokens: absolute positions of the global tokens (e.g. ``(0,)`` for a CLS token).
        causal: also hide keys after the query (decoding then uses a full :class:`KVCache`,
            since a global query needs every earlier key).
        num_kv_heads, head_dim, bias, rope, dropout, backend, parts: as :class:`MultiHeadAttention`
            (keyword-only; ALiBi, soft cap, sinks... are injected through ``parts``).

    Shapes:
        ``forward(x [B, N, C], *, mask, cache, positions, return_weights) -> [B, N, C]``.
    """

    def __init__(self, dim: int, num_heads: int, window: int, global_tokens: Sequence[int] | Tensor = (0,),
                 causal: bool = False, *, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = True, rope: bool | RotaryEmbedding | None = None, dropout: float = 0.0,
                 backend: str = "auto", parts: AttentionParts | None = None) -> None:
        check_int(window, "window", "LocalGlobalAttention", minimum=0)
        positions = _check_global_tokens(global_tokens)
        super().__init__(dim, num_heads, num_kv_heads, None, head_dim, bias, causal, None, rope, dropout, backend,
                         parts=parts)
        sliding_window(window, window) | global_mask(list(positions))  # validates the positions
        self.local_window = window
        self.global_positions: tuple[int, ...] = positions

    @property
    def pattern(self) -> Mask:
        """The position pattern as one :class:`~attnzoo.masks.Mask` (built on demand: the module
        holds only plain values, so it pickles and deep-copies)."""
        w = self.local_window
        pattern = sliding_window(w, w) | global_mask(list(self.global_positions))
        return pattern & causal_mask() if self.causal else pattern

    def _structure(self) -> Mask | None:
        return self.pattern

    def _merge_structure(self, structure: Mask, mask: Tensor | Mask | None, B: int, N: int, n_k: int,
                         q_offset: int) -> Tensor | Mask:
        offsets = padding_offsets(mask, n_k)
        if offsets is not None:  # left padding: global positions count from each row's first real token
            structure = rows_from_first_real(structure, offsets)
        if mask is None:
            return structure
        if isinstance(mask, Mask):
            return structure & mask
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be None, a bool/float tensor or an attnzoo.masks.Mask, got {type(mask).__name__}")
        if mask.dim() < 2 or mask.dim() > 4:
            raise ValueError(f"LocalGlobalAttention: mask must have rank 2 to 4 and broadcast to [B, H, N, Nk] = "
                             f"{[B, self.num_heads, N, n_k]}, got {tuple(mask.shape)}")
        m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        for got, want, letter in zip(m4.shape, (B, self.num_heads, N, n_k), ("B", "H", "N", "Nk"), strict=True):
            if got not in (1, want):
                raise ValueError(f"LocalGlobalAttention: mask {tuple(mask.shape)} does not broadcast to "
                                 f"{[B, self.num_heads, N, n_k]} (dimension {letter}: got {got}, expected 1 or {want})")
        if mask.dtype == torch.bool:
            return structure & _tensor_mask(m4, q_offset)
        if not mask.is_floating_point():
            raise TypeError(f"mask must be bool (True = attend) or float (additive bias), got dtype {mask.dtype}")
        # An additive bias is dense anyway: materialise the pattern at its size and hide with -inf.
        allowed = structure.materialize(B, 1, N, n_k, q_offset=q_offset, device=mask.device)  # [B, 1, N, Nk]
        return m4.float().masked_fill(~allowed, float("-inf"))

    def _attend_keys(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Mask | None, start: int, first: int,
                     return_weights: bool, *, decoding: bool) -> tuple[Tensor, Tensor | None]:
        """A causal one-token decode step without a user mask or ALiBi attends only to the keys it
        sees: its window ``start - w .. start`` (a view of the cache) and the global keys before it
        (gathered). A global query sees every earlier key: plain attention over the cache, no mask.
        Anything else runs the pattern as a :class:`Mask` (``MultiHeadAttention._attend_keys``)."""
        if not (decoding and self.causal and q.shape[2] == 1 and mask is None and not return_weights
                and not self.alibi and first == 0 and k.shape[2] == start + 1):
            return super()._attend_keys(q, k, v, mask, start, first, return_weights, decoding=decoding)
        lo = 0 if start in self.global_positions else max(0, start - self.local_window)
        before = [g for g in self.global_positions if 0 <= g < lo]  # global keys left of the window
        if before:  # one gather each (few ops: each one is a thread-pool sync on a loaded machine)
            idx = torch.tensor([*before, *range(lo, start + 1)], device=k.device)
            k, v = k.index_select(2, idx), v.index_select(2, idx)  # [B, Hkv, |G| + w + 1, D]
        else:
            k, v = k[:, :, lo:], v[:, :, lo:]  # a view: the window
        return self._core(q, k, v, mask=None, causal=False, window=None, q_offset=k.shape[2] - 1, alibi=None,
                          return_weights=False)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window={self.local_window}, "
                f"global_tokens={self.global_positions}")


def _check_global_tokens(global_tokens: object) -> tuple[int, ...]:
    """``global_tokens`` as a tuple of int positions (a sequence or an int tensor)."""
    if isinstance(global_tokens, Tensor):
        if global_tokens.is_floating_point() or global_tokens.dtype == torch.bool or global_tokens.dim() > 1:
            raise TypeError(f"LocalGlobalAttention: global_tokens must be a 1-D int tensor or a sequence of ints, "
                            f"got a tensor of dtype {global_tokens.dtype} and shape {tuple(global_tokens.shape)}")
        return tuple(int(p) for p in global_tokens.tolist())
    if isinstance(global_tokens, (str, bytes)) or not isinstance(global_tokens, Sequence):
        raise TypeError(f"LocalGlobalAttention: global_tokens must be a sequence of int positions such as (0,), "
                        f"got {type(global_tokens).__name__} ({global_tokens!r})")
    for p in global_tokens:
        if isinstance(p, bool) or not isinstance(p, int):
            raise TypeError(f"LocalGlobalAttention: global_tokens must hold int positions, got "
                            f"{type(p).__name__} ({p!r}) in {tuple(global_tokens)!r}")
    return tuple(global_tokens)


def _tensor_mask(m4: Tensor, q_offset: int) -> Mask:
    """A rank-4 bool tensor ``[B|1, H|1, Nq|1, Nk|1]`` as a :class:`Mask` over absolute positions
    (query row = ``q_pos - q_offset``), so it composes with a pattern without densifying it."""
    sb, sh, sq, sk = m4.shape

    def fn(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        bi = b if sb > 1 else torch.zeros_like(b)
        hi = h if sh > 1 else torch.zeros_like(h)
        qi = (q - q_offset).clamp(0, sq - 1) if sq > 1 else torch.zeros_like(q)
        ki = k.clamp(0, sk - 1) if sk > 1 else torch.zeros_like(k)
        return m4.to(q.device)[bi, hi, qi, ki]

    return Mask(fn, f"tensor{list(m4.shape)}", batch=sb if sb > 1 else None)


# --------------------------------------------------------------------------- variant spec
def _build(dim: int, num_heads: int, *, causal: bool = True, window: int = 64,
           global_tokens: tuple[int, ...] = (0,), **kw: Any) -> nn.Module:
    return build_softmax(LocalGlobalAttention, dim, num_heads, window=window, global_tokens=global_tokens,
                         causal=causal, **kw)


def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    return softmax_cost(cfg, shape)  # a full KV cache: global queries need every earlier key


def _arena(width: int, heads: int, window: int | None) -> dict[str, Any]:
    return {} if window is None else {"window": window}


register(VariantSpec("local_global", "softmax", True, "O(N C^2 + N (W + G) C)", "O(N (W + G)) tiled",
                     "K,V of every token", _build, _cost, defaults={"window": 64, "global_tokens": (0,)},
                     options=("num_kv_heads", "window", "global_tokens"),
                     check={"window": 4, "global_tokens": (0, 9)}, arena=_arena,
                     masks="causal, window, global tokens, padding", order=4, arena_default=True,
                     positions="rope"))
