"""Softmax attention modules: one :class:`MultiHeadAttention` for MHA / GQA / MQA, self and cross.

The module owns the projections, the head split/merge, RoPE and the cache wiring (all on
:class:`~attnzoo.nn.base.AttentionBase`); the attention math itself is :func:`attnzoo.attention`,
reached only through the attend seam ``self.attend(...)`` (backend chosen by ``backend=``). Shapes
follow ``docs/conventions.md``: modules take and return ``[B, N, C]``; inside, ``[B, H, N, D]``.

Thin aliases name the common configurations: :class:`MultiQueryAttention` (one shared KV head),
:class:`GroupedQueryAttention` (``num_kv_heads`` groups) and :class:`SlidingWindowAttention`
(causal, ring-buffer cache). A bidirectional (encoder) attention is just ``causal=False``.
Each is a registered variant (``mha``, ``mqa``, ``gqa``, ``sliding``); their specs sit at the end.

Weight layout of :class:`MultiHeadAttention` (documented for checkpoint interop; ``load_qkv`` fills it
from separate q/k/v weights, ``qkv_weights`` returns views of them):

* self-attention (``kv_dim=None``): one fused ``qkv_proj = Linear(C, (H + 2 Hkv) * D)`` whose
  output rows are ``[q; k; v]`` (``H * D``, ``Hkv * D``, ``Hkv * D`` rows), each head's rows
  contiguous (head-major, as ``torch.nn.MultiheadAttention.in_proj_weight``, GPT-2's
  ``c_attn.weight.T`` and the concatenation of LLaMA's ``q_proj/k_proj/v_proj``);
* cross-attention (``kv_dim`` given): ``q_proj = Linear(C, H * D)`` and
  ``kv_proj = Linear(kv_dim, 2 * Hkv * D)`` with rows ``[k; v]``;
* ``out_proj = Linear(H * D, C)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_bool, check_choice, check_int, check_probability
from attnzoo.functional.core._request import normalize_window
from attnzoo.functional.softmax.attention import merge_attention
from attnzoo.functional.softmax.sigmoid import sigmoid_attention
from attnzoo.functional.softmax.varlen import attention_varlen
from attnzoo.masks import Mask
from attnzoo.nn.base import AttentionBase, check_backend
from attnzoo.nn.cache import KVCache, SinkWindowKVCache, SlidingWindowKVCache
from attnzoo.nn.costs import softmax_cost
from attnzoo.nn.frontier import packed_cu_seqlens, packed_positions
from attnzoo.nn.parts import AttentionParts, Scores, parts_from_settings, placed
from attnzoo.nn.positional import RotaryEmbedding, alibi_slopes, resolve_positions
from attnzoo.nn.spec import Cost, CostShape, VariantConfig, VariantSpec, register
from attnzoo.nn.streaming import (
    POSITION_MODES,
    mask_at,
    padded_parts,
    padding_offsets,
    sink_query_positions,
    streaming_pattern,
)

__all__ = ["PART_SETTINGS", "GroupedQueryAttention", "MultiHeadAttention", "MultiQueryAttention",
           "SigmoidAttention", "SlidingWindowAttention", "StreamingAttention", "build_softmax", "default_kv_heads"]

Cache = KVCache | SlidingWindowKVCache


def _resolve_rope(owner: str, rope: object, head_dim: int) -> RotaryEmbedding | None:
    if rope is None or rope is False:
        return None
    if rope is True:
        if head_dim % 2:
            raise ValueError(f"{owner}: rope=True rotates channel pairs and needs an even head_dim, "
                             f"got head_dim={head_dim}")
        return RotaryEmbedding(head_dim)
    if isinstance(rope, RotaryEmbedding):
        if rope.dim != head_dim:
            raise ValueError(f"{owner}: rope was built for head dim {rope.dim}, but head_dim={head_dim}")
        return rope
    raise TypeError(f"{owner}: rope must be None, a bool or a RotaryEmbedding, got {type(rope).__name__}")


class _PackedAttention:
    """Packed self-attention of a :class:`MultiHeadAttention`: ``S`` sequences end to end in ``x [1, T, C]``
    (``cu_seqlens``), RoPE restarting per sequence, through :func:`attnzoo.attention_varlen`."""

    def _packed(self, x: Tensor, cu_seqlens: object, context: object, mask: object, cache: object,
                positions: object, return_weights: bool) -> Tensor:
        """Self-attention over packed sequences ``x [1, T, C]``: ``[1, H, T, Dv]`` before the merge."""
        cls = type(self).__name__
        given = [n for n, v in (("context", context), ("mask", mask), ("cache", cache), ("positions", positions))
                 if v is not None] + (["return_weights"] if return_weights else [])
        if given or self.kv_dim is not None or self._structure() is not None or self._score != "softmax":
            raise ValueError(f"{cls}: packed input (cu_seqlens) is plain causal/window softmax self-attention; it "
                             f"does not take {given or 'a cross-attention, position-pattern or sigmoid module'}")
        cu = packed_cu_seqlens(cu_seqlens, x, cls)
        if self.training and self.dropout:
            raise ValueError(f"{cls}: packed input (cu_seqlens) has no attention dropout; use dropout=0.0")
        H, T = self.num_heads, x.shape[1]
        q, k, v = self.project_qkv(x)  # [1, H, T, D], [1, Hkv, T, D]
        q, k = self.frontier.norm_q(q), self.frontier.norm_k(k)
        pos = packed_positions(cu, T)
        q, k = self._rotate(q, pos), self._rotate(k, pos)
        out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                               causal=self.causal, window=self.window, alibi_slopes=self._slopes(x.device),
                               scale=self.scale, softcap=self.scores.softcap, sinks=self.sinks,
                               score_mod=self.score_mod, backend=self.backend)  # [T, H, Dv]
        return out.transpose(0, 1).reshape(1, H, T, -1)

    def _packed_cross(self, x: Tensor, cu_seqlens: object, context: object, context_cu_seqlens: object,
                      mask: object, cache: object, positions: object, return_weights: bool) -> Tensor:
        """Cross-attention of packed pairs: query sequence ``i`` of ``x [1, Tq, C]`` (``cu_seqlens``)
        attends to context sequence ``i`` of ``context [1, Tk, kv_dim]`` (``context_cu_seqlens``, the
        same ``S``) only, through :func:`attnzoo.attention_varlen` with ``cu_seqlens_q != cu_seqlens_k``:
        ``[1, H, Tq, Dv]`` before the merge. Equal to each pair's own cross-attention call."""
        cls = type(self).__name__
        if cu_seqlens is None:
            raise ValueError(f"{cls}: context_cu_seqlens needs cu_seqlens (the packed queries)")
        given = [n for n, v in (("mask", mask), ("cache", cache), ("positions", positions)) if v is not None] + (
            ["return_weights"] if return_weights else [])
        positional = self.causal or self.window is not None or self.rope is not None or self.alibi
        if given or positional or self._structure() is not None or self._score != "softmax" or self.score_mod is not None:
            raise ValueError(f"{cls}: packed input (cu_seqlens) with context_cu_seqlens is plain softmax cross-attention; "
                             f"it does not take {given or 'causal, window, rope, alibi, a position pattern, score_mod or sigmoid'}")
        if self.training and self.dropout:
            raise ValueError(f"{cls}: packed input (cu_seqlens) has no attention dropout; use dropout=0.0")
        cu_q = packed_cu_seqlens(cu_seqlens, x, cls)
        ctx = self._check_context(x, context)
        cu_k = packed_cu_seqlens(context_cu_seqlens, ctx, cls)
        if cu_k.numel() != cu_q.numel():
            raise ValueError(f"{cls}: cu_seqlens and context_cu_seqlens must hold the same number of sequences, "
                             f"got {cu_q.numel() - 1} and {cu_k.numel() - 1}")
        q = self.frontier.norm_q(self.project_q(x))  # [1, H, Tq, D]
        k, v = self.project_kv(ctx)  # [1, Hkv, Tk, D]
        k = self.frontier.norm_k(k)
        out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_q, cu_k,
                               scale=self.scale, softcap=self.scores.softcap, sinks=self.sinks,
                               backend=self.backend)  # [Tq, H, Dv]
        return out.transpose(0, 1).reshape(1, self.num_heads, x.shape[1], -1)


class _CrossAttention:
    """Cross-attention of a :class:`MultiHeadAttention` (``kv_dim`` given, or ``context=``): queries from
    ``x``, keys/values from ``context`` (projected once into a cache on the first cached call)."""

    def _cross(self, x: Tensor, context: Tensor | None, mask: Tensor | Mask | None, cache: Cache | None,
               return_weights: bool) -> tuple[Tensor, Tensor | None]:
        cls = type(self).__name__
        if self.kv_dim is None and (self.causal or self.window is not None or self.rope is not None or self.alibi
                                    or self._structure() is not None):
            raise ValueError(f"{cls}: context= (cross-attention) is not supported on a module with causal, window, "
                             f"rope, alibi or a position pattern; build a separate cross-attention module")
        if isinstance(cache, SlidingWindowKVCache):
            raise TypeError(f"{cls}: cross-attention needs a KVCache (got a SlidingWindowKVCache)")
        q = self.frontier.norm_q(self.project_q(x))  # [B, H, N, D]
        if cache is not None and cache.length > 0:
            if context is not None and context.dim() == 3 and context.shape[1] != cache.length:
                raise ValueError(f"{cls}: the cache holds a context of {cache.length} tokens, got context "
                                 f"{tuple(context.shape)}; call cache.reset() for a new context")
            _check_mask(cls, mask, x.shape[0], self.num_heads, x.shape[1], cache.length)
            k, v = cache.keys(), cache.values()
        else:
            context = self._check_context(x, context)
            _check_mask(cls, mask, x.shape[0], self.num_heads, x.shape[1], context.shape[1])
            k, v = self.project_kv(context)  # [B, Hkv, M, D]
            k = self.frontier.norm_k(k)
            if cache is not None:
                k, v, _ = cache.update(k, v)
        return self._core(q, k, v, mask=mask, causal=False, window=None, q_offset=0, alibi=None,
                          return_weights=return_weights)

    def _check_context(self, x: Tensor, context: object) -> Tensor:
        cls = type(self).__name__
        width = self.dim if self.kv_dim is None else self.kv_dim
        if context is None:
            raise ValueError(f"{cls}: this is a cross-attention module (kv_dim={self.kv_dim}); pass "
                             f"context [B, M, {width}]")
        if not isinstance(context, Tensor):
            raise TypeError(f"{cls}: context must be a tensor [B, M, {width}], got {type(context).__name__}")
        if not context.is_floating_point():
            raise TypeError(f"{cls}: context must be a floating-point tensor, got dtype {context.dtype}")
        if context.dim() != 3 or context.shape[-1] != width or context.shape[0] != x.shape[0]:
            raise ValueError(f"{cls}: context must have shape [B, M, kv_dim] = [{x.shape[0]}, M, {width}], "
                             f"got {tuple(context.shape)}")
        return context


class MultiHeadAttention(_CrossAttention, _PackedAttention, AttentionBase):
    """Multi-head softmax attention with grouped/multi-query KV heads, RoPE, ALiBi and KV caching.

    ``num_kv_heads`` selects the family: ``== num_heads`` MHA, a divisor GQA, ``1`` MQA. Query head
    ``h`` reads KV head ``h // (num_heads // num_kv_heads)``; K/V are never expanded in memory.

    Weight layout: see the module docstring (``load_qkv`` / ``qkv_weights`` for checkpoints).

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
            :class:`SlidingWindowKVCache` of ``left`` slots (the keys before the next query).
        rope: ``None``, ``True`` (``RotaryEmbedding(head_dim)``) or a :class:`RotaryEmbedding`.
        dropout: attention-weight dropout (training only).
        backend: backend of :func:`attnzoo.attention` (``"auto"`` picks the fastest exact one).
        parts: the injected :class:`~attnzoo.nn.parts.AttentionParts` (QK-norms, output gate, sink
            logits, :class:`~attnzoo.nn.parts.Scores`: ALiBi, scale, soft cap, ``score_mod``); ``None``:
            none. Device/dtype: build under ``with torch.device(...)`` and ``.to(dtype)``, or through
            :func:`attnzoo.variants.build_attention` (``device=``, ``dtype=``, the parts' keywords).

    Shapes:
        ``forward(x [B, N, C], context [B, M, kv_dim] | None) -> [B, N, C]``, with
        ``return_weights`` also ``weights [B, H, N, Nk]``.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, kv_dim: int | None = None,
                 head_dim: int | None = None, bias: bool = True, causal: bool = False,
                 window: int | tuple[int | None, int | None] | None = None, rope: bool | RotaryEmbedding | None = None,
                 dropout: float = 0.0, backend: str = "auto", *, parts: AttentionParts | None = None) -> None:
        cls = type(self).__name__
        num_kv_heads = _alias_kv_heads(type(self)._fixed_kv_heads, cls, num_kv_heads)
        if parts is not None and not isinstance(parts, AttentionParts):
            raise TypeError(f"{cls}: parts must be an AttentionParts or None, got {type(parts).__name__}")
        super().__init__(dim, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias,
                         layout="qkv" if kv_dim is None else "q_kv", kv_dim=kv_dim)
        self.kv_dim = None if kv_dim is None else int(kv_dim)
        parts = AttentionParts() if parts is None else parts
        parts.check(cls, self.dim, self.num_heads, self.num_kv_heads, self.head_dim)
        self.scores: Scores = parts.scores
        self.score_mod = parts.scores.score_mod  # an nn.Module becomes a submodule: its parameters train with this module
        self.causal = check_bool(causal, "causal", cls)
        self.window = normalize_window(window)
        check_probability(dropout, "dropout", cls)
        self.dropout = float(dropout)
        self.backend = check_backend(backend, cls)
        self.frontier = parts  # the checkpoint name of the parts (frontier.q_norm_weight, frontier.sinks, ...)
        self.rope: RotaryEmbedding | None = _resolve_rope(cls, rope, self.head_dim)
        self._alibi_cache: dict[torch.device, Tensor] = {}
        if self.kv_dim is not None and (self.causal or self.window is not None or self.rope is not None
                                        or self.alibi):
            raise ValueError(f"{cls}: a cross-attention module (kv_dim={self.kv_dim}) does not take causal, window, "
                             f"rope or alibi (they relate query and key positions of one sequence)")
        self._check_settings()

    def _check_settings(self) -> None:
        """A subclass's own checks of the built settings (none here)."""

    #: ``num_kv_heads`` an alias fixes (MQA: 1), or ``"required"`` (GQA); ``None``: free.
    _fixed_kv_heads: int | str | None = None
    #: the score this class computes (``SigmoidAttention``: ``"sigmoid"``)
    _score = "softmax"

    @property
    def parts(self) -> AttentionParts:
        """The injected :class:`~attnzoo.nn.parts.AttentionParts` (held as ``frontier``, its checkpoint name)."""
        return self.frontier

    @property
    def alibi(self) -> bool:
        """ALiBi biases on (``parts.scores.alibi``)."""
        return self.scores.alibi

    @property
    def scale(self) -> float | None:
        """Score scale (``None``: ``1 / sqrt(D)``)."""
        return self.scores.scale

    @property
    def sinks(self) -> nn.Parameter | None:
        """The learnable ``[H]`` sink logits (``sinks=True``), else ``None``."""
        return self.frontier.sinks

    # ------------------------------------------------------------------ caches
    def _structure(self) -> Mask | None:
        """A position pattern replacing ``causal``/``window`` (subclasses, e.g. local-global; a subclass
        with a pattern also defines ``_merge_structure(structure, mask, B, N, n_k, q_offset)``, which
        combines it with a user mask)."""
        return None

    def _sliding_left(self) -> int | None:
        """Left window bound when decoding can use a ring buffer, else ``None``."""
        if self._structure() is not None or not self.causal or self.window is None:
            return None
        return self.window[0]

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> KVCache | SlidingWindowKVCache:
        """A cache for decoding with this module: a :class:`SlidingWindowKVCache` of ``left`` slots for
        causal sliding-window attention, else a :class:`KVCache` of ``max_len`` slots (for a
        cross-attention module, ``max_len`` is the context length). Device/dtype default to the module's."""
        return super().init_cache(batch_size, max_len, device=device, dtype=dtype)  # type: ignore[no-any-return]

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str,
                   dtype: torch.dtype) -> KVCache | SlidingWindowKVCache:
        left = self._sliding_left()
        if left is not None and left < max_len:
            return SlidingWindowKVCache(batch_size, left, self.num_kv_heads, self.head_dim, max_len=max_len,
                                        device=device, dtype=dtype)
        return KVCache(batch_size, max_len, self.num_kv_heads, self.head_dim, device=device, dtype=dtype)

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
        cu_seqlens: Tensor | None = None,
        context_cu_seqlens: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x [B, N, C]`` to itself (or to ``context [B, M, kv_dim]``).

        Args:
            x: the queries' tokens (a floating tensor); with a cache, only the NEW tokens
                (positions ``cache.length ..``).
            context: keys/values source for cross-attention. With a cache on a cross-attention
                module, the context is projected once on the first call (``cache.length == 0``) and
                the cached keys are reused afterwards (``context`` may then be ``None``).
            mask: what :func:`attnzoo.attention` accepts (bool = may attend, float = additive bias,
                or an :class:`attnzoo.masks.Mask`), applied on top of causal/window. Its key axis
                is absolute: ``Nk`` = ``N`` (self), ``M`` (cross), or with a cache the number of
                tokens written after appending, ``cache.length + N`` (also for the sliding cache:
                the module slices the columns of the keys it holds).
            cache: from :meth:`init_cache`; updated in place. A call that raises leaves it unchanged.
            positions: int ``[N]`` or ``[B, N]`` absolute positions for RoPE (e.g. per-row positions
                with left padding). Default ``cache.length + arange(N)``. Causal, window and ALiBi
                use the token's index in the stream (its position in the cache).
            return_weights: also return the attention weights ``[B, H, N, Nk]`` (the reference
                backend; with a sliding cache over the keys it holds, in position order).
            cu_seqlens: packed input: ``x`` is ``[1, T, C]`` holding ``S`` sequences end to end and
                ``cu_seqlens`` their int32 cumulative lengths ``[S+1]``; RoPE positions restart at 0 in
                every sequence and attention runs through :func:`attnzoo.attention_varlen` (equal
                to running each sequence alone). Not with a cache, ``mask``, ``positions`` or
                ``return_weights``.
            context_cu_seqlens: with ``cu_seqlens``, packed cross-attention: ``context [1, Tk, kv_dim]``
                holds ``S`` context sequences (int32 ``[S+1]``, the same ``S``) and query sequence ``i``
                attends to context sequence ``i`` only (no position relation between them).

        Returns:
            ``out [B, N, C]``, or ``(out, weights)``.
        """
        x = self.check_call(x, cache, positions, return_weights, self._cache_types)
        if context_cu_seqlens is not None:
            return self.merge_heads(self.frontier.gate(self._packed_cross(
                x, cu_seqlens, context, context_cu_seqlens, mask, cache, positions, return_weights), x))
        if cu_seqlens is not None:
            return self.merge_heads(self.frontier.gate(self._packed(x, cu_seqlens, context, mask, cache, positions,
                                                                    return_weights), x))
        if self.kv_dim is not None or context is not None:
            out, weights = self.guarded(cache, lambda: self._cross(x, context, mask, cache, return_weights))
        else:
            out, weights = self.guarded(cache, lambda: self._self(x, mask, cache, positions, return_weights))
        y = self.merge_heads(self.frontier.gate(out, x))  # [B, N, C]
        return (y, weights) if return_weights else y

    # ------------------------------------------------------------------ internals
    #: the caches :meth:`forward` accepts
    _cache_types: tuple[type, ...] = (KVCache, SlidingWindowKVCache)

    def _score_extras(self, *, with_sinks: bool, key_start: int = 0) -> dict[str, Any]:
        """The optional keywords of ``attend``: ``softcap`` when set, ``sinks`` (``with_sinks``) when on,
        ``score_mod`` (its positions shifted by ``key_start``, the stream position of the first key
        held) when given; unset ones are left out, so a swapped ``attend_fn`` sees only what the
        module uses."""
        extra: dict[str, Any] = {} if self.scores.softcap is None else {"softcap": self.scores.softcap}
        if with_sinks and self.sinks is not None:
            extra["sinks"] = self.sinks
        if self.score_mod is not None:
            extra["score_mod"] = _shift_positions(self.score_mod, key_start)
        return extra

    def _slopes(self, device: torch.device) -> Tensor | None:
        if not self.alibi:
            return None
        s = self._alibi_cache.get(device)
        if s is None:
            s = alibi_slopes(self.num_heads, device=device)
            self._alibi_cache[device] = s
        return s

    def _core(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None, causal: bool,
              window: Any, q_offset: int | None, alibi: Tensor | None,
              return_weights: bool, key_start: int = 0) -> tuple[Tensor, Tensor | None]:
        extra = self._score_extras(with_sinks=True, key_start=key_start)
        res = self.attend(q, k, v, mask=mask, causal=causal, window=window, q_offset=q_offset, scale=self.scale,
                          alibi_slopes=alibi, dropout_p=self.dropout if self.training else 0.0,
                          return_weights=return_weights, backend=self.backend, **extra)
        if return_weights:
            return res[0], res[1]
        return res, None

    def _check_self_cache(self, cache: Cache | None) -> None:
        cls = type(self).__name__
        if cache is not None and not self.causal:
            raise ValueError(f"{cls}: decoding with a cache needs causal=True (a bidirectional layer would see "
                             f"tokens that are not generated yet)")
        if isinstance(cache, SlidingWindowKVCache):
            if self._structure() is not None or self.window is None or self.window[0] is None:
                raise TypeError(f"{cls}: a SlidingWindowKVCache needs a causal module with a left window; "
                                f"use module.init_cache()")
            if cache.window != self.window[0]:
                raise ValueError(f"{cls}: the cache keeps window={cache.window} keys, the module needs "
                                 f"{self.window[0]}; use module.init_cache()")

    def _self(self, x: Tensor, mask: Tensor | Mask | None, cache: Cache | None, positions: Tensor | None,
              return_weights: bool) -> tuple[Tensor, Tensor | None]:
        self._check_self_cache(cache)
        B, N, _ = x.shape
        start = 0 if cache is None else cache.length
        total = start + N
        _check_mask(type(self).__name__, mask, B, self.num_heads, N, total)  # before anything is written
        q, k, v = self._project_self(x, positions, start, rotate=True)
        if cache is not None:
            k, v, _ = cache.update(k, v)  # the keys the new queries may need, in position order
        return self._attend_keys(q, k, v, mask, start, total - k.shape[2], return_weights, decoding=cache is not None)

    def _project_self(self, x: Tensor, positions: Tensor | None, start: int, *,
                      rotate: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, N, D]``, ``k, v [B, Hkv, N, D]`` of ``x``'s tokens at ``start ..`` (QK-norm, then RoPE
        at ``positions`` when ``rotate``)."""
        B, N, _ = x.shape
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # [B, N, (H + 2 Hkv) D]
        qk_, v_ = qkv.split(((H + Hkv) * self.head_dim, Hkv * self.head_dim), dim=-1)
        qk = self.split_heads(qk_)  # [B, H + Hkv, N, D]: q and k heads side by side
        v = self.split_heads(v_)  # [B, Hkv, N, D]
        if self.frontier.q_norm is not None:
            qk = torch.cat((self.frontier.norm_q(qk[:, :H]), self.frontier.norm_k(qk[:, H:])), dim=1)
        if self.rope is not None and rotate:  # one rotation for the q and k heads together
            qk = self._rotate(qk, resolve_positions(positions, N, start, x.device, batch=B))
        return qk[:, :H], qk[:, H:], v  # [B, H, N, D], [B, Hkv, N, D], [B, Hkv, N, D]

    def _rotate(self, t: Tensor, positions: Tensor) -> Tensor:
        """RoPE of ``t [B, h, N, D]`` at ``positions`` ``[N]`` or ``[B, N]`` (identity without RoPE)."""
        if self.rope is None:
            return t
        cos, sin = self.rope.cos_sin(positions, torch.float64 if t.dtype == torch.float64 else torch.float32)
        return self.rope.rotate(t, cos, sin)

    def _attend_keys(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Mask | None, start: int, first: int,
                     return_weights: bool, *, decoding: bool) -> tuple[Tensor, Tensor | None]:
        """Attend from queries at ``start ..`` to keys at the contiguous positions ``first ..``:
        the core applies causal, window and ALiBi through ``q_offset``; a user mask over absolute
        key positions is sliced (tensor) or shifted (Mask) to the held keys. Without a cache the
        request reaches ``attend`` as the module states it (a swapped ``attend_fn``, e.g. ring
        attention over a sharded sequence, sees the module's own causal/window)."""
        B, _, N, _ = q.shape
        total = start + N
        structure = self._structure()
        causal, window = self.causal, self.window
        if structure is not None:
            mask = self._merge_structure(structure, mask, B, N, k.shape[2], start)
            causal, window = False, None
        elif window is not None and window[0] is not None and causal and not return_weights:
            skip = max(0, start - window[0] - first)  # keys left of the first query's window: invisible
            if skip:
                k, v, first = k[:, :, skip:], v[:, :, skip:], first + skip
        if structure is None:
            mask = _shift_mask(mask, first, total)
        q_offset, n_k = start - first, k.shape[2]
        if decoding and N == 1 and structure is None and q_offset == n_k - 1:
            # One query at the last position: causality hides nothing, nor does a window that
            # reaches the first key.
            causal = False
            if window is not None and (window[0] is None or q_offset - window[0] <= 0):
                window = None
        return self._core(q, k, v, mask=mask, causal=causal, window=window, q_offset=q_offset,
                          alibi=self._slopes(q.device), return_weights=return_weights, key_start=first)

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        for name, value, default in (("kv_dim", self.kv_dim, None), ("causal", self.causal, False),
                                     ("window", self.window, None), ("alibi", self.alibi, False),
                                     ("softcap", self.scores.softcap, None),
                                     ("dropout", self.dropout, 0.0), ("backend", self.backend, "auto")):
            if value != default:
                s += f", {name}={value!r}"
        return s


def _alias_kv_heads(fixed: int | str | None, owner: str, num_kv_heads: int | None) -> int | None:
    """``num_kv_heads`` as an alias class allows it: ``fixed`` an int (MQA: 1), ``"required"`` (GQA)
    or ``None`` (free)."""
    if fixed == "required" and num_kv_heads is None:
        raise TypeError(f"{owner}: num_kv_heads is required (the number of KV groups)")
    if isinstance(fixed, int):
        if num_kv_heads not in (None, fixed):
            raise TypeError(f"{owner} has num_kv_heads={fixed}; use GroupedQueryAttention for other values")
        return fixed
    return num_kv_heads


def _check_mask(cls: str, mask: object, B: int, H: int, N: int, n_k: int) -> None:
    """A user mask must be None, a Mask, or a bool/float tensor broadcastable to ``[B, H, N, n_k]``
    (checked before a cache is written, so a bad mask changes nothing)."""
    if mask is None or isinstance(mask, Mask):
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{cls}: mask must be None, a bool/float tensor or an attnzoo.masks.Mask, got "
                        f"{type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{cls}: mask must be bool (True = attend) or float (additive bias), got {mask.dtype}")
    want = [B, H, N, n_k]
    if mask.dim() < 2 or mask.dim() > 4:
        raise ValueError(f"{cls}: mask must have rank 2 to 4 and broadcast to [B, H, N, Nk] = {want}, got "
                         f"{tuple(mask.shape)}")
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    for got, size, letter in zip(shape, want, ("B", "H", "N", "Nk"), strict=True):
        if got not in (1, size):
            raise ValueError(f"{cls}: mask {tuple(mask.shape)} does not broadcast to [B, H, N, Nk] = {want} "
                             f"(dimension {letter}: got {got}, expected 1 or {size}; with a cache Nk is "
                             f"cache.length + N, the absolute key axis)")


def _shift_positions(score_mod: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor],
                     start: int) -> Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]:
    """``score_mod`` seeing positions ``start`` higher (keys held from stream position ``start``)."""
    if start == 0:
        return score_mod

    def shifted(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score_mod(s, b, h, q_idx + start, kv_idx + start)

    return shifted


def _shift_mask(mask: Tensor | Mask | None, first: int, total: int) -> Tensor | Mask | None:
    """A user mask over absolute keys ``0 .. total - 1`` restricted to the keys ``first ..``."""
    if first == 0 or mask is None:
        return mask
    if isinstance(mask, Tensor):
        return mask[..., first:] if mask.shape[-1] == total else mask
    if mask.relative:  # depends on q_pos - k_pos only: a shift of both changes nothing
        return mask
    inner = mask
    return Mask(lambda b, h, q, k: inner(b, h, q + first, k + first), f"{inner.name}@+{first}", batch=inner.batch)


# --------------------------------------------------------------------------- aliases
class MultiQueryAttention(MultiHeadAttention):
    """Multi-query attention (Shazeer, 2019): every query head shares ONE key/value head.

    ``MultiHeadAttention(dim, num_heads, num_kv_heads=1, ...)``; the cache holds ``1 / H`` of
    MHA's bytes. Arguments as :class:`MultiHeadAttention` (``num_kv_heads`` other than 1 is a
    ``TypeError``).
    """

    _fixed_kv_heads = 1


class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention (Ainslie et al., 2023): ``num_kv_heads`` KV heads, each shared by
    ``num_heads // num_kv_heads`` query heads (head ``h`` reads KV head ``h // group``).

    ``MultiHeadAttention(dim, num_heads, num_kv_heads=num_kv_heads, ...)``, same arguments, except that
    ``num_kv_heads`` must be given (a ``TypeError`` without it: GQA without groups is MHA); the cache
    holds ``num_kv_heads / num_heads`` of MHA's bytes.
    """

    _fixed_kv_heads = "required"


class SlidingWindowAttention(MultiHeadAttention):
    """Causal sliding-window attention (Longformer/Mistral style): each query sees itself and the
    ``window`` keys before it; decoding uses a :class:`SlidingWindowKVCache` of ``window`` slots.

    Mistral's ``sliding_window=W`` is ``window=W - 1``. ``MultiHeadAttention(dim, num_heads,
    window=window, causal=causal, ...)``; with ``causal=False`` the window is two-sided. The other
    arguments are :class:`MultiHeadAttention`'s, keyword-only.

    StreamingLLM (Xiao et al., 2023): ``sink_tokens=n > 0`` builds a :class:`StreamingAttention`: the
    first ``n`` tokens stay visible to every query, plus the window, decoded with a
    :class:`SinkWindowKVCache` of ``n + w`` slots; it also takes ``position_mode`` (see there).
    """

    _cache_types = (KVCache, SlidingWindowKVCache, SinkWindowKVCache)

    def __init__(self, dim: int, num_heads: int, window: int, causal: bool = True, sink_tokens: int = 0, *,
                 num_kv_heads: int | None = None, head_dim: int | None = None, bias: bool = True,
                 rope: bool | RotaryEmbedding | None = None, dropout: float = 0.0, backend: str = "auto",
                 parts: AttentionParts | None = None) -> None:
        cls = type(self).__name__
        for name, value in (("window", window), ("sink_tokens", sink_tokens)):
            check_int(value, name, cls, minimum=0)
        super().__init__(dim, num_heads, num_kv_heads, None, head_dim, bias, causal, window, rope, dropout, backend,
                         parts=parts)
        if sink_tokens and (not causal or self.alibi or self._score != "softmax"):
            raise ValueError(f"{cls}: sink_tokens (StreamingLLM) needs causal=True softmax attention without "
                             f"alibi, got causal={causal}, alibi={self.alibi}, score={self._score!r}")
        self.window_size, self.sink_tokens, self.position_mode = window, sink_tokens, "absolute"

    def __new__(cls, *args: Any, **kwargs: Any) -> SlidingWindowAttention:
        """``SlidingWindowAttention(..., sink_tokens=n)`` with ``n > 0`` is a :class:`StreamingAttention`
        (Python then runs ``StreamingAttention.__init__`` with the same arguments)."""
        sinks = kwargs.get("sink_tokens", args[4] if len(args) > 4 else 0)
        if cls is SlidingWindowAttention and isinstance(sinks, int) and not isinstance(sinks, bool) and sinks > 0:
            cls = StreamingAttention
        return super().__new__(cls)

    __new__.__signature__ = inspect.signature(__init__)  # type: ignore[attr-defined]  # help(): __init__'s arguments

    def _self(self, x: Tensor, mask: Tensor | Mask | None, cache: Any, positions: Tensor | None,
              return_weights: bool) -> tuple[Tensor, Tensor | None]:
        if isinstance(cache, SinkWindowKVCache):
            raise TypeError(f"{type(self).__name__}: a module with sink_tokens=0 (no sink tokens) decodes with a KVCache or "
                            f"SlidingWindowKVCache, got SinkWindowKVCache; use module.init_cache()")
        return super()._self(x, mask, cache, positions, return_weights)


class StreamingAttention(SlidingWindowAttention):
    """StreamingLLM attention (Xiao et al., 2023): a causal sliding window plus ``sink_tokens`` first
    tokens every query sees, decoded with a :class:`SinkWindowKVCache` of ``n + w`` slots (the
    ``streaming`` variant). What ``SlidingWindowAttention(..., sink_tokens=n)`` builds for ``n > 0``;
    arguments as :class:`SlidingWindowAttention` (``sink_tokens >= 1``, no attention dropout), plus

    ``position_mode``: ``"absolute"`` (RoPE at the tokens' absolute positions) or ``"cache"`` (the
    paper's: positions counted inside the cache, keys stored before RoPE and re-rotated at their cache
    slots every step); see :mod:`attnzoo.nn.streaming` and ``docs/softmax-frontier.md``. A cached
    call (and any call in ``"cache"`` mode) returns no weights; no ``alibi``."""

    _cache_types = (KVCache, SlidingWindowKVCache, SinkWindowKVCache)

    def __init__(self, dim: int, num_heads: int, window: int, causal: bool = True, sink_tokens: int = 1,
                 position_mode: str = "absolute", *, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = True, rope: bool | RotaryEmbedding | None = None, backend: str = "auto",
                 parts: AttentionParts | None = None) -> None:
        check_choice(position_mode, "position_mode", "StreamingAttention", choices=POSITION_MODES)
        super().__init__(dim, num_heads, window, causal, sink_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         bias=bias, rope=rope, backend=backend, parts=parts)
        if not self.sink_tokens:
            raise ValueError("StreamingAttention: sink_tokens must be >= 1 (use SlidingWindowAttention for none)")
        self.position_mode = position_mode

    def _structure(self) -> Mask | None:
        return streaming_pattern(self.window_size, self.sink_tokens)

    def _merge_structure(self, structure: Mask, mask: Tensor | Mask | None, B: int, N: int, n_k: int,
                         q_offset: int) -> Tensor | Mask:
        if mask is None or isinstance(mask, Mask):
            return structure if mask is None else structure & mask
        allowed = structure.materialize(B, 1, N, n_k, q_offset=q_offset, device=mask.device)  # [B, 1, N, Nk]
        if mask.dtype == torch.bool:
            return allowed & mask
        return torch.where(allowed, mask, torch.full((), float("-inf"), dtype=mask.dtype, device=mask.device))

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str,
                   dtype: torch.dtype) -> Any:
        return SinkWindowKVCache(batch_size, self.sink_tokens, self.window_size, self.num_kv_heads, self.head_dim,
                                 max_len=max_len, device=device, dtype=dtype)

    def _self(self, x: Tensor, mask: Tensor | Mask | None, cache: Any, positions: Tensor | None,
              return_weights: bool) -> tuple[Tensor, Tensor | None]:
        cls = type(self).__name__
        if cache is not None and not isinstance(cache, SinkWindowKVCache):
            raise TypeError(f"{cls}: a module with sink_tokens={self.sink_tokens} decodes with a SinkWindowKVCache, "
                            f"got {type(cache).__name__}; use module.init_cache()")
        if cache is not None and (cache.sink_tokens, cache.window) != (self.sink_tokens, self.window_size):
            raise ValueError(f"{cls}: the cache keeps sink_tokens={cache.sink_tokens}, window={cache.window}; the "
                             f"module needs sink_tokens={self.sink_tokens}, window={self.window_size}; use "
                             f"module.init_cache()")
        padded = padding_offsets(mask, x.shape[1] + (0 if cache is None else cache.length))  # left padding
        if cache is None and self.position_mode == "absolute" and padded is None:
            return MultiHeadAttention._self(self, x, mask, cache, positions, return_weights)
        if return_weights or (positions is not None and self.position_mode == "cache"):
            raise ValueError(f"{cls}: with sink tokens, a cached call or position_mode='cache' takes no "
                             f"return_weights, and position_mode='cache' no positions (it counts them in the cache)")
        return self._stream(x, mask, cache, positions), None

    def _stream(self, x: Tensor, mask: Tensor | Mask | None, cache: SinkWindowKVCache | None,
                positions: Tensor | None) -> Tensor:
        """StreamingLLM attention of ``x``'s tokens (see :mod:`attnzoo.nn.streaming`): ``[B, H, N, D]``."""
        B, N, _ = x.shape
        n, w, in_cache = self.sink_tokens, self.window_size, self.position_mode == "cache"
        start = 0 if cache is None else cache.length
        total = start + N
        _check_mask(type(self).__name__, mask, B, self.num_heads, N, total)
        q, k, v = self._project_self(x, positions, start, rotate=not in_cache)
        offsets = padding_offsets(mask, total)  # left padding: each row's sinks start at its first real token
        if offsets is not None:
            return self._stream_padded(q, k, v, mask, offsets, cache, start)  # type: ignore[arg-type]
        k, v, k_pos = (k, v, torch.arange(N, device=x.device)) if cache is None else cache.update(k, v)
        q_pos = torch.arange(start, total, device=x.device)
        if in_cache and cache is not None and N == 1:  # the paper's step: re-rotate at the cache slots
            ranks = torch.arange(k.shape[2], device=x.device)
            return self._part(self._rotate(q, ranks[-1:]), self._rotate(k, ranks), v,
                              mask_at(mask, k_pos, total, B, self.num_heads, q_pos), False, None, 0, True)[0]
        # Keys come in position order: the sinks 0 .. ns - 1, then the window keys, contiguous up to the
        # newest token; both counts are Python ints (no read-back of k_pos under torch.compile).
        ns = min(total, n)
        first = total - (k.shape[2] - ns)
        q_sink = self._rotate(q, sink_query_positions(q_pos, w, n)) if in_cache else q
        k_sink = self._rotate(k[:, :, :ns], k_pos[:ns]) if in_cache else k[:, :, :ns]
        sink_mask = mask[..., :ns] if isinstance(mask, Tensor) and mask.shape[-1] == total else mask
        o, lse = self._part(q_sink, k_sink, v[:, :, :ns], sink_mask, True, None, start, True)
        outs, lses = [o], [lse]
        if ns < k.shape[2]:  # the window keys (positions >= n, contiguous)
            q_win = self._rotate(q, q_pos) if in_cache else q
            k_win = self._rotate(k[:, :, ns:], k_pos[ns:]) if in_cache else k[:, :, ns:]
            o, lse = self._part(q_win, k_win, v[:, :, ns:], _shift_mask(mask, first, total), True, (w, 0),
                                start - first, False, key_start=first)
            outs.append(o)
            lses.append(lse)
        return merge_attention(outs, lses)[0] if len(outs) > 1 else outs[0]

    def _stream_padded(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, offsets: Tensor,
                       cache: SinkWindowKVCache | None, start: int) -> Tensor:
        """:meth:`_stream` of left-padded rows (absolute positions): the sinks of row ``b`` are its tokens
        ``P_b .. P_b + n - 1`` (:mod:`attnzoo.nn.streaming`)."""
        if self.position_mode == "cache":
            raise ValueError(f"{type(self).__name__}: position_mode='cache' takes no padding mask (a key-only mask "
                             f"hiding a row's first keys); use position_mode='absolute'")
        B, Hkv, N, D = k.shape
        n, total = self.sink_tokens, start + N
        ns = min(total, n)
        if cache is None:  # every key is here: row b's sinks gathered at P_b + i, the window over all keys
            idx = (offsets.view(B, 1) + torch.arange(ns, device=k.device)).clamp(max=total - 1)
            idx = idx.view(B, 1, ns, 1)
            k_s, v_s = k.gather(2, idx.expand(B, Hkv, ns, D)), v.gather(2, idx.expand(B, Hkv, ns, v.shape[-1]))
            k_w, v_w, first = k, v, 0
        else:
            k_all, v_all, _ = cache.update(k, v, sink_offsets=offsets)
            k_s, v_s = cache.sink_keys()  # after the update: every sink a query of this call may see
            held_sinks = min(start, n) if N > 1 else ns  # the sink slots at the front of the result
            k_w, v_w = k_all[:, :, held_sinks:], v_all[:, :, held_sinks:]
            first = total - k_w.shape[2]  # window keys: contiguous positions first .. total - 1
        q_pos = torch.arange(start, total, device=q.device)
        sink_mask, win_mask = padded_parts(mask, offsets, n, q_pos, ns,
                                           torch.arange(first, total, device=q.device))
        o, lse = self._part(q, k_s, v_s, sink_mask, False, None, 0, True)
        o_w, lse_w = self._part(q, k_w, v_w, win_mask, True, (self.window_size, 0), start - first, False)
        return merge_attention([o, o_w], [lse, lse_w])[0]

    def _part(self, q: Tensor, k: Tensor, v: Tensor, mask: Any, causal: bool, window: Any, q_offset: int,
              with_sinks: bool, key_start: int = 0) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of one part of the keys (the learnable sink logits go into one part only;
        its keys start at stream position ``key_start``, for a ``score_mod``)."""
        extra = self._score_extras(with_sinks=with_sinks, key_start=key_start)
        out, lse = self.attend(q, k, v, mask=mask, causal=causal, window=window, q_offset=q_offset, scale=self.scale,
                               dropout_p=self.dropout if self.training else 0.0, return_lse=True,
                               backend=self.backend, **extra)
        return out, lse

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sink_tokens={self.sink_tokens}, position_mode={self.position_mode!r}"


class SigmoidAttention(MultiHeadAttention):
    """Sigmoid attention (Ramapuram et al., 2024): ``sigmoid(q k^T * scale + b)`` in place of the
    softmax, no normaliser (:func:`attnzoo.sigmoid_attention`), behind the ``sigmoid`` variant.

    Arguments as :class:`MultiHeadAttention` without ``dropout``, plus ``sigmoid_bias``: ``b``
    (``None``: ``-log(Nk)`` of each call, so decoding through a cache needs a fixed value). The
    parts take no ``sinks``, ``alibi`` or ``score_mod`` (nothing to normalise against); backend
    ``auto``, ``reference`` or ``tiled``.
    """

    _score = "sigmoid"
    #: the attend seam calls :func:`attnzoo.sigmoid_attention` (context parallelism swaps it)
    default_attend = staticmethod(sigmoid_attention)

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, kv_dim: int | None = None,
                 head_dim: int | None = None, bias: bool = True, causal: bool = False,
                 window: int | tuple[int | None, int | None] | None = None, rope: bool | RotaryEmbedding | None = None,
                 backend: str = "auto", *, sigmoid_bias: float | None = None,
                 parts: AttentionParts | None = None) -> None:
        if sigmoid_bias is not None and (isinstance(sigmoid_bias, bool) or not isinstance(sigmoid_bias, (int, float))):
            raise TypeError(f"SigmoidAttention: sigmoid_bias must be a float or None, got "
                            f"{type(sigmoid_bias).__name__} ({sigmoid_bias!r})")
        if sigmoid_bias is not None and not math.isfinite(sigmoid_bias):
            raise ValueError(f"SigmoidAttention: sigmoid_bias must be a finite float or None, got {sigmoid_bias!r}")
        super().__init__(dim, num_heads, num_kv_heads, kv_dim, head_dim, bias, causal, window, rope, 0.0, backend,
                         parts=parts)
        self._bias = None if sigmoid_bias is None else float(sigmoid_bias)

    @property
    def sigmoid_bias(self) -> float | None:
        """``b`` of ``sigmoid(q k^T * scale + b)`` (``None``: ``-log(Nk)`` of each call)."""
        return self._bias

    def _check_settings(self) -> None:
        p = self.frontier
        if p.sinks is not None or p.scores.alibi or p.scores.score_mod is not None:
            raise ValueError(f"{type(self).__name__}: sigmoid scores have no softmax normaliser; parts must have no "
                             f"sinks, alibi or score_mod (got sinks={p.sinks is not None}, alibi={p.scores.alibi}, "
                             f"score_mod={p.scores.score_mod})")
        if self.backend not in ("auto", "reference", "tiled"):
            raise ValueError(f"{type(self).__name__}: sigmoid attention runs on backend 'auto', 'reference' or "
                             f"'tiled', got backend={self.backend!r}")

    def _core(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None, causal: bool,
              window: Any, q_offset: int | None, alibi: Tensor | None,
              return_weights: bool, key_start: int = 0) -> tuple[Tensor, Tensor | None]:
        res = self.attend(q, k, v, bias=self.sigmoid_bias, causal=causal, window=window, mask=mask,
                          scale=self.scale, softcap=self.scores.softcap, q_offset=q_offset,
                          return_weights=return_weights, backend=self.backend)
        return (res[0], res[1]) if return_weights else (res, None)

    def _check_self_cache(self, cache: Cache | None) -> None:
        if cache is not None and self.sigmoid_bias is None:
            raise ValueError(f"{type(self).__name__}: decoding score='sigmoid' with a cache needs a fixed sigmoid_bias "
                             f"(the default -log(Nk) changes with the number of keys each call sees); build with "
                             f"sigmoid_bias=...")
        super()._check_self_cache(cache)


# --------------------------------------------------------------------------- variant specs
def default_kv_heads(num_heads: int) -> int:
    """GQA's default number of KV heads: a quarter of the query heads (LLaMA-style), but at least
    two so that ``gqa`` stays distinct from ``mqa`` (one KV head) at small head counts."""
    check_int(num_heads, "num_heads", "default_kv_heads")
    kv = num_heads // 4 if num_heads // 4 >= 2 else max(1, num_heads // 2)
    while num_heads % kv:
        kv -= 1
    return kv


#: the builders' keyword settings that become the injected :class:`~attnzoo.nn.parts.AttentionParts`
PART_SETTINGS = ("alibi", "scale", "softcap", "score_mod", "sinks", "qk_norm", "qk_norm_eps", "output_gate")


def build_softmax(cls: type[MultiHeadAttention], dim: int, num_heads: int, *, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None, **settings: Any) -> nn.Module:
    """``cls(dim, num_heads, ..., parts=...)`` from keyword settings (what ``attention_kwargs`` dicts and
    :func:`attnzoo.variants.build_attention` carry): the :data:`PART_SETTINGS` (``qk_norm="head"``,
    ``sinks=True``, ``softcap=...``) become :func:`~attnzoo.nn.parts.parts_from_settings`; ``score="sigmoid"``
    makes a :class:`SigmoidAttention` (only from ``MultiHeadAttention``); ready-made ``parts=`` pass through
    instead. The module is built on ``device`` and cast to ``dtype`` (a given rotary embedding and
    ``score_mod`` keep theirs). The rest goes to ``cls`` as is."""
    part_kw = {k: settings.pop(k) for k in PART_SETTINGS if k in settings}
    score = settings.pop("score", cls._score)
    if score not in ("softmax", "sigmoid") or (score != cls._score and cls is not MultiHeadAttention):
        raise ValueError(f"{cls.__name__}: score must be {cls._score!r} (or 'sigmoid' for MultiHeadAttention), "
                         f"got {score!r}")
    if score == "sigmoid" or cls is StreamingAttention:  # no attention dropout there
        cls = SigmoidAttention if score == "sigmoid" else cls
        if settings.pop("dropout", 0.0):
            raise ValueError(f"{cls.__name__} takes no attention dropout; use dropout=0.0")
    parts = settings.pop("parts", None)  # parts built by the caller, or the keywords' parts: not both
    if parts is not None and part_kw:
        raise ValueError(f"{cls.__name__}: pass parts= or the part keywords {sorted(part_kw)}, not both")
    with contextlib.nullcontext() if device is None else torch.device(device):
        if part_kw:
            fixed = cls._fixed_kv_heads if isinstance(cls._fixed_kv_heads, int) else None
            parts = parts_from_settings(dim, num_heads, settings.get("num_kv_heads", fixed), settings.get("head_dim"),
                                        **part_kw)
        module = cls(dim, num_heads, parts=parts, **settings)
    return placed(module, dtype, keep=(module.rope, module.score_mod))


def _build_mha(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    return build_softmax(MultiHeadAttention, dim, num_heads, causal=causal, **kw)


def _build_mqa(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    return build_softmax(MultiQueryAttention, dim, num_heads, causal=causal, **kw)


def _build_gqa(dim: int, num_heads: int, *, causal: bool = True, num_kv_heads: int | None = None,
               **kw: Any) -> nn.Module:
    kv = num_kv_heads if num_kv_heads is not None else default_kv_heads(num_heads)
    return build_softmax(GroupedQueryAttention, dim, num_heads, num_kv_heads=kv, causal=causal, **kw)


def _build_sliding(dim: int, num_heads: int, *, causal: bool = True, window: int = 64, **kw: Any) -> nn.Module:
    return build_softmax(SlidingWindowAttention, dim, num_heads, window=window, causal=causal, **kw)


def _dense_cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    return softmax_cost(cfg, shape)


def _sliding_cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    return softmax_cost(cfg, shape, ring=True)


def _arena_window(width: int, heads: int, window: int | None) -> dict[str, Any]:
    return {} if window is None else {"window": window}


_DENSE = {"family": "softmax", "exact": True, "time": "O(N C^2 + N^2 C)", "memory": "O(N) (fused/tiled)",
          "cost": _dense_cost, "masks": "any", "ring": True, "positions": "rope"}
register(VariantSpec("mha", decoding="K,V of every head (of each KV group with num_kv_heads)", build=_build_mha,
                     options=("num_kv_heads",), order=0, arena_default=True, **_DENSE))
register(VariantSpec("mqa", decoding="K,V of one shared head", build=_build_mqa, kv_heads=lambda h, g: 1,
                     order=1, arena_default=True, **_DENSE))
register(VariantSpec("gqa", decoding="K,V of each KV group", build=_build_gqa, options=("num_kv_heads",),
                     kv_heads=lambda h, g: default_kv_heads(h) if g is None else g, order=2, arena_default=True,
                     **_DENSE))
register(VariantSpec("sliding", "softmax", True, "O(N C^2 + N W C)", "O(N W) tiled", "last W keys (ring buffer)",
                     _build_sliding, _sliding_cost, defaults={"window": 64}, options=("num_kv_heads", "window"),
                     check={"window": 6}, arena=_arena_window, masks="causal, window, padding", ring=True, order=3, positions="rope",
                     arena_default=True))


def _sigmoid_cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """Sigmoid attention runs on ``reference`` or ``tiled`` only (``auto``: ``tiled``), with the
    scores of a softmax layer."""
    if shape.backend not in ("auto", "reference", "tiled", "ideal"):
        raise ValueError(f"sigmoid: sigmoid attention runs on backend 'auto', 'reference' or 'tiled', "
                         f"got backend={shape.backend!r}")
    if shape.backend == "auto":
        shape = dataclasses.replace(shape, backend="tiled")
    return softmax_cost(cfg, shape)


def _build_sigmoid(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    return build_softmax(SigmoidAttention, dim, num_heads, causal=causal, **kw)


#: the ``sigmoid`` variant's default bias: the paper's ``b = -log(n)`` at ``n = 64`` tokens, fixed so a
#: cached decode equals the full forward (pass ``sigmoid_bias=-math.log(n)`` for your length)
SIGMOID_BIAS = -math.log(64)
register(VariantSpec("sigmoid", "sigmoid", False, "O(N C^2 + N^2 C)", "O(N) (tiled)", "K,V of every head",
                     _build_sigmoid, _sigmoid_cost, defaults={"sigmoid_bias": SIGMOID_BIAS}, options=("num_kv_heads",),
                     check={"sigmoid_bias": -2.0}, masks="causal, window, any mask", positions="rope", order=18))


def _streaming_sinks(global_tokens: tuple[int, ...]) -> int:
    """The number of sink tokens of ``streaming``'s ``global_tokens`` (the builder's and the cost's rule)."""
    sinks = tuple(global_tokens)
    if sinks != tuple(range(len(sinks))):
        raise ValueError(f"streaming: the sink tokens are the first n positions, global_tokens must be "
                         f"(0, 1, ..., n - 1), got {sinks}")
    return len(sinks)


def _build_streaming(dim: int, num_heads: int, *, causal: bool = True, window: int = 64,
                     global_tokens: tuple[int, ...] = (0, 1, 2, 3), **kw: Any) -> nn.Module:
    return build_softmax(StreamingAttention, dim, num_heads, window=window, causal=causal,
                         sink_tokens=_streaming_sinks(global_tokens), **kw)


def _streaming_cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """The causal ``window | sinks`` pattern (the sinks are global tokens ``0 .. n - 1``; under causality
    their rows see only sinks) and a cache of at most ``n + w`` tokens."""
    n_sinks = _streaming_sinks(cfg.global_tokens)
    cost = softmax_cost(cfg, shape)
    left = cfg.window[0] if cfg.window is not None and cfg.window[0] is not None else 0
    kv_max = n_sinks + left
    return dataclasses.replace(cost, kv_cache_max_tokens=kv_max,
                               kv_cache_bytes=shape.batch * min(shape.seq_len, kv_max) * cost.kv_cache_bytes_per_token)


register(VariantSpec("streaming", "softmax", True, "O(N C^2 + N (W + S) C)", "O(N (W + S)) tiled",
                     "S sink tokens + last W keys (sink+ring buffer)", _build_streaming, _streaming_cost,
                     defaults={"window": 64, "global_tokens": (0, 1, 2, 3)},
                     options=("num_kv_heads", "window", "global_tokens"), causal_modes=(True,),
                     check={"window": 4, "global_tokens": (0, 1)}, arena=_arena_window,
                     masks="causal, window, sink tokens, padding", order=5, positions="rope"))
