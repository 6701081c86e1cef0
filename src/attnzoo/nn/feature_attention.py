"""Feature-map attention modules: :class:`LinearAttention` and :class:`PerformerAttention`.

Both own ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` (``nn.Linear``) and delegate the math to
:func:`attnzoo.linear_attention` / :func:`attnzoo.performer_attention`. Their decoding cache is the
recurrent state ``(S [B, H, F, D], z [B, H, F])`` (:class:`RecurrentStateCache`): constant memory
whatever the number of tokens, and feeding tokens through it equals one causal forward pass.

Masks: key padding only (bool ``[B, N]``, True = real token, or an
``attnzoo.masks.key_padding(...)`` Mask). There is no attention matrix, so ``return_weights=True``
raises ``ValueError``. ``positions`` is accepted for interface compatibility and validated, but
unused: these modules carry no positional encoding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_int
from attnzoo.functional.linear import (
    FeatureMap,
    check_chunk_size,
    compute_dtype,
    linear_attention,
    resolve_feature_map,
)
from attnzoo.functional.performer import draw_performer_projection, performer_attention
from attnzoo.masks import Mask

__all__ = ["LinearAttention", "PerformerAttention", "RecurrentStateCache"]


# --------------------------------------------------------------------------- shared helpers
def check_x(cls: str, x: object, dim: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{cls}: x must be a tensor [B, N, C], got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"{cls}: x must have shape [B, N, C] with C = dim = {dim}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{cls}: x must be a floating-point tensor, got {x.dtype}")
    return x


def check_positions(cls: str, positions: object, batch: int, n: int) -> None:
    """Validate ``positions`` (int ``[N]`` or ``[B, N]``); the feature-map modules do not use them."""
    if positions is None:
        return
    if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
        raise TypeError(f"{cls}: positions must be an int tensor [N] or [B, N], got "
                        f"{type(positions).__name__}{' ' + str(positions.dtype) if isinstance(positions, Tensor) else ''}")
    if positions.dim() not in (1, 2) or positions.shape[-1] != n or (
            positions.dim() == 2 and positions.shape[0] not in (1, batch)):
        raise ValueError(f"{cls}: positions must have shape [N] or [B, N] = [{batch}, {n}], got {tuple(positions.shape)}")


def key_padding_from_mask(cls: str, mask: object, batch: int, n_new: int, n_total: int,
                          device: torch.device) -> Tensor | None:
    """``mask`` -> bool ``[B, n_new]`` (True = real token) for the ``n_new`` newest keys, or ``None``.

    Accepts bool ``[B, n_new]`` or ``[B, n_total]`` (the absolute key axis with a cache; its last
    ``n_new`` columns are used), the same as ``[B, 1, 1, Nk]``, and a leaf
    ``attnzoo.masks.key_padding(...)`` Mask.
    """
    if mask is None:
        return None
    if isinstance(mask, Mask):
        if mask._children or not mask.name.startswith("key_padding"):
            raise ValueError(f"{cls}: only key padding masks are supported (bool [B, N] or "
                             f"attnzoo.masks.key_padding(...)), got {mask!r}")
        if mask.batch is not None and mask.batch not in (1, batch):
            raise ValueError(f"{cls}: mask {mask!r} was built for batch size {mask.batch}, x has batch {batch}")
        full = mask.evaluate(batch, 1, 0, 0, 1, 0, n_total, device=device)[:, 0, 0, :]  # [B, n_total]
        return full[:, n_total - n_new:]
    if not isinstance(mask, Tensor):
        raise TypeError(f"{cls}: mask must be a bool tensor [B, N] or a key_padding Mask, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"{cls}: mask must be a bool key padding mask [B, N] (True = real token); float/additive "
                         f"masks are not supported by feature-map attention, got dtype {mask.dtype}")
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
        mask = mask[:, 0, 0]  # [B, 1, 1, Nk]: the broadcastable key padding layout of az.attention
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] not in (n_new, n_total):
        want = f"[{batch}, {n_new}]" + (f" or [{batch}, {n_total}]" if n_total != n_new else "")
        raise ValueError(f"{cls}: only key padding masks are supported: expected bool {want}, got shape "
                         f"{tuple(mask.shape)}")
    return mask[:, mask.shape[1] - n_new:].to(device)


class RecurrentStateCache:
    """Decoding state of :class:`LinearAttention` / :class:`PerformerAttention`.

    Holds ``S [B, H, F, Dv]`` (sum of ``phi(k) v^T``) and ``z [B, H, F]`` (sum of ``phi(k)``) over
    every token fed so far, in float32 (float64 for float64 modules): memory
    ``B * H * F * (Dv + 1) * itemsize`` bytes whatever the length. Protocol: ``length``,
    ``batch_size``, ``reset()``.
    """

    def __init__(self, batch_size: int, num_heads: int, num_features: int, head_dim_v: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self._batch_size = check_int(batch_size, "batch_size")
        self.num_heads = check_int(num_heads, "num_heads")
        self.num_features = check_int(num_features, "num_features")
        self.head_dim_v = check_int(head_dim_v, "head_dim_v")
        self.S = torch.zeros(self._batch_size, self.num_heads, self.num_features, self.head_dim_v,
                             device=device, dtype=dtype)
        self.z = torch.zeros(self._batch_size, self.num_heads, self.num_features, device=device, dtype=dtype)
        self.length = 0
        self.version: int | None = None  # the Performer projection the state was built with

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def nbytes(self) -> int:
        """Bytes held by the state (independent of ``length``)."""
        return self.S.nbytes + self.z.nbytes

    def reset(self) -> None:
        """Forget every token (buffers reused)."""
        self.S.zero_()
        self.z.zero_()
        self.length = 0
        self.version = None

    def __repr__(self) -> str:
        return (f"RecurrentStateCache(batch_size={self.batch_size}, num_heads={self.num_heads}, "
                f"num_features={self.num_features}, head_dim_v={self.head_dim_v}, length={self.length})")


class _FeatureAttention(nn.Module):
    """Projections, head split/merge, masks and the recurrent cache; subclasses supply the kernel."""

    def __init__(self, dim: int, num_heads: int, *, causal: bool, chunk_size: int, head_dim: int | None,
                 bias: bool, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        cls = type(self).__name__
        self.dim = check_int(dim, "dim")
        self.num_heads = check_int(num_heads, "num_heads")
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"{cls}: dim={dim} is not divisible by num_heads={num_heads}; pass head_dim")
            head_dim = dim // num_heads
        self.head_dim = check_int(head_dim, "head_dim")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.causal = causal
        c = check_chunk_size(chunk_size)
        if c is None:
            raise TypeError("chunk_size must be an int >= 1, got None")
        self.chunk_size = c
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {type(bias).__name__}")
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        inner = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(self.dim, inner, bias=bias, **fk)
        self.k_proj = nn.Linear(self.dim, inner, bias=bias, **fk)
        self.v_proj = nn.Linear(self.dim, inner, bias=bias, **fk)
        self.out_proj = nn.Linear(inner, self.dim, bias=bias, **fk)

    # subclasses -------------------------------------------------------------
    @property
    def num_features(self) -> int:
        raise NotImplementedError

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, state: tuple[Tensor, Tensor] | None,
                return_state: bool, pad: Tensor | None) -> Any:
        raise NotImplementedError

    def _check_cache(self, cache: RecurrentStateCache) -> None:
        """Hook for subclass-specific cache checks."""

    # public -----------------------------------------------------------------
    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> RecurrentStateCache:
        """A :class:`RecurrentStateCache` (``max_len`` is validated but the state does not grow with it).

        The state is float32 (float64 when ``dtype`` or the module is float64); device defaults to
        the module's.
        """
        check_int(batch_size, "batch_size")
        check_int(max_len, "max_len")
        p = self.out_proj.weight
        dt = compute_dtype(p.dtype if dtype is None else dtype)
        return RecurrentStateCache(batch_size, self.num_heads, self.num_features, self.head_dim,
                                   device=p.device if device is None else device, dtype=dt)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | Mask | None = None,
        cache: RecurrentStateCache | None = None,
        positions: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor:
        """Attend from ``x [B, N, C]`` to itself, or (bidirectional only) to ``context [B, M, C]``.

        Args:
            x: tokens; with a cache only the NEW ones (positions ``cache.length ..``).
            context: keys/values source for cross-attention (``causal=False`` and no cache).
            mask: key padding: bool ``[B, Nk]`` (True = real token; with a cache ``[B, N]`` or
                ``[B, cache.length + N]``) or ``attnzoo.masks.key_padding(...)``.
            cache: a :class:`RecurrentStateCache` from :meth:`init_cache` (causal modules); updated in
                place: the new tokens' keys are added to ``(S, z)`` and ``length`` advances.
            positions: validated, unused (no positional encoding in these modules).
            return_weights: must be False (no attention matrix exists).

        Returns:
            ``[B, N, C]``.
        """
        cls = type(self).__name__
        x = check_x(cls, x, self.dim)
        b, n, _ = x.shape
        if return_weights is not False:
            raise ValueError(f"{cls}: return_weights=True is not supported: feature-map attention never forms "
                             f"an attention matrix")
        check_positions(cls, positions, b, n)
        if cache is not None:
            if not isinstance(cache, RecurrentStateCache):
                raise TypeError(f"{cls}: cache must be a RecurrentStateCache from init_cache(), got "
                                f"{type(cache).__name__}")
            if not self.causal:
                raise ValueError(f"{cls}: decoding with a cache needs causal=True")
            if context is not None:
                raise ValueError(f"{cls}: context (cross-attention) cannot be combined with a cache")
            if cache.batch_size != b:
                raise ValueError(f"{cls}: the cache was built for batch size {cache.batch_size}, x has shape "
                                 f"{tuple(x.shape)}")
            want = (self.num_heads, self.num_features, self.head_dim)
            if (cache.num_heads, cache.num_features, cache.head_dim_v) != want:
                raise ValueError(f"{cls}: the cache holds (H, F, Dv) = {(cache.num_heads, cache.num_features, cache.head_dim_v)}"
                                 f", this module needs {want}; use module.init_cache()")
            self._check_cache(cache)
        src = x
        if context is not None:
            if self.causal:
                raise ValueError(f"{cls}: context (cross-attention) needs causal=False")
            if not isinstance(context, Tensor) or context.dim() != 3 or context.shape[0] != b \
                    or context.shape[-1] != self.dim:
                got = tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
                raise ValueError(f"{cls}: context must have shape [B, M, C] = [{b}, M, {self.dim}], got {got}")
            src = context
        m = src.shape[1]
        n_total = m + (cache.length if cache is not None else 0)
        pad = key_padding_from_mask(cls, mask, b, m, n_total, x.device)
        h, d = self.num_heads, self.head_dim
        q = self.q_proj(x).view(b, n, h, d).transpose(1, 2)  # [B, H, N, D]
        k = self.k_proj(src).view(b, m, h, d).transpose(1, 2)  # [B, H, M, D]
        v = self.v_proj(src).view(b, m, h, d).transpose(1, 2)  # [B, H, M, D]
        if cache is None:
            out = self._attend(q, k, v, causal=self.causal, state=None, return_state=False, pad=pad)
        else:
            out, (s, z) = self._attend(q, k, v, causal=True, state=(cache.S, cache.z), return_state=True, pad=pad)
            cache.S, cache.z = s.to(cache.S.dtype), z.to(cache.z.dtype)
            cache.length += n
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h * d))  # [B, N, C]


class LinearAttention(_FeatureAttention):
    """Multi-head linear attention (Katharopoulos et al. 2020): :func:`attnzoo.linear_attention`.

    Args:
        dim: model width ``C``.
        num_heads: heads ``H``.
        feature_map: ``"elu"`` (ELU+1), ``"relu"``, ``"identity"`` or a callable ``[..., D] -> [..., F]``.
        causal: prefix attention; required for decoding with a cache.
        chunk_size: chunk length of the chunked causal form.
        head_dim: ``D`` (default ``C // H``).
        bias: biases in the projections.
        device, dtype: of the parameters.

    Shapes: ``[B, N, C] -> [B, N, C]``. Decoding cache: ``S [B, H, F, D]``, ``z [B, H, F]``.
    """

    def __init__(self, dim: int, num_heads: int, feature_map: FeatureMap = "elu", causal: bool = False,
                 chunk_size: int = 64, head_dim: int | None = None, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, num_heads, causal=causal, chunk_size=chunk_size, head_dim=head_dim, bias=bias,
                         device=device, dtype=dtype)
        self.feature_map = feature_map
        self._fn = resolve_feature_map(feature_map)
        self._num_features = self._probe_features()

    def _probe_features(self) -> int:
        if isinstance(self.feature_map, str):
            return self.head_dim
        out = self._fn(torch.zeros(1, 1, 1, self.head_dim))
        if not isinstance(out, Tensor) or out.dim() != 4:
            raise ValueError(f"feature_map must map [B, H, N, D] to [B, H, N, F], got "
                             f"{type(out).__name__ if not isinstance(out, Tensor) else tuple(out.shape)}")
        return int(out.shape[-1])

    @property
    def num_features(self) -> int:
        """Features per head ``F`` (``D`` for the named maps)."""
        return self._num_features

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, state: tuple[Tensor, Tensor] | None,
                return_state: bool, pad: Tensor | None) -> Any:
        return linear_attention(q, k, v, feature_map=self.feature_map, causal=causal, chunk_size=self.chunk_size,
                                state=state, return_state=return_state, key_padding_mask=pad)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"feature_map={self.feature_map!r}, causal={self.causal}, chunk_size={self.chunk_size}")


class PerformerAttention(_FeatureAttention):
    """Multi-head Performer attention (FAVOR+, Choromanski et al. 2021): :func:`attnzoo.performer_attention`.

    One projection ``W [F, D]`` (a buffer, saved in the state dict) is shared by all heads.

    Args:
        dim: model width ``C``.
        num_heads: heads ``H``.
        num_features: random features ``F >= 1``.
        causal: prefix attention; required for decoding with a cache.
        orthogonal: orthogonal random features (FAVOR+) rather than i.i.d. Gaussian ones.
        redraw_interval: each projection serves ``redraw_interval`` training forward calls, then the
            next training call draws a fresh one (never in eval mode, never while decoding with a
            cache); ``None`` = never. :meth:`redraw_projection` redraws on demand.
        seed: makes every draw reproducible: draw ``i`` uses seed ``seed + i``; ``None`` = torch's
            global generator.
        chunk_size: chunk length of the chunked causal form.
        head_dim: ``D`` (default ``C // H``).
        bias: biases in the projections.
        device, dtype: of the parameters (the projection is kept in float32 unless dtype is float64).

    Shapes: ``[B, N, C] -> [B, N, C]``. Decoding cache: ``S [B, H, F, D]``, ``z [B, H, F]``.
    """

    projection: Tensor

    def __init__(self, dim: int, num_heads: int, num_features: int = 256, causal: bool = False,
                 orthogonal: bool = True, redraw_interval: int | None = None, seed: int | None = None,
                 chunk_size: int = 64, head_dim: int | None = None, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, num_heads, causal=causal, chunk_size=chunk_size, head_dim=head_dim, bias=bias,
                         device=device, dtype=dtype)
        self._num_features = check_int(num_features, "num_features")
        if not isinstance(orthogonal, bool):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.orthogonal = orthogonal
        self.redraw_interval = None if redraw_interval is None else check_int(redraw_interval, "redraw_interval")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        self.seed = seed
        self.num_draws = 0  # projections drawn so far; the current one is draw num_draws - 1
        self._calls_since_draw = 0
        pdt = torch.float64 if dtype == torch.float64 else torch.float32
        self.register_buffer("projection", torch.empty(self._num_features, self.head_dim, device=device, dtype=pdt))
        self.redraw_projection()

    @property
    def num_features(self) -> int:
        """Random features per head ``F``."""
        return self._num_features

    @torch.no_grad()
    def redraw_projection(self) -> None:
        """Draw a fresh projection now (reproducible: draw ``i`` uses ``seed + i`` when a seed is set).

        Caches started with the old projection are refused afterwards (their state is stale).
        """
        seed = None if self.seed is None else self.seed + self.num_draws
        w = draw_performer_projection(self._num_features, self.head_dim, orthogonal=self.orthogonal, seed=seed,
                                      dtype=torch.float64)
        self.projection.copy_(w.to(self.projection.dtype))
        self.num_draws += 1
        self._calls_since_draw = 0

    def _check_cache(self, cache: RecurrentStateCache) -> None:
        if cache.version is None:
            cache.version = self.num_draws
        elif cache.version != self.num_draws:
            raise ValueError(f"{type(self).__name__}: the projection was redrawn since this cache was started "
                             f"(cache draw {cache.version}, module draw {self.num_draws}); call cache.reset()")

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,
                cache: RecurrentStateCache | None = None, positions: Tensor | None = None,
                return_weights: bool = False) -> Tensor:
        """As :meth:`LinearAttention.forward`; also applies the redraw schedule (training, no cache)."""
        if self.training and cache is None and self.redraw_interval is not None:
            if self._calls_since_draw >= self.redraw_interval:
                self.redraw_projection()
            self._calls_since_draw += 1
        return super().forward(x, context, mask=mask, cache=cache, positions=positions,
                               return_weights=return_weights)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, state: tuple[Tensor, Tensor] | None,
                return_state: bool, pad: Tensor | None) -> Any:
        return performer_attention(q, k, v, self.projection, causal=causal, chunk_size=self.chunk_size,
                                   state=state, return_state=return_state, key_padding_mask=pad)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"num_features={self.num_features}, causal={self.causal}, orthogonal={self.orthogonal}, "
                f"redraw_interval={self.redraw_interval}, seed={self.seed}")
