"""Softmax attention modules: one :class:`MultiHeadAttention` for MHA / GQA / MQA, self and cross.

The module owns the projections, the head split/merge, RoPE and the cache wiring; the attention
math itself is :func:`attnzoo.attention` (backend chosen by ``backend=``). Shapes follow
``docs/conventions.md``: modules take and return ``[B, N, C]``; inside, ``[B, H, N, D]``.

Thin aliases name the common configurations: :class:`MultiQueryAttention` (one shared KV head),
:class:`GroupedQueryAttention` (``num_kv_heads`` groups) and :class:`SlidingWindowAttention`
(causal, ring-buffer cache). A bidirectional (encoder) attention is just ``causal=False``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import check_int as _check_int
from attnzoo.functional._request import normalize_window
from attnzoo.functional.attention import BACKENDS, attention
from attnzoo.masks import Mask
from attnzoo.nn.cache import KVCache, SlidingWindowKVCache
from attnzoo.nn.positional import RotaryEmbedding, alibi_slopes, resolve_positions

__all__ = ["GroupedQueryAttention", "MultiHeadAttention", "MultiQueryAttention", "SlidingWindowAttention"]

Cache = KVCache | SlidingWindowKVCache


class MultiHeadAttention(nn.Module):
    """Multi-head softmax attention with grouped/multi-query KV heads, RoPE, ALiBi and KV caching.

    ``num_kv_heads`` selects the family: ``== num_heads`` MHA, a divisor GQA, ``1`` MQA. Query head
    ``h`` reads KV head ``h // (num_heads // num_kv_heads)``; K/V are never expanded in memory.

    Weight layout (documented for checkpoint interop; :meth:`load_qkv` fills it from separate
    q/k/v weights, :meth:`qkv_weights` returns views of them):

    * self-attention (``kv_dim=None``): one fused ``qkv_proj = Linear(C, (H + 2 Hkv) * D)`` whose
      output rows are ``[q; k; v]`` (``H * D``, ``Hkv * D``, ``Hkv * D`` rows), each head's rows
      contiguous (head-major, as ``torch.nn.MultiheadAttention.in_proj_weight``, GPT-2's
      ``c_attn.weight.T`` and the concatenation of LLaMA's ``q_proj/k_proj/v_proj``);
    * cross-attention (``kv_dim`` given): ``q_proj = Linear(C, H * D)`` and
      ``kv_proj = Linear(kv_dim, 2 * Hkv * D)`` with rows ``[k; v]``;
    * ``out_proj = Linear(H * D, C)``.

    Args:
        dim: model width ``C``.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` (default ``H``); ``H % Hkv == 0``.
        kv_dim: width of the ``context`` for a cross-attention module (``None``: self-attention).
        head_dim: ``D`` (default ``C // H``; then ``C % H == 0`` is required).
        bias: biases in every projection.
        causal: causal self-attention (required for decoding with a cache).
        window: ``w`` or ``(left, right)`` as in :func:`attnzoo.attention`; with ``causal`` a query
            sees itself and the ``left`` keys before it, and :meth:`init_cache` returns a
            :class:`SlidingWindowKVCache` of ``left + 1`` slots.
        rope: ``None``, ``True`` (``RotaryEmbedding(head_dim)``) or a :class:`RotaryEmbedding`.
        alibi: add ALiBi biases with :func:`alibi_slopes` ``(H)``.
        dropout: attention-weight dropout (training only).
        backend: backend of :func:`attnzoo.attention` (``"auto"`` picks the fastest exact one).
        scale: score scale, default ``1 / sqrt(D)``.
        device, dtype: of the parameters.

    Shapes:
        ``forward(x [B, N, C], context [B, M, kv_dim] | None) -> [B, N, C]``, with
        ``return_weights`` also ``weights [B, H, N, Nk]``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        kv_dim: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        causal: bool = False,
        window: int | tuple[int | None, int | None] | None = None,
        rope: bool | RotaryEmbedding | None = None,
        alibi: bool = False,
        dropout: float = 0.0,
        backend: str = "auto",
        scale: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        cls = type(self).__name__
        self.dim = _check_int(dim, "dim")
        self.num_heads = _check_int(num_heads, "num_heads")
        self.num_kv_heads = self.num_heads if num_kv_heads is None else _check_int(num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{cls}: num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                             f"({self.num_kv_heads}), got remainder {self.num_heads % self.num_kv_heads}")
        if head_dim is None:
            if self.dim % self.num_heads:
                raise ValueError(f"{cls}: dim ({self.dim}) must be divisible by num_heads ({self.num_heads}), "
                                 f"or pass head_dim explicitly")
            self.head_dim = self.dim // self.num_heads
        else:
            self.head_dim = _check_int(head_dim, "head_dim")
        self.kv_dim = None if kv_dim is None else _check_int(kv_dim, "kv_dim")
        for name, flag in (("bias", bias), ("causal", causal), ("alibi", alibi)):
            if not isinstance(flag, bool):
                raise TypeError(f"{cls}: {name} must be a bool, got {type(flag).__name__}")
        self.causal = causal
        self.window = normalize_window(window)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"{cls}: dropout must be a float in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
            raise ValueError(f"{cls}: backend must be one of {('auto', *BACKENDS)}, got {backend!r}")
        self.backend = backend
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
            raise ValueError(f"{cls}: scale must be a positive float or None, got {scale!r}")
        self.scale = None if scale is None else float(scale)

        if rope is None or rope is False:
            self.rope: RotaryEmbedding | None = None
        elif rope is True:
            if self.head_dim % 2:
                raise ValueError(f"{cls}: rope=True rotates channel pairs and needs an even head_dim, "
                                 f"got head_dim={self.head_dim}")
            self.rope = RotaryEmbedding(self.head_dim)
        elif isinstance(rope, RotaryEmbedding):
            if rope.dim != self.head_dim:
                raise ValueError(f"{cls}: rope was built for head dim {rope.dim}, but head_dim={self.head_dim}")
            self.rope = rope
        else:
            raise TypeError(f"{cls}: rope must be None, a bool or a RotaryEmbedding, got {type(rope).__name__}")
        self.alibi = alibi
        self._alibi_cache: dict[torch.device, Tensor] = {}
        if self.kv_dim is not None and (self.causal or self.window is not None or self.rope is not None
                                        or self.alibi):
            raise ValueError(f"{cls}: a cross-attention module (kv_dim={self.kv_dim}) does not take causal, window, "
                             f"rope or alibi (they relate query and key positions of one sequence)")

        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.kv_dim is None:
            self.qkv_proj = nn.Linear(self.dim, (H + 2 * Hkv) * D, bias=bias, **fk)
        else:
            self.q_proj = nn.Linear(self.dim, H * D, bias=bias, **fk)
            self.kv_proj = nn.Linear(self.kv_dim, 2 * Hkv * D, bias=bias, **fk)
        self.out_proj = nn.Linear(H * D, self.dim, bias=bias, **fk)

    # ------------------------------------------------------------------ weights
    def qkv_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """Views ``(Wq [H*D, C], Wk [Hkv*D, C_kv], Wv [Hkv*D, C_kv])`` of the projection weights."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.kv_dim is None:
            w = self.qkv_proj.weight
            return w[: H * D], w[H * D: (H + Hkv) * D], w[(H + Hkv) * D:]
        wkv = self.kv_proj.weight
        return self.q_proj.weight, wkv[: Hkv * D], wkv[Hkv * D:]

    def qkv_biases(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """Views ``(bq, bk, bv)`` of the projection biases, or ``None`` without biases."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.kv_dim is None:
            b = self.qkv_proj.bias
            return None if b is None else (b[: H * D], b[H * D: (H + Hkv) * D], b[(H + Hkv) * D:])
        bq, bkv = self.q_proj.bias, self.kv_proj.bias
        return None if bq is None or bkv is None else (bq, bkv[: Hkv * D], bkv[Hkv * D:])

    @torch.no_grad()
    def load_qkv(self, q_weight: Tensor, k_weight: Tensor, v_weight: Tensor, q_bias: Tensor | None = None,
                 k_bias: Tensor | None = None, v_bias: Tensor | None = None) -> None:
        """Copy separate q/k/v projection weights (``nn.Linear`` layout ``[out, in]``) into this module."""
        for name, dst, src in zip(("q_weight", "k_weight", "v_weight"), self.qkv_weights(),
                                  (q_weight, k_weight, v_weight), strict=True):
            if not isinstance(src, Tensor) or src.shape != dst.shape:
                raise ValueError(f"load_qkv: {name} must have shape {tuple(dst.shape)} [out, in], got "
                                 f"{tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__}")
            dst.copy_(src)
        biases = self.qkv_biases()
        given = (q_bias, k_bias, v_bias)
        if biases is None:
            if any(b is not None for b in given):
                raise ValueError("load_qkv: this module was built with bias=False, but biases were given")
            return
        for name, dst, src in zip(("q_bias", "k_bias", "v_bias"), biases, given, strict=True):
            if src is None:
                dst.zero_()
            elif not isinstance(src, Tensor) or src.shape != dst.shape:
                raise ValueError(f"load_qkv: {name} must have shape {tuple(dst.shape)}, got "
                                 f"{tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__}")
            else:
                dst.copy_(src)

    # ------------------------------------------------------------------ caches
    def _structure(self) -> Mask | None:
        """A position pattern replacing ``causal``/``window`` (subclasses, e.g. local-global)."""
        return None

    def _sliding_left(self) -> int | None:
        """Left window bound when decoding can use a ring buffer, else ``None``."""
        if self._structure() is not None or not self.causal or self.window is None:
            return None
        return self.window[0]

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> KVCache | SlidingWindowKVCache:
        """A cache for decoding with this module: a :class:`SlidingWindowKVCache` of ``left + 1`` slots for
        causal sliding-window attention, else a :class:`KVCache` of ``max_len`` slots (for a
        cross-attention module, ``max_len`` is the context length). Device/dtype default to the module's."""
        _check_int(batch_size, "batch_size")
        _check_int(max_len, "max_len")
        p = self.out_proj.weight
        dev = p.device if device is None else device
        dt = p.dtype if dtype is None else dtype
        left = self._sliding_left()
        if left is not None and left + 1 < max_len:
            return SlidingWindowKVCache(batch_size, left, self.num_kv_heads, self.head_dim, max_len=max_len,
                                        device=dev, dtype=dt)
        return KVCache(batch_size, max_len, self.num_kv_heads, self.head_dim, device=dev, dtype=dt)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | Mask | None = None,
        cache: KVCache | SlidingWindowKVCache | None = None,
        positions: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x [B, N, C]`` to itself (or to ``context [B, M, kv_dim]``).

        Args:
            x: the queries' tokens; with a cache, only the NEW tokens (positions ``cache.length ..``).
            context: keys/values source for cross-attention. With a cache on a cross-attention
                module, the context is projected once on the first call (``cache.length == 0``) and
                the cached keys are reused afterwards (``context`` may then be ``None``).
            mask: what :func:`attnzoo.attention` accepts (bool = may attend, float = additive bias,
                or an :class:`attnzoo.masks.Mask`), applied on top of causal/window. Its key axis
                is absolute: ``Nk`` = ``N`` (self), ``M`` (cross), or with a cache the number of
                tokens written after appending, ``cache.length + N`` (also for the sliding cache,
                whose held keys are gathered from it).
            cache: from :meth:`init_cache`; updated in place.
            positions: int ``[N]`` or ``[B, N]`` absolute positions for RoPE (e.g. per-row positions
                with left padding). Default ``cache.length + arange(N)``. Causal, window and ALiBi
                use the token's slot index (its position in the cache).
            return_weights: also return the attention weights ``[B, H, N, Nk]`` (the reference
                backend; with a sliding cache the keys are in the cache's slot order).

        Returns:
            ``out [B, N, C]``, or ``(out, weights)``.
        """
        cls = type(self).__name__
        if not isinstance(x, Tensor):
            raise TypeError(f"{cls}: x must be a tensor [B, N, C], got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{cls}: x must have shape [B, N, C] with C = dim = {self.dim}, got {tuple(x.shape)}")
        if not isinstance(return_weights, bool):
            raise TypeError(f"{cls}: return_weights must be a bool, got {type(return_weights).__name__}")
        if cache is not None and not isinstance(cache, (KVCache, SlidingWindowKVCache)):
            raise TypeError(f"{cls}: cache must be a KVCache or SlidingWindowKVCache from init_cache(), "
                            f"got {type(cache).__name__}")
        if cache is not None and cache.batch_size != x.shape[0]:
            raise ValueError(f"{cls}: the cache was built for batch size {cache.batch_size}, but x has batch "
                             f"size {x.shape[0]} (x shape {tuple(x.shape)})")
        if self.kv_dim is not None or context is not None:
            out, weights = self._cross(x, context, mask, cache, return_weights)
        else:
            out, weights = self._self(x, mask, cache, positions, return_weights)
        B, N = x.shape[:2]
        y = self.out_proj(out.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))  # [B, N, C]
        return (y, weights) if return_weights else y

    # ------------------------------------------------------------------ internals
    def _heads(self, t: Tensor, heads: int) -> Tensor:
        B, N = t.shape[:2]
        return t.view(B, N, heads, self.head_dim).transpose(1, 2)  # [B, heads, N, D]

    def _slopes(self, device: torch.device) -> Tensor | None:
        if not self.alibi:
            return None
        s = self._alibi_cache.get(device)
        if s is None:
            s = alibi_slopes(self.num_heads, device=device)
            self._alibi_cache[device] = s
        return s

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _call(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None, causal: bool,
              window: Any, q_offset: int | None, alibi: Tensor | None,
              return_weights: bool) -> tuple[Tensor, Tensor | None]:
        res = attention(q, k, v, mask=mask, causal=causal, window=window, q_offset=q_offset, scale=self.scale,
                        alibi_slopes=alibi, dropout_p=self._dropout_p(), return_weights=return_weights,
                        backend=self.backend)
        if return_weights:
            assert isinstance(res, tuple)
            return res[0], res[1]
        assert isinstance(res, Tensor)
        return res, None

    def _cross(self, x: Tensor, context: Tensor | None, mask: Tensor | Mask | None, cache: Cache | None,
               return_weights: bool) -> tuple[Tensor, Tensor | None]:
        cls = type(self).__name__
        if self.kv_dim is None and (self.causal or self.window is not None or self.rope is not None or self.alibi
                                    or self._structure() is not None):
            raise ValueError(f"{cls}: context= (cross-attention) is not supported on a module with causal, window, "
                             f"rope, alibi or a position pattern; build a separate cross-attention module")
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        B = x.shape[0]
        if self.kv_dim is None:
            w, b = self.qkv_proj.weight, self.qkv_proj.bias
            q = F.linear(x, w[: H * D], None if b is None else b[: H * D])  # [B, N, H*D]
        else:
            q = self.q_proj(x)
        q = self._heads(q, H)  # [B, H, N, D]
        kv_width = self.dim if self.kv_dim is None else self.kv_dim
        if isinstance(cache, SlidingWindowKVCache):
            raise TypeError(f"{cls}: cross-attention needs a KVCache (got a SlidingWindowKVCache)")
        if cache is not None and cache.length > 0:
            if context is not None and context.dim() == 3 and context.shape[1] != cache.length:
                raise ValueError(f"{cls}: the cache holds a context of {cache.length} tokens, got context "
                                 f"{tuple(context.shape)}; call cache.reset() for a new context")
            k, v = cache.keys(), cache.values()
        else:
            if context is None:
                raise ValueError(f"{cls}: this is a cross-attention module (kv_dim={self.kv_dim}); pass "
                                 f"context [B, M, {kv_width}]")
            if not isinstance(context, Tensor):
                raise TypeError(f"{cls}: context must be a tensor [B, M, {kv_width}], got {type(context).__name__}")
            if context.dim() != 3 or context.shape[-1] != kv_width or context.shape[0] != B:
                raise ValueError(f"{cls}: context must have shape [B, M, kv_dim] = [{B}, M, {kv_width}], "
                                 f"got {tuple(context.shape)}")
            if self.kv_dim is None:
                kv = F.linear(context, w[H * D:], None if b is None else b[H * D:])  # [B, M, 2*Hkv*D]
            else:
                kv = self.kv_proj(context)
            k_, v_ = kv.split(Hkv * D, dim=-1)
            k, v = self._heads(k_, Hkv), self._heads(v_, Hkv)  # [B, Hkv, M, D]
            if cache is not None:
                k, v = cache.update(k, v)
        return self._call(q, k, v, mask=mask, causal=False, window=None, q_offset=0, alibi=None,
                          return_weights=return_weights)

    def _self(self, x: Tensor, mask: Tensor | Mask | None, cache: Cache | None, positions: Tensor | None,
              return_weights: bool) -> tuple[Tensor, Tensor | None]:
        cls = type(self).__name__
        B, N, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        structure = self._structure()
        if cache is not None and not self.causal:
            raise ValueError(f"{cls}: decoding with a cache needs causal=True (a bidirectional layer would see "
                             f"tokens that are not generated yet)")
        start = 0 if cache is None else cache.length
        qkv = self.qkv_proj(x)  # [B, N, (H + 2 Hkv) D]
        qk_, v_ = qkv.split(((H + Hkv) * D, Hkv * D), dim=-1)
        qk = self._heads(qk_, H + Hkv)  # [B, H + Hkv, N, D]: q and k heads side by side
        v = self._heads(v_, Hkv)  # [B, Hkv, N, D]
        if self.rope is not None:  # one rotation for the q and k heads together
            pos = resolve_positions(positions, N, start, x.device, batch=B)
            cos, sin = self.rope.cos_sin(pos, torch.float64 if qk.dtype == torch.float64 else torch.float32)
            qk = self.rope.rotate(qk, cos, sin)
        elif positions is not None:
            resolve_positions(positions, N, start, x.device, batch=B)  # validate only
        q, k = qk[:, :H], qk[:, H:]  # [B, H, N, D], [B, Hkv, N, D]
        slopes = self._slopes(x.device)

        if isinstance(cache, SlidingWindowKVCache):
            if structure is not None or self.window is None or self.window[0] is None:
                raise TypeError(f"{cls}: a SlidingWindowKVCache needs a causal module with a left window; "
                                f"use module.init_cache()")
            if cache.window != self.window[0]:
                raise ValueError(f"{cls}: the cache keeps window={cache.window} keys, the module needs "
                                 f"{self.window[0]}; use module.init_cache()")
            return self._sliding(q, k, v, cache, mask, slopes, return_weights)

        window = self.window
        causal = self.causal
        q_offset = start
        if cache is not None:
            k, v = cache.update(k, v)  # every key so far: [B, Hkv, start + N, D]
        n_k = k.shape[2]
        if structure is not None:
            mask = self._merge_structure(structure, mask, B, N, n_k, q_offset)
            causal, window = False, None
        elif window is not None and window[0] is not None and causal and not return_weights \
                and not isinstance(mask, Mask):
            # Keys left of the first query's window are invisible to every query: skip them (a view).
            lo = max(0, q_offset - window[0])
            if lo > 0:
                k, v = k[:, :, lo:], v[:, :, lo:]
                q_offset -= lo
                n_k -= lo
                if isinstance(mask, Tensor) and mask.dim() >= 2 and mask.shape[-1] == n_k + lo:
                    mask = mask[..., lo:]
        if N == 1 and structure is None and q_offset == n_k - 1:
            # One query at the last position: causality hides nothing, nor does a window that
            # reaches the first key.
            causal = False
            if window is not None and (window[0] is None or q_offset - window[0] <= 0):
                window = None
        return self._call(q, k, v, mask=mask, causal=causal, window=window, q_offset=q_offset, alibi=slopes,
                          return_weights=return_weights)

    def _merge_structure(self, structure: Mask, mask: Tensor | Mask | None, B: int, N: int, n_k: int,
                         q_offset: int) -> Tensor | Mask:
        """Combine the module's position pattern with a user mask (subclasses with a pattern)."""
        raise NotImplementedError  # pragma: no cover - only LocalGlobalAttention has a structure

    def _sliding(self, q: Tensor, k: Tensor, v: Tensor, cache: SlidingWindowKVCache,
                 mask: Tensor | Mask | None, slopes: Tensor | None,
                 return_weights: bool) -> tuple[Tensor, Tensor | None]:
        B, H, N, _ = q.shape
        start = cache.length
        k_all, v_all, kpos = cache.update(k, v)  # keys in slot order, with their absolute positions [Nk]
        if N == 1 and slopes is None and mask is None:
            # The ring holds exactly the keys this query may see.
            return self._call(q, k_all, v_all, mask=None, causal=False, window=None, q_offset=None, alibi=None,
                              return_weights=return_weights)
        total = start + N
        qpos = torch.arange(start, total, device=q.device)
        left = cache.window
        kp, qp = kpos.view(1, -1), qpos.view(-1, 1)
        allowed = ((kp <= qp) & (kp >= qp - left)).view(1, 1, N, -1)  # [1, 1, N, Nk]
        bias: Tensor | None = None
        if isinstance(mask, Mask):
            b_idx = torch.arange(B, device=q.device).view(B, 1, 1, 1)
            h_idx = torch.arange(H, device=q.device).view(1, H, 1, 1)
            m = mask(b_idx, h_idx, qpos.view(1, 1, N, 1), kpos.view(1, 1, 1, -1))
            if not isinstance(m, Tensor) or m.dtype != torch.bool:
                raise TypeError(f"mask {mask.name}: predicate must return a bool tensor")
            allowed = allowed & m
        elif isinstance(mask, Tensor):
            m4 = _gather_keys(mask, kpos, B, H, N, total, type(self).__name__)
            if m4.dtype == torch.bool:
                allowed = allowed & m4
            else:
                bias = m4.float()
        elif mask is not None:
            raise TypeError(f"mask must be None, a bool/float tensor or an attnzoo.masks.Mask, got {type(mask).__name__}")
        if slopes is not None:
            dist = (qp - kp).abs().float()  # [N, Nk]
            ab = -slopes.view(1, H, 1, 1) * dist  # [1, H, N, Nk]
            bias = ab if bias is None else bias + ab
        final: Tensor = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
        return self._call(q, k_all, v_all, mask=final, causal=False, window=None, q_offset=None, alibi=None,
                          return_weights=return_weights)

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        if self.kv_dim is not None:
            s += f", kv_dim={self.kv_dim}"
        if self.causal:
            s += ", causal=True"
        if self.window is not None:
            s += f", window={self.window}"
        if self.alibi:
            s += ", alibi=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.backend != "auto":
            s += f", backend={self.backend!r}"
        return s


def _gather_keys(mask: Tensor, kpos: Tensor, B: int, H: int, N: int, total: int, cls: str) -> Tensor:
    """A user mask over absolute keys ``[.., N, total]`` -> its columns at ``kpos``: ``[b, h, N, Nk]``."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{cls}: mask must be bool (True = attend) or float (additive bias), got {mask.dtype}")
    if mask.dim() < 2 or mask.dim() > 4:
        raise ValueError(f"{cls}: mask must have rank 2 to 4 and broadcast to [B, H, N, cache.length] = "
                         f"{[B, H, N, total]}, got {tuple(mask.shape)}")
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    for got, want, letter in zip(m4.shape, (B, H, N, total), ("B", "H", "N", "Nk"), strict=True):
        if got not in (1, want):
            raise ValueError(f"{cls}: with a sliding cache the mask's key axis covers every token written "
                             f"(cache.length after appending); mask {tuple(mask.shape)} does not broadcast to "
                             f"{[B, H, N, total]} (dimension {letter}: got {got}, expected 1 or {want})")
    if m4.shape[-1] == 1:
        return m4
    return m4.index_select(3, kpos.to(m4.device))


# --------------------------------------------------------------------------- aliases
class MultiQueryAttention(MultiHeadAttention):
    """Multi-query attention (Shazeer, 2019): every query head shares ONE key/value head.

    ``MultiHeadAttention(dim, num_heads, num_kv_heads=1, **kw)``; the cache holds ``1 / H`` of
    MHA's bytes. Arguments as :class:`MultiHeadAttention`.
    """

    def __init__(self, dim: int, num_heads: int, **kw: Any) -> None:
        if "num_kv_heads" in kw:
            raise TypeError("MultiQueryAttention has num_kv_heads=1; use GroupedQueryAttention for other values")
        super().__init__(dim, num_heads, num_kv_heads=1, **kw)


class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention (Ainslie et al., 2023): ``num_kv_heads`` KV heads, each shared by
    ``num_heads // num_kv_heads`` query heads (head ``h`` reads KV head ``h // group``).

    ``MultiHeadAttention(dim, num_heads, num_kv_heads=num_kv_heads, **kw)``; the cache holds
    ``num_kv_heads / num_heads`` of MHA's bytes.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, **kw: Any) -> None:
        super().__init__(dim, num_heads, num_kv_heads=num_kv_heads, **kw)


class SlidingWindowAttention(MultiHeadAttention):
    """Causal sliding-window attention (Longformer/Mistral style): each query sees itself and the
    ``window`` keys before it; decoding uses a :class:`SlidingWindowKVCache` of ``window + 1`` slots.

    Mistral's ``sliding_window=W`` is ``window=W - 1``. ``MultiHeadAttention(dim, num_heads,
    window=window, causal=causal, **kw)``; with ``causal=False`` the window is two-sided.
    """

    def __init__(self, dim: int, num_heads: int, window: int, causal: bool = True, **kw: Any) -> None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"SlidingWindowAttention: window must be an int (keys before the query), got "
                            f"{type(window).__name__} ({window!r})")
        if window < 0:
            raise ValueError(f"SlidingWindowAttention: window must be >= 0, got {window}")
        super().__init__(dim, num_heads, window=window, causal=causal, **kw)
        self.window_size = window
