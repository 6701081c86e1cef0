"""Query / key LayerNorms per head, before RoPE: one weight shared by the heads (Phi, Persimmon)
or one row per head (StableLM's ``qk_layernorm``, Command R's ``use_qk_norm``), as a
:class:`~attnzoo.MultiHeadAttention` subclass the families build (``neox.py``, ``dense.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.parts import AttentionParts
from attnzoo.nn.positional import RotaryEmbedding, resolve_positions

__all__ = ["HeadLayerNorm", "LayerNormQKAttention", "QKLayerNorm"]


class HeadLayerNorm(nn.Module):
    """A LayerNorm over the channels ``D`` of every head of ``t [B, h, N, D]``: one ``weight [D]`` (and
    ``bias [D]``) shared by the heads (Phi's and Persimmon's ``q_layernorm`` / ``k_layernorm``), or one
    row per head, ``weight [h, D]`` (StableLM's ``StableLmLayerNormPerHead``, bias-free).
    Shapes: ``[B, h, N, D] -> [B, h, N, D]``."""

    def __init__(self, head_dim: int, heads: int | None = None, *, eps: float = 1e-5, bias: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        shape = (head_dim,) if heads is None else (heads, head_dim)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.head_dim, self.eps = int(head_dim), float(eps)
        self.weight = nn.Parameter(torch.ones(shape, **kw))
        self.bias = nn.Parameter(torch.zeros(shape, **kw)) if bias else None

    def forward(self, t: Tensor) -> Tensor:
        if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[-1] != self.head_dim or (
                self.weight.dim() == 2 and t.shape[1] != self.weight.shape[0]):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"HeadLayerNorm: t must be [B, h, N, {self.head_dim}]"
                             f"{'' if self.weight.dim() == 1 else f' with h={self.weight.shape[0]}'}, got {got}")
        if self.weight.dim() == 1:
            return F.layer_norm(t, (self.head_dim,), self.weight, self.bias, self.eps)
        out = F.layer_norm(t, (self.head_dim,), eps=self.eps) * self.weight[:, None, :]  # [B, h, N, D]
        return out if self.bias is None else out + self.bias[:, None, :]

    def extra_repr(self) -> str:
        heads = "shared" if self.weight.dim() == 1 else f"{self.weight.shape[0]} heads"
        return f"{self.head_dim}, {heads}, eps={self.eps:g}, bias={self.bias is not None}"


@dataclass(frozen=True)
class QKLayerNorm:
    """How a :class:`LayerNormQKAttention` normalises its query and key heads: ``per_head`` weights
    (StableLM) or one shared LayerNorm (Phi, Persimmon), with ``bias``, epsilon ``eps``."""

    per_head: bool
    bias: bool
    eps: float


class LayerNormQKAttention(MultiHeadAttention):
    """:class:`~attnzoo.MultiHeadAttention` whose query and key heads pass a LayerNorm
    (:class:`HeadLayerNorm`, ``q_layernorm`` / ``k_layernorm``) before RoPE: Phi's and Persimmon's
    ``qk_layernorm`` (``modeling_phi.py`` 171-176, 212-214), StableLM's per-head norms
    (``modeling_stablelm.py`` 156-168). ``qk_layernorm``: a :class:`QKLayerNorm`; the other
    arguments as :class:`~attnzoo.MultiHeadAttention`'s.

    Shapes: as :class:`~attnzoo.MultiHeadAttention` (``x [B, N, C] -> [B, N, C]``; packed
    ``[1, T, C]`` with ``cu_seqlens``)."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = True, causal: bool = True, window: int | None = None, rope: RotaryEmbedding | None = None,
                 dropout: float = 0.0, *, parts: AttentionParts | None = None, qk_layernorm: QKLayerNorm) -> None:
        super().__init__(dim, num_heads, num_kv_heads, head_dim=head_dim, bias=bias, causal=causal, window=window,
                         rope=rope, dropout=dropout, parts=parts)
        s, D = qk_layernorm, self.head_dim
        self.q_layernorm = HeadLayerNorm(D, self.num_heads if s.per_head else None, eps=s.eps, bias=s.bias)
        self.k_layernorm = HeadLayerNorm(D, self.num_kv_heads if s.per_head else None, eps=s.eps, bias=s.bias)

    def project_qkv(self, x: Tensor, source: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, N, D]``, ``k, v [B, Hkv, N, D]``, the q and k heads normed (not rotated)."""
        q, k, v = super().project_qkv(x, source)
        return self.q_layernorm(q), self.k_layernorm(k), v

    def _project_self(self, x: Tensor, positions: Tensor | None, start: int, *,
                      rotate: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, N, D]``, ``k, v [B, Hkv, N, D]`` of ``x``'s tokens at ``start ..``: normed, then
        rotated at ``positions`` when ``rotate``."""
        q, k, v = self.project_qkv(x)
        if rotate and self.rope is not None:
            pos = resolve_positions(positions, x.shape[1], start, x.device, batch=x.shape[0])
            q, k = self._rotate(q, pos), self._rotate(k, pos)
        return q, k, v
