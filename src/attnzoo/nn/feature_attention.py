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

from attnzoo._devices import restore_float32
from attnzoo._validate import check_bool, check_int, check_optional_int
from attnzoo.functional.feature_maps.linear import (
    FeatureMap,
    compute_dtype,
    linear_attention,
    resolve_feature_map,
)
from attnzoo.functional.feature_maps.performer import draw_performer_projection, performer_attention
from attnzoo.masks import Mask
from attnzoo.nn.base import AttentionBase
from attnzoo.nn.cache import SnapshotCache
from attnzoo.nn.costs import projection_cost
from attnzoo.nn.packing import check_packed_call, run_per_sequence
from attnzoo.nn.spec import Cost, CostShape, VariantConfig, VariantSpec, register

__all__ = ["LinearAttention", "PerformerAttention", "RecurrentStateCache"]


# --------------------------------------------------------------------------- shared helpers
def refuse_context(cls: str, context: object, why: str) -> None:
    """``ValueError`` unless ``context`` is ``None``: a causal self-attention module over one stream
    (``why`` says what it is) has no cross-attention."""
    if context is not None:
        raise ValueError(f"{cls}: context (cross-attention) is not supported: {why}")


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


class RecurrentStateCache(SnapshotCache):
    """Decoding state of :class:`LinearAttention` / :class:`PerformerAttention`.

    Holds ``S [B, H, F, Dv]`` (sum of ``phi(k) v^T``) and ``z [B, H, F]`` (sum of ``phi(k)``) over
    every token fed so far, in float32 (float64 for float64 modules): memory
    ``B * H * F * (Dv + 1) * itemsize`` bytes whatever the length. Protocol (``attnzoo.nn.cache``):
    ``length``, ``batch_size``, ``nbytes``, ``reset()``, ``mark()``/``rollback()`` and
    :meth:`update`, which stores the state after ``n`` more tokens and returns
    ``(S, z, positions)`` with the absorbed tokens' positions ``[n]``.
    """

    snapshot = ("length", "S", "z", "version")
    _batch_tensors = ("S", "z")

    def __init__(self, batch_size: int, num_heads: int, num_features: int, head_dim_v: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self._set_sizes(batch_size, num_heads=num_heads, num_features=num_features, head_dim_v=head_dim_v)
        self.S = torch.zeros(self._batch_size, self.num_heads, self.num_features, self.head_dim_v,
                             device=device, dtype=dtype)
        self.z = torch.zeros(self._batch_size, self.num_heads, self.num_features, device=device, dtype=dtype)
        self.version: int | None = None  # the Performer projection the state was built with

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

    def update(self, S: Tensor, z: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Store the state ``S [B, H, F, Dv]``, ``z [B, H, F]`` after ``n`` more tokens; return
        ``(S, z, positions)`` with the new tokens' positions ``length - n .. length - 1`` (int64)."""
        if S.shape != self.S.shape or z.shape != self.z.shape:
            raise ValueError(f"RecurrentStateCache.update: expected S {tuple(self.S.shape)} and z "
                             f"{tuple(self.z.shape)}, got {tuple(S.shape)} and {tuple(z.shape)}")
        self.S, self.z = S.to(self.S.dtype), z.to(self.z.dtype)
        return self.S, self.z, self.advance(n, self.S.device)

    def __repr__(self) -> str:
        return (f"RecurrentStateCache(batch_size={self.batch_size}, num_heads={self.num_heads}, "
                f"num_features={self.num_features}, head_dim_v={self.head_dim_v}, length={self.length})")


class _FeatureAttention(AttentionBase):
    """Projections, head split/merge, masks and the recurrent cache; subclasses supply the kernel."""

    no_weights_reason = "feature-map attention never forms an attention matrix"

    def __init__(self, dim: int, num_heads: int, *, causal: bool, chunk_size: int, head_dim: int | None,
                 bias: bool, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        super().__init__(dim, num_heads, head_dim=head_dim, bias=bias, layout="q_k_v",
                         factory={"device": device, "dtype": dtype})
        self.causal = check_bool(causal, "causal", type(self).__name__)
        self.chunk_size = check_int(chunk_size, "chunk_size")

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
        return super().init_cache(batch_size, max_len, device=device, dtype=dtype)  # type: ignore[no-any-return]

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str,
                   dtype: torch.dtype) -> RecurrentStateCache:
        return RecurrentStateCache(batch_size, self.num_heads, self.num_features, self.head_dim,
                                   device=device, dtype=compute_dtype(dtype))

    def _check_recurrent_cache(self, cache: RecurrentStateCache, context: Tensor | None) -> None:
        cls = type(self).__name__
        if not self.causal:
            raise ValueError(f"{cls}: decoding with a cache needs causal=True")
        if context is not None:
            raise ValueError(f"{cls}: context (cross-attention) cannot be combined with a cache")
        want = (self.num_heads, self.num_features, self.head_dim)
        got = (cache.num_heads, cache.num_features, cache.head_dim_v)
        if got != want:
            raise ValueError(f"{cls}: the cache holds (H, F, Dv) = {got}, this module needs {want}; "
                             f"use module.init_cache()")

    def _source(self, x: Tensor, context: object) -> Tensor:
        if context is None:
            return x
        cls = type(self).__name__
        if self.causal:
            raise ValueError(f"{cls}: context (cross-attention) needs causal=False")
        if not isinstance(context, Tensor) or context.dim() != 3 or context.shape[0] != x.shape[0] \
                or context.shape[-1] != self.dim:
            got = tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
            raise ValueError(f"{cls}: context must have shape [B, M, C] = [{x.shape[0]}, M, {self.dim}], got {got}")
        return self.check_x(context, "context")

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,
                cache: RecurrentStateCache | None = None, positions: Tensor | None = None,
                return_weights: bool = False, cu_seqlens: Tensor | None = None) -> Tensor:
        """Attend from ``x [B, N, C]`` to itself, or (bidirectional only) to ``context [B, M, C]``.

        Args:
            x: tokens (a floating tensor); with a cache only the NEW ones (positions ``cache.length ..``).
            context: keys/values source for cross-attention (``causal=False`` and no cache).
            mask: key padding: bool ``[B, Nk]`` (True = real token; with a cache ``[B, N]`` or
                ``[B, cache.length + N]``) or ``attnzoo.masks.key_padding(...)``.
            cache: a :class:`RecurrentStateCache` from :meth:`init_cache` (causal modules); updated in
                place: the new tokens' keys are added to ``(S, z)`` and ``length`` advances. A call
                that raises leaves it unchanged.
            positions: validated, unused (no positional encoding in these modules).
            return_weights: must be False (no attention matrix exists).
            cu_seqlens: packed sequences in ``x [1, T, C]`` (int32 ``[S+1]``): each sequence attends only
                inside itself (run one at a time; no cache, mask, positions or context).

        Returns:
            ``[B, N, C]``.
        """
        cls = type(self).__name__
        x = self.check_call(x, cache, positions, return_weights, RecurrentStateCache)
        if cu_seqlens is not None:
            cu = check_packed_call(cls, x, cu_seqlens, cache=cache, mask=mask, positions=positions, context=context)
            return run_per_sequence(lambda seq: _FeatureAttention.forward(self, seq), x, cu)
        if cache is not None:
            self._check_recurrent_cache(cache, context)
        src = self._source(x, context)
        n_total = src.shape[1] + (cache.length if cache is not None else 0)
        pad = key_padding_from_mask(cls, mask, x.shape[0], src.shape[1], n_total, x.device)
        q, (k, v) = self.project_q(x), self.project_kv(src)  # [B, H, N, D], [B, H, M, D] x 2
        if cache is None:
            return self.merge_heads(self._attend(q, k, v, causal=self.causal, state=None, return_state=False,
                                                 pad=pad))
        return self.guarded(cache, lambda: self._decode(q, k, v, cache, pad))

    def _decode(self, q: Tensor, k: Tensor, v: Tensor, cache: RecurrentStateCache, pad: Tensor | None) -> Tensor:
        self._check_cache(cache)
        out, (s, z) = self._attend(q, k, v, causal=True, state=(cache.S, cache.z), return_state=True, pad=pad)
        cache.update(s, z, q.shape[2])
        return self.merge_heads(out)


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
        fn = resolve_feature_map(feature_map)  # validates; not kept (a lambda would not pickle)
        self.feature_map = feature_map
        self._num_features = self.head_dim if isinstance(feature_map, str) else self._probe_features(fn)

    def _probe_features(self, fn: Any) -> int:
        out = fn(torch.zeros(1, 1, 1, self.head_dim))
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
        check_bool(orthogonal, "orthogonal")
        self.orthogonal = orthogonal
        self.redraw_interval = None if redraw_interval is None else check_int(redraw_interval, "redraw_interval")
        check_optional_int(seed, "seed", minimum=None)
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

    def _apply(self, fn: Any, recurse: bool = True) -> PerformerAttention:
        """Half casts leave the projection in float32 (as ``dtype=`` at construction does)."""
        before = self.projection
        super()._apply(fn, recurse)
        restore_float32(self, "projection", before)
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        """Also save the redraw schedule, ``redraw_schedule = [num_draws, training calls since the
        last draw]`` (int64, a tensor so that safetensors can hold it): a module restored
        mid-training redraws when the original would have."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "redraw_schedule"] = torch.tensor([self.num_draws, self._calls_since_draw])

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Read the schedule back; a state dict saved without it (before it was saved) loads strictly."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + "redraw_schedule"
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        sched = state_dict.get(key)
        if sched is None:
            return
        if not isinstance(sched, Tensor) or sched.shape != (2,) or sched.is_floating_point():
            error_msgs.append(f"{key}: expected an int tensor [2] (num_draws, calls since the last draw), got "
                              f"{tuple(sched.shape) if isinstance(sched, Tensor) else type(sched).__name__}")
            return
        self.num_draws, self._calls_since_draw = (int(v) for v in sched.tolist())

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
                return_weights: bool = False, cu_seqlens: Tensor | None = None) -> Tensor:
        """As :meth:`LinearAttention.forward`; also applies the redraw schedule (training, no cache; one
        step per call, packed sequences included)."""
        if self.training and cache is None and self.redraw_interval is not None:
            if self._calls_since_draw >= self.redraw_interval:
                self.redraw_projection()
            self._calls_since_draw += 1
        return super().forward(x, context, mask=mask, cache=cache, positions=positions,
                               return_weights=return_weights, cu_seqlens=cu_seqlens)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, state: tuple[Tensor, Tensor] | None,
                return_state: bool, pad: Tensor | None) -> Any:
        return performer_attention(q, k, v, self.projection, causal=causal, chunk_size=self.chunk_size,
                                   state=state, return_state=return_state, key_padding_mask=pad)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"num_features={self.num_features}, causal={self.causal}, orthogonal={self.orthogonal}, "
                f"redraw_interval={self.redraw_interval}, seed={self.seed}")


# --------------------------------------------------------------------------- variant specs
def _feature_cost(cfg: VariantConfig, shape: CostShape, *, random_features: bool) -> Cost:
    """Feature-map attention: ``phi(K)^T [V | 1]`` then ``phi(Q)`` times it (chunked when causal)."""
    B, N, e, acc = shape.batch, shape.seq_len, shape.elem_bytes, shape.acc_bytes
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    F, Dv, bh = cfg.num_features or D, D, shape.batch * cfg.num_heads
    params, flops_proj, qkv_bytes, io_bytes = projection_cost(cfg, shape)
    chunk = cfg.chunk_size if cfg.causal else None
    flops = 2 * B * Hq * N * D * F + 2 * B * Hkv * N * D * F if random_features else 0  # phi of q and k
    base = B * N * cfg.dim * e + qkv_bytes + B * N * Hq * D * e
    if chunk is not None:
        c = min(chunk, N)
        n_pad = -(-N // c) * c  # the last chunk is padded
        flops += 2 * B * Hq * n_pad * c * (F + Dv + 1)  # intra-chunk scores, times [V | 1]
        flops += 2 * B * Hq * n_pad * F * (Dv + 1) * 2  # read and update the running state
        # features of q and k (token and chunk layouts), the masked c x c score tile of every chunk,
        # [V | 1], chunk outputs and normalisers, and the running state at each chunk
        tok_feats = 2 * bh * N * F * acc if random_features else 0
        act = (base + tok_feats + 2 * bh * n_pad * F * acc + bh * n_pad * c * acc
               + bh * n_pad * (2 * Dv + 3) * acc + (n_pad // c) * bh * F * (Dv + 1) * acc)
    else:
        flops += 2 * B * Hq * N * F * (Dv + 1) * 2  # phi(K)^T [V | 1], then phi(Q) (KV) with normaliser
        act = base + 2 * bh * N * F * acc + bh * F * (Dv + 1) * acc + bh * N * (Dv + 1) * acc
    pairs = N * (N + 1) // 2 if cfg.causal else N * N
    return Cost(backend="feature-map", flops_projections=flops_proj, flops_attention=flops, flops_useful=flops,
                flops_backward=2 * flops_proj + 2 * flops,
                bytes_moved=io_bytes + 2 * qkv_bytes + 2 * B * N * Hq * D * e + 2 * B * Hq * F * Dv * acc,
                activation_bytes=act, kv_cache_bytes_per_token=0, kv_cache_bytes=B * Hkv * (F * Dv + F) * acc,
                kv_cache_max_tokens=None, params=params, visible_pairs=pairs)


def _linear_cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    return _feature_cost(cfg, shape, random_features=False)


def _performer_cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    return _feature_cost(cfg, shape, random_features=True)


def _build_linear(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    return LinearAttention(dim, num_heads, causal=causal, **kw)


def _build_performer(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    return PerformerAttention(dim, num_heads, causal=causal, **kw)


def _performer_arena(width: int, heads: int, window: int | None) -> dict[str, Any]:
    return {"num_features": 2 * (width // heads)}  # F = 2 x head dim: the default F=256 suits D=64 heads


_FEATURE = {"family": "feature-map", "exact": False, "time": "O(N C^2 + N F C)", "memory": "O(N F) chunked",
            "decoding": "state S [F, Dv] + z [F] per head", "masks": "causal, key padding", "positions": "none",
            "backends": False}
register(VariantSpec("linear", build=_build_linear, cost=_linear_cost, defaults={"chunk_size": 64},
                     options=("chunk_size",), check={"chunk_size": 5}, order=5, **_FEATURE, arena_default=True))
register(VariantSpec("performer", build=_build_performer, cost=_performer_cost,
                     defaults={"num_features": 256, "chunk_size": 64}, options=("num_features", "chunk_size"),
                     check={"chunk_size": 5, "num_features": 32}, arena=_performer_arena, order=6, **_FEATURE, arena_default=True))
