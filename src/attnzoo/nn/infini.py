"""Infini-attention module (Munkhdalai et al. 2024): local causal softmax + compressive memory.

The math lives in :func:`attnzoo.functional.feature_maps.infini.infini_attention`; this module owns the
projections ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, the per-head gate and the cache
(:class:`InfiniCache`: the memory plus the current partial segment, never more).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_choice, check_int
from attnzoo.functional.core._request import normalize_window
from attnzoo.functional.feature_maps.infini import UPDATES, InfiniState, infini_attention
from attnzoo.masks import Mask
from attnzoo.nn.base import AttentionBase, check_backend
from attnzoo.nn.cache import SnapshotCache
from attnzoo.nn.costs import projection_cost, visible_pairs
from attnzoo.nn.feature_attention import key_padding_from_mask, refuse_context
from attnzoo.nn.packing import check_packed_call, run_per_sequence
from attnzoo.nn.spec import Cost, CostShape, VariantConfig, VariantSpec, register

__all__ = ["InfiniAttention", "InfiniCache"]


class InfiniCache(SnapshotCache):
    """Decoding/streaming state of :class:`InfiniAttention`.

    Holds an :class:`~attnzoo.functional.feature_maps.infini.InfiniState`: memory ``M [B, H, D, D]`` and
    ``z [B, H, D]`` (float32) plus the keys/values of the current partial segment (fewer than
    ``segment_len`` tokens). Its size is bounded by the memory plus one segment, whatever the
    number of tokens fed. Protocol (``attnzoo.nn.cache``): ``length``, ``batch_size``, ``nbytes``,
    ``reset()``, ``mark()``/``rollback()`` and :meth:`update`, which stores the state after ``n``
    more tokens and returns ``(memory, norm, positions)`` with the new tokens' positions ``[n]``.
    """

    snapshot = ("length", "state")
    _batch_tensors = ("state",)

    def __init__(self, batch_size: int, num_heads: int, head_dim: int, segment_len: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self._set_sizes(batch_size, num_heads=num_heads, head_dim=head_dim, segment_len=segment_len)
        self._device = device
        self._dtype = dtype
        self.state = InfiniState.empty(self._batch_size, self.num_heads, self.head_dim, self.head_dim,
                                       device=device, dtype=dtype)

    @property
    def memory(self) -> Tensor:
        """``M [B, H, D, D]``."""
        return self.state.memory

    @property
    def norm(self) -> Tensor:
        """``z [B, H, D]``."""
        return self.state.norm

    @property
    def nbytes(self) -> int:
        """Bytes held now (at most memory + one segment of keys and values)."""
        return self.state.nbytes()

    def max_nbytes(self) -> int:
        """Upper bound of :attr:`nbytes`: memory plus a full segment of K/V (and padding flags)."""
        b, h, d = self._batch_size, self.num_heads, self.head_dim
        mem = (b * h * d * d + b * h * d) * self.state.memory.element_size()
        seg = 2 * b * h * (self.segment_len - 1) * d * self.state.seg_k.element_size() + b * (self.segment_len - 1)
        return mem + seg

    def reset(self) -> None:
        """Forget every token."""
        self.state = InfiniState.empty(self._batch_size, self.num_heads, self.head_dim, self.head_dim,
                                       device=self._device, dtype=self._dtype)
        self.length = 0

    def update(self, state: InfiniState, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Store ``state`` (after ``n`` more tokens); return ``(memory, norm, positions [n])``."""
        if not isinstance(state, InfiniState):
            raise TypeError(f"InfiniCache.update: state must be an InfiniState, got {type(state).__name__}")
        self.state = state
        return self.memory, self.norm, self.advance(n, self.memory.device)

    def __repr__(self) -> str:
        return (f"InfiniCache(batch_size={self.batch_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"segment_len={self.segment_len}, length={self.length}, segment_fill={self.state.fill})")


class InfiniAttention(AttentionBase):
    """Multi-head Infini-attention; causal by construction.

    Each segment of ``segment_len`` tokens uses exact causal softmax attention over its own keys
    (:func:`attnzoo.attention` with ``backend`` and ``window``) and retrieves from a per-head,
    per-batch-element compressive memory of all earlier segments; a learnable per-head gate
    ``sigmoid(gate[h])`` (initialised at 0.5) mixes the two. See
    :mod:`attnzoo.functional.feature_maps.infini` for the formulas.

    Args:
        dim: model width ``C``.
        num_heads: heads ``H``.
        segment_len: tokens per segment ``L >= 1`` (the last segment may be shorter).
        update: memory update rule, ``"linear"`` or ``"delta"``.
        head_dim: ``D`` (default ``C // H``).
        bias: biases in the projections.
        backend: :func:`attnzoo.attention` backend of the local attention.
        window: optional window of the local attention inside a segment (with causal).
        device, dtype: of the parameters.

    Shapes: ``[B, N, C] -> [B, N, C]``. Masks: key padding only.
    """

    no_weights_reason = "the memory has no attention matrix"

    def __init__(self, dim: int, num_heads: int, segment_len: int = 2048, update: str = "linear",
                 head_dim: int | None = None, bias: bool = True, backend: str = "auto",
                 window: int | tuple[int | None, int | None] | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(dim, num_heads, head_dim=head_dim, bias=bias, layout="q_k_v", factory=fk)
        self.segment_len = check_int(segment_len, "segment_len")
        self.update = check_choice(update, "update", choices=UPDATES)
        self.backend = check_backend(backend, type(self).__name__)
        self.window = normalize_window(window)
        self.gate = nn.Parameter(torch.zeros(self.num_heads, **fk))  # sigmoid(0) = 0.5

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> InfiniCache:
        """An :class:`InfiniCache` (``max_len`` is validated; the cache never grows past one segment)."""
        return super().init_cache(batch_size, max_len, device=device, dtype=dtype)  # type: ignore[no-any-return]

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype) -> InfiniCache:
        return InfiniCache(batch_size, self.num_heads, self.head_dim, self.segment_len, device=device, dtype=dtype)

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,
                cache: InfiniCache | None = None, positions: Tensor | None = None,
                return_weights: bool = False, cu_seqlens: Tensor | None = None) -> Tensor:
        """Causal Infini-attention over ``x [B, N, C]``.

        Args:
            x: tokens (a floating tensor); with a cache only the NEW ones (they continue the cached stream).
            context: must be ``None`` (no cross-attention).
            mask: key padding: bool ``[B, N]`` (``[B, cache.length + N]`` accepted with a cache) or
                ``attnzoo.masks.key_padding(...)``. Left padding: each row's segments count its real
                tokens (a left-padded row equals the row alone); right padding without a cache. A pad
                between real tokens (or after one, with a cache) is a ``ValueError``.
            cache: an :class:`InfiniCache` from :meth:`init_cache`, updated in place (unchanged when
                the call raises).
            positions: validated, unused.
            return_weights: must be False.
            cu_seqlens: packed sequences in ``x [1, T, C]`` (int32 ``[S+1]``): each sequence runs alone
                (its own segments and memory; no cache, mask or positions).

        Returns:
            ``[B, N, C]``.
        """
        cls = type(self).__name__
        refuse_context(cls, context, "Infini-attention is causal self-attention over one stream")
        x = self.check_call(x, cache, positions, return_weights, InfiniCache)
        if cu_seqlens is not None:
            cu = check_packed_call(cls, x, cu_seqlens, cache=cache, mask=mask, positions=positions)
            return run_per_sequence(lambda seq: self(seq), x, cu)
        b, n, _ = x.shape
        if cache is not None:
            want = (self.num_heads, self.head_dim, self.segment_len)
            if (cache.num_heads, cache.head_dim, cache.segment_len) != want:
                raise ValueError(f"{cls}: the cache holds (H, D, L) = "
                                 f"{(cache.num_heads, cache.head_dim, cache.segment_len)}, this module needs "
                                 f"{want}; use module.init_cache()")
        total = n + (cache.length if cache is not None else 0)
        pad = key_padding_from_mask(cls, mask, b, n, total, x.device)
        if pad is not None:  # the whole mask given ([B, N] or [B, cache.length + N]): left/right padding only
            width = mask.shape[-1] if isinstance(mask, Tensor) else total
            _check_padding(cls, key_padding_from_mask(cls, mask, b, width, total, x.device), cache is not None)
        q, k, v = self.project_qkv(x)  # [B, H, N, D] each
        kw: dict[str, Any] = {"segment_len": self.segment_len, "update": self.update, "key_padding_mask": pad,
                              "window": self.window, "backend": self.backend}
        if cache is None:
            return self.merge_heads(infini_attention(q, k, v, self.gate, **kw))
        out, st = infini_attention(q, k, v, self.gate, state=cache.state, return_state=True, **kw)
        cache.update(st, n)
        return self.merge_heads(out)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"segment_len={self.segment_len}, update={self.update!r}, backend={self.backend!r}, "
                f"window={self.window}")


def _check_padding(cls: str, m: Tensor | None, cached: bool) -> None:
    """Key padding ``m [B, L]`` (True = real; every key given) that Infini-attention serves as each row
    alone: left padding (segments count each row's real tokens), and right padding without a cache.
    A pad between real tokens, or after one with a cache, is a ``ValueError`` (the segments would
    count the pad's stream position, or the buffered segment would outgrow ``segment_len``)."""
    if m is None or m.shape[1] < 2:
        return
    after_real = m.cummax(dim=1).values & ~m  # [B, L] pads after a real token
    if cached and bool(after_real.any()):
        raise ValueError(f"{cls} (variant 'infini'): mask / attention_mask pads a token after a real one in a "
                         f"cached call; with a cache only left padding is supported")
    if bool((after_real.cummax(dim=1).values & m).any()):
        raise ValueError(f"{cls} (variant 'infini'): mask / attention_mask pads a token between two real ones; "
                         f"only left or right padding is supported (segments count each row's real tokens)")


# --------------------------------------------------------------------------- variant spec
def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """Causal softmax inside each segment of ``S`` tokens plus a ``D x Dv`` memory per head."""
    B, N, e, acc = shape.batch, shape.seq_len, shape.elem_bytes, shape.acc_bytes
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    params, flops_proj, qkv_bytes, io_bytes = projection_cost(cfg, shape)
    seg = cfg.segment_len or N + 1  # without a segment length every token stays in the segment
    S = min(seg, N)
    flops_local = 2 * B * Hq * (N // S * S * S + (N % S) ** 2) * 2 * D
    flops_mem = 2 * B * Hq * N * D * (D + 1) * 2  # retrieve sigma(Q) M, update M += sigma(K)^T V
    pairs = visible_pairs(cfg, N)
    # the local softmax runs on a fused kernel (O(S) residue); per token the module keeps the
    # segment's q/k/v views, sigma(q), sigma(k) and the retrieved memory readout
    act = B * N * cfg.dim * e + qkv_bytes + B * N * Hq * D * e + 5 * B * Hq * N * D * acc
    flops_attn = flops_local + flops_mem
    return Cost(backend="infini", flops_projections=flops_proj, flops_attention=flops_attn,
                flops_useful=2 * B * Hq * pairs * 2 * D + flops_mem, flops_backward=2 * flops_proj + 2 * flops_attn,
                bytes_moved=io_bytes + 2 * qkv_bytes + 2 * B * N * Hq * D * e + 4 * B * Hq * N * S * acc,
                activation_bytes=act, kv_cache_bytes_per_token=0,
                # a full segment is folded into the memory: the cache holds the N mod S tokens after it
                kv_cache_bytes=B * Hkv * (D * D + D) * acc + B * (N % seg) * 2 * Hkv * D * e,
                kv_cache_max_tokens=min(N, seg - 1), params=params, visible_pairs=pairs)


def _build(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    if causal is not True:
        raise ValueError("infini: InfiniAttention is causal by construction (causal=False is not supported)")
    return InfiniAttention(dim, num_heads, **kw)


register(VariantSpec("infini", "compressive", False, "O(N C^2 + N S C)", "O(N S)",
                     "memory M [D, Dv] + z [D] per head, plus the current segment", _build, _cost,
                     defaults={"segment_len": 2048}, options=("segment_len",), causal_modes=(True,),
                     check={"segment_len": 8}, masks="causal", order=7, arena_default=True,
                     positions="none"))
