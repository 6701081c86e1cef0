"""Differential attention (DIFF Transformer, Ye et al., 2024): the difference of two softmax maps.

Per differential head ``h`` (``H`` of them), with ``d`` the half head width::

    [Q1; Q2] = x W_Q  (2 heads of d),   [K1; K2] = x W_K,   V = x W_V  (2d)
    A_i = softmax(Q_i K_i^T / sqrt(d))                       (causal)
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init
    head_h = (1 - lambda_init) * RMSNorm_2d(A_1 V - lambda A_2 V)
    out = out_proj(concat_h head_h)

with ``lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))`` for the ``l``-th layer (``l = layer_index + 1``).
Each map is one :func:`attnzoo.attention` call through the attend seam, so every backend and the
cache path of the softmax modules apply; ``A_1 V - lambda A_2 V`` is linear in the two outputs.

Weight layout (the reference code's): ``q_proj`` rows ``[2H * d]`` ordered (head, map), i.e. the
two maps of head ``h`` are q heads ``2h`` and ``2h + 1``; ``k_proj`` likewise ``[2 Hkv * d]``;
``v_proj`` ``[Hkv * 2d]``; ``out_proj`` ``[C, H * 2d]``. GQA: differential head ``h`` reads KV group
``h // (H / Hkv)`` (its two key halves and its ``2d`` value).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import check_bool, check_int
from attnzoo.functional.softmax.varlen import attention_varlen
from attnzoo.masks import Mask
from attnzoo.nn.base import AttentionBase, check_backend
from attnzoo.nn.cache import KVCache
from attnzoo.nn.costs import softmax_cost
from attnzoo.nn.frontier import packed_cu_seqlens, packed_positions
from attnzoo.nn.positional import RotaryEmbedding, resolve_positions
from attnzoo.nn.spec import Cost, CostShape, VariantConfig, VariantSpec, register

__all__ = ["DifferentialAttention", "lambda_init"]

#: RMSNorm epsilon of the per-head norm (the reference code's ``subln``)
SUBLN_EPS = 1e-5


def lambda_init(layer_index: int) -> float:
    """``0.8 - 0.6 exp(-0.3 (l - 1))`` for the ``l = layer_index + 1``-th layer (0-based index)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


class DifferentialAttention(AttentionBase):
    """Differential attention: ``[B, N, C] -> [B, N, C]`` (see the module docstring).

    Args:
        dim: model width ``C``.
        num_heads: differential heads ``H`` (each runs two softmax maps).
        num_kv_heads: KV groups ``Hkv`` (default ``H``; ``H % Hkv == 0``).
        head_dim: half head width ``d`` (default ``C // (2 H)``); a head's value and output are ``2d``.
        layer_index: 0-based depth of the layer, for ``lambda_init`` (:func:`lambda_init`).
        causal: causal attention (required for decoding with a cache).
        rope: ``None``, ``True`` (``RotaryEmbedding(d)``) or a :class:`RotaryEmbedding` of ``d``.
        bias: biases in the projections (the paper's have none).
        backend: backend of :func:`attnzoo.attention`.
        device, dtype: of the parameters.

    Parameters: ``lambda_q1, lambda_k1, lambda_q2, lambda_k2 [d]`` (``N(0, 0.1)``), ``subln_weight [2d]``.
    Shapes: ``forward(x [B, N, C], *, mask, cache, positions, cu_seqlens) -> [B, N, C]``.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 layer_index: int = 0, causal: bool = True, rope: bool | RotaryEmbedding | None = None,
                 bias: bool = False, backend: str = "auto", *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        cls = type(self).__name__
        factory = {"device": device, "dtype": dtype}
        check_int(num_heads, "num_heads", cls)
        kv = num_heads if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", cls)
        if head_dim is None:
            if isinstance(dim, int) and dim % (2 * num_heads):
                raise ValueError(f"{cls}: dim ({dim}) must be divisible by 2 * num_heads ({2 * num_heads}), "
                                 f"or pass head_dim")
            head_dim = dim // (2 * num_heads) if isinstance(dim, int) else None
        check_int(layer_index, "layer_index (0-based depth)", cls, minimum=0)
        # two q/k heads of d per differential head; values of 2d = two "heads" of d per KV group
        super().__init__(dim, 2 * num_heads, num_kv_heads=2 * kv, head_dim=head_dim, bias=bias, layout="q_k_v",
                         factory=factory)
        self.diff_heads, self.diff_kv_heads = num_heads, kv
        self.causal = check_bool(causal, "causal", cls)
        self.backend = check_backend(backend, cls)
        self.layer_index, self.lambda_init = layer_index, lambda_init(layer_index)
        self.rope = _rope(cls, rope, self.head_dim)
        d = self.head_dim
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(d, **factory).normal_(0.0, 0.1)))
        self.subln_weight = nn.Parameter(torch.ones(2 * d, **factory))

    def lambda_(self) -> Tensor:
        """``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` (a 0-d tensor)."""
        return (torch.exp(torch.dot(self.lambda_q1, self.lambda_k1)) - torch.exp(torch.dot(self.lambda_q2,
                                                                                            self.lambda_k2))
                + self.lambda_init)

    # ------------------------------------------------------------------ caches
    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> KVCache:
        """A :class:`KVCache` of ``Hkv`` groups holding ``[K1 | K2]`` (``2d``) and ``V`` (``2d``) per token."""
        return super().init_cache(batch_size, max_len, device=device, dtype=dtype)  # type: ignore[no-any-return]

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype) -> KVCache:
        return KVCache(batch_size, max_len, self.diff_kv_heads, 2 * self.head_dim, device=device, dtype=dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, *, mask: Tensor | Mask | None = None, cache: KVCache | None = None,
                positions: Tensor | None = None, return_weights: bool = False,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """Args:
            x: ``[B, N, C]`` (with a cache: the new tokens at ``cache.length ..``; packed: ``[1, T, C]``).
            mask: as :func:`attnzoo.attention` (absolute key axis ``cache.length + N`` with a cache),
                applied to both maps.
            cache: from :meth:`init_cache`; a call that raises leaves it unchanged.
            positions: RoPE positions ``[N]`` / ``[B, N]`` (default ``cache.length + arange(N)``).
            return_weights: not supported (two maps); must be ``False``.
            cu_seqlens: packed sequences (int32 ``[S+1]``): each attends only inside itself, RoPE
                positions restart per sequence (:func:`attnzoo.attention_varlen`).

        Returns: ``[B, N, C]``.
        """
        cls = type(self).__name__
        x = self.check_call(x, cache, positions, return_weights, KVCache)
        if return_weights:
            raise ValueError(f"{cls}: return_weights is not supported (the output mixes two attention maps)")
        if cache is not None and not self.causal:
            raise ValueError(f"{cls}: decoding with a cache needs causal=True")
        if cu_seqlens is not None:
            if cache is not None or mask is not None or positions is not None:
                raise ValueError(f"{cls}: packed input (cu_seqlens) takes no cache, mask or positions")
            cu = packed_cu_seqlens(cu_seqlens, x, cls)
            return self._combine(*self._packed(x, cu))
        return self._combine(*self.guarded(cache, lambda: self._maps(x, mask, cache, positions)))

    def _qkv(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``q1, q2 [B, H, N, d]``, ``k1, k2 [B, Hkv, N, d]`` (RoPE at ``pos``), ``v [B, Hkv, N, 2d]``."""
        B, N, _ = x.shape
        q = self.split_heads(self.q_proj(x))  # [B, 2H, N, d], heads ordered (head, map)
        k = self.split_heads(self.k_proj(x))  # [B, 2Hkv, N, d]
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(pos, torch.float64 if q.dtype == torch.float64 else torch.float32)
            q, k = self.rope.rotate(q, cos, sin), self.rope.rotate(k, cos, sin)
        v = self.v_proj(x).view(B, N, self.diff_kv_heads, 2 * self.head_dim).transpose(1, 2)  # [B, Hkv, N, 2d]
        return q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2], v

    def _maps(self, x: Tensor, mask: Tensor | Mask | None, cache: KVCache | None,
              positions: Tensor | None) -> tuple[Tensor, Tensor]:
        B, N, _ = x.shape
        start = 0 if cache is None else cache.length
        q1, q2, k1, k2, v = self._qkv(x, resolve_positions(positions, N, start, x.device, batch=B))
        if cache is not None:
            kk, v, _ = cache.update(torch.cat((k1, k2), dim=-1), v)  # [B, Hkv, L, 2d]
            k1, k2 = kk.split(self.head_dim, dim=-1)
        kw = {"mask": mask, "causal": self.causal, "q_offset": start, "backend": self.backend}
        return self.attend(q1, k1, v, **kw), self.attend(q2, k2, v, **kw)

    def _packed(self, x: Tensor, cu: Tensor) -> tuple[Tensor, Tensor]:
        q1, q2, k1, k2, v = self._qkv(x, packed_positions(cu, x.shape[1]))

        def one(q: Tensor, k: Tensor) -> Tensor:
            out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                   causal=self.causal, backend=self.backend)  # [T, H, 2d]
            return out.transpose(0, 1)[None]  # [1, H, T, 2d]

        return one(q1, k1), one(q2, k2)

    def _combine(self, o1: Tensor, o2: Tensor) -> Tensor:
        """``out_proj`` of ``(1 - lambda_init) RMSNorm(o1 - lambda o2)`` per head; ``o [B, H, N, 2d]``."""
        lam = self.lambda_().to(o1.dtype)
        heads = F.rms_norm(o1 - lam * o2, (o1.shape[-1],), self.subln_weight, SUBLN_EPS)
        return self.merge_heads(heads * (1.0 - self.lambda_init))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.diff_heads}, num_kv_heads={self.diff_kv_heads}, "
                f"head_dim={self.head_dim}, layer_index={self.layer_index}, lambda_init={self.lambda_init:.4f}, "
                f"causal={self.causal}")


def _rope(owner: str, rope: object, d: int) -> RotaryEmbedding | None:
    if rope is None or rope is False:
        return None
    if rope is True:
        return RotaryEmbedding(d)
    if isinstance(rope, RotaryEmbedding) and rope.dim == d:
        return rope
    raise TypeError(f"{owner}: rope must be None, a bool or a RotaryEmbedding of dim {d}, got {rope!r}")


# --------------------------------------------------------------------------- variant spec
def _build(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    return DifferentialAttention(dim, num_heads, causal=causal, **kw)


def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """Softmax attention over ``2H`` heads of ``d = C / 2H`` for the scores, whose value products are
    ``2d`` wide: the second half of the ``P V`` FLOPs is added to the dense count."""
    half = VariantConfig(cfg.name, cfg.dim, 2 * cfg.num_heads, 2 * cfg.num_kv_heads, cfg.head_dim // 2, cfg.causal)
    base = softmax_cost(half, shape)
    extra = base.flops_attention // 2  # P V with 2d-wide values: one more d-wide product per map
    return Cost(backend=base.backend, flops_projections=base.flops_projections,
                flops_attention=base.flops_attention + extra, flops_useful=base.flops_useful * 3 // 2,
                flops_backward=base.flops_backward + 2 * extra, bytes_moved=base.bytes_moved,
                activation_bytes=base.activation_bytes * 3 // 2, kv_cache_bytes_per_token=base.kv_cache_bytes_per_token,
                kv_cache_bytes=base.kv_cache_bytes, kv_cache_max_tokens=None, params=base.params + 3 * cfg.head_dim,
                visible_pairs=base.visible_pairs)


register(VariantSpec("diff", "differential", True, "O(N C^2 + N^2 C)", "O(N) (fused/tiled)",
                     "[K1|K2], V of each KV group", _build, _cost, options=("num_kv_heads",),
                     check={"layer_index": 2}, masks="any", positions="rope",
                     rope_dim=lambda head_dim: head_dim // 2))
