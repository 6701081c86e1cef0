"""Infini-attention module (Munkhdalai et al. 2024): local causal softmax + compressive memory.

The math lives in :func:`attnzoo.functional.infini.infini_attention`; this module owns the
projections ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, the per-head gate and the cache
(:class:`InfiniCache`: the memory plus the current partial segment, never more).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.functional._request import normalize_window
from attnzoo.functional.attention import BACKENDS
from attnzoo.functional.infini import UPDATES, InfiniState, infini_attention
from attnzoo.masks import Mask
from attnzoo.nn.feature_attention import check_int, check_positions, check_x, key_padding_from_mask

__all__ = ["InfiniAttention", "InfiniCache"]


class InfiniCache:
    """Decoding/streaming state of :class:`InfiniAttention`.

    Holds an :class:`~attnzoo.functional.infini.InfiniState`: memory ``M [B, H, D, D]`` and
    ``z [B, H, D]`` (float32) plus the keys/values of the current partial segment (fewer than
    ``segment_len`` tokens). Its size is bounded by the memory plus one segment, whatever the
    number of tokens fed. Protocol: ``length``, ``batch_size``, ``reset()``.
    """

    def __init__(self, batch_size: int, num_heads: int, head_dim: int, segment_len: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self._batch_size = check_int(batch_size, "batch_size")
        self.num_heads = check_int(num_heads, "num_heads")
        self.head_dim = check_int(head_dim, "head_dim")
        self.segment_len = check_int(segment_len, "segment_len")
        self._device = device
        self._dtype = dtype
        self.state = InfiniState.empty(self._batch_size, self.num_heads, self.head_dim, self.head_dim,
                                       device=device, dtype=dtype)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self._batch_size

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

    def __repr__(self) -> str:
        return (f"InfiniCache(batch_size={self.batch_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"segment_len={self.segment_len}, length={self.length}, segment_fill={self.state.fill})")


class InfiniAttention(nn.Module):
    """Multi-head Infini-attention; causal by construction.

    Each segment of ``segment_len`` tokens uses exact causal softmax attention over its own keys
    (:func:`attnzoo.attention` with ``backend`` and ``window``) and retrieves from a per-head,
    per-batch-element compressive memory of all earlier segments; a learnable per-head gate
    ``sigmoid(gate[h])`` (initialised at 0.5) mixes the two. See
    :mod:`attnzoo.functional.infini` for the formulas.

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

    def __init__(self, dim: int, num_heads: int, segment_len: int = 2048, update: str = "linear",
                 head_dim: int | None = None, bias: bool = True, backend: str = "auto",
                 window: int | tuple[int | None, int | None] | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        cls = type(self).__name__
        self.dim = check_int(dim, "dim")
        self.num_heads = check_int(num_heads, "num_heads")
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"{cls}: dim={dim} is not divisible by num_heads={num_heads}; pass head_dim")
            head_dim = dim // num_heads
        self.head_dim = check_int(head_dim, "head_dim")
        self.segment_len = check_int(segment_len, "segment_len")
        if update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
        self.update = update
        if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
            raise ValueError(f"backend must be one of {('auto', *BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.window = normalize_window(window)
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {type(bias).__name__}")
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        inner = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(self.dim, inner, bias=bias, **fk)
        self.k_proj = nn.Linear(self.dim, inner, bias=bias, **fk)
        self.v_proj = nn.Linear(self.dim, inner, bias=bias, **fk)
        self.out_proj = nn.Linear(inner, self.dim, bias=bias, **fk)
        self.gate = nn.Parameter(torch.zeros(self.num_heads, **fk))  # sigmoid(0) = 0.5

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> InfiniCache:
        """An :class:`InfiniCache` (``max_len`` is validated; the cache never grows past one segment)."""
        check_int(batch_size, "batch_size")
        check_int(max_len, "max_len")
        p = self.out_proj.weight
        return InfiniCache(batch_size, self.num_heads, self.head_dim, self.segment_len,
                           device=p.device if device is None else device, dtype=p.dtype if dtype is None else dtype)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | Mask | None = None,
        cache: InfiniCache | None = None,
        positions: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor:
        """Causal Infini-attention over ``x [B, N, C]``.

        Args:
            x: tokens; with a cache only the NEW ones (they continue the cached stream).
            context: must be ``None`` (no cross-attention).
            mask: key padding: bool ``[B, N]`` (``[B, cache.length + N]`` accepted with a cache) or
                ``attnzoo.masks.key_padding(...)``.
            cache: an :class:`InfiniCache` from :meth:`init_cache`, updated in place.
            positions: validated, unused.
            return_weights: must be False.

        Returns:
            ``[B, N, C]``.
        """
        cls = type(self).__name__
        x = check_x(cls, x, self.dim)
        b, n, _ = x.shape
        if context is not None:
            raise ValueError(f"{cls}: context (cross-attention) is not supported: Infini-attention is causal "
                             f"self-attention over one stream")
        if return_weights is not False:
            raise ValueError(f"{cls}: return_weights=True is not supported (the memory has no attention matrix)")
        check_positions(cls, positions, b, n)
        if cache is not None:
            if not isinstance(cache, InfiniCache):
                raise TypeError(f"{cls}: cache must be an InfiniCache from init_cache(), got {type(cache).__name__}")
            if cache.batch_size != b:
                raise ValueError(f"{cls}: the cache was built for batch size {cache.batch_size}, x has shape "
                                 f"{tuple(x.shape)}")
            if (cache.num_heads, cache.head_dim, cache.segment_len) != (self.num_heads, self.head_dim,
                                                                        self.segment_len):
                raise ValueError(f"{cls}: the cache holds (H, D, L) = "
                                 f"{(cache.num_heads, cache.head_dim, cache.segment_len)}, this module needs "
                                 f"{(self.num_heads, self.head_dim, self.segment_len)}; use module.init_cache()")
        n_total = n + (cache.length if cache is not None else 0)
        pad = key_padding_from_mask(cls, mask, b, n, n_total, x.device)
        h, d = self.num_heads, self.head_dim
        q = self.q_proj(x).view(b, n, h, d).transpose(1, 2)  # [B, H, N, D]
        k = self.k_proj(x).view(b, n, h, d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, h, d).transpose(1, 2)
        kw: dict[str, Any] = {"segment_len": self.segment_len, "update": self.update, "key_padding_mask": pad,
                              "window": self.window, "backend": self.backend}
        if cache is None:
            out = infini_attention(q, k, v, self.gate, **kw)
        else:
            out, st = infini_attention(q, k, v, self.gate, state=cache.state, return_state=True, **kw)
            assert isinstance(st, InfiniState)
            cache.state = st
            cache.length += n
        assert isinstance(out, Tensor)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h * d))  # [B, N, C]

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"segment_len={self.segment_len}, update={self.update!r}, backend={self.backend!r}, "
                f"window={self.window}")
