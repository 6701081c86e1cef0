"""Multi-head latent attention (MLA, DeepSeek-V2/V3): a cache of one compressed latent per token.

MLA projects each token to a small latent ``c_kv = RMSNorm(W_DKV x)`` (``kv_lora_rank = r``
numbers) plus ONE RoPE key ``k_pe`` shared by every head (``qk_rope_head_dim = dr``); the heads'
keys and values are up-projections of the latent::

    q_h      = [q_nope_h ; RoPE(q_pe_h)]                 (dn + dr)   from x (optionally via a
                                                                     rank-rq bottleneck q_lora_rank)
    k_h      = [W_UK_h c_kv ; RoPE(k_pe)]                (dn + dr)   W_UK_h: [dn, r]
    v_h      =  W_UV_h c_kv                              (dv)        W_UV_h: [dv, r]
    out      = W_O [softmax(q_h . k_h * scale) v_h]_h

(``kv_b_proj`` holds ``[W_UK_h; W_UV_h]`` head by head, as in transformers.) The decode cache
keeps only ``[c_kv ; RoPE(k_pe)]``: ``r + dr`` numbers per token and layer (576 for DeepSeek-V3's
``r = 512, dr = 64``, against ``2 * H * 128`` for MHA). Two exact forms compute the same output:

* **materialised** (prefill, full forward): expand the latent into per-head ``k, v`` and run
  softmax attention through the attend seam;
* **absorbed** (decoding): fold ``W_UK`` into the query, ``q_lat_h = W_UK_h^T q_nope_h`` (``[r]``),
  since ``q_nope_h . (W_UK_h c) = q_lat_h . c``; then attention is MQA over the cache itself (keys
  ``[c_kv ; k_pe]``, values ``c_kv``, one shared head) and ``W_UV_h`` is applied to the attended
  latent afterwards. Nothing per head is ever expanded over the cached tokens.

``form="auto"`` uses the materialised form without a cache and, with a cache, whichever of the
two needs fewer FLOPs for the call (:func:`mla_flops`): the absorbed form as soon as the cache
holds more than a token or two. Semantics, names and scale follow transformers'
``DeepseekV3Attention`` (softmax scale ``1 / sqrt(dn + dr)``, times ``mscale(factor,
mscale_all_dim)^2`` with YaRN scaling; RoPE on adjacent channel pairs with ``rope_interleave``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import (
    check_bool,
    check_choice,
    check_int,
    check_nonnegative_float,
    check_positive_float,
    check_probability,
)
from attnzoo.functional.softmax.varlen import _check_cu, attention_varlen
from attnzoo.masks import Mask
from attnzoo.nn.attention import _check_mask
from attnzoo.nn.base import AttentionBase, check_backend
from attnzoo.nn.cache import _LengthCache
from attnzoo.nn.costs import computed_pairs, resolve_backend, visible_pairs
from attnzoo.nn.parts import placed
from attnzoo.nn.positional import RotaryEmbedding, resolve_positions
from attnzoo.nn.rope_scaling import rope_inv_freq
from attnzoo.nn.spec import Cost, CostShape, VariantConfig, VariantSpec, register

__all__ = ["LatentCache", "MLASizes", "MultiHeadLatentAttention", "mla_flops", "mla_sizes"]

FORMS = ("auto", "absorbed", "materialised")
#: rope types whose frequencies depend on the sequence length: not served (the cache stores roped keys)
_SEQ_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class MLASizes:
    """The head sizes of an MLA layer: ``kv_lora_rank`` ``r``, ``qk_nope_head_dim`` ``dn``,
    ``qk_rope_head_dim`` ``dr``, ``v_head_dim`` ``dv``, ``q_lora_rank`` ``rq`` (``None``: a full
    query projection)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def qk_head_dim(self) -> int:
        """``dn + dr``: the query/key width of a head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """``r + dr``: numbers cached per token."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_sizes(head_dim: int) -> MLASizes:
    """DeepSeek-V3's proportions for a head width ``D``: ``dn = dv = D``, ``dr = D / 2`` (even),
    ``r = 4 D`` (``D = 128``: 128 / 64 / 128 / 512). The builder and the cost model use these when
    the sizes are not given; ``D >= 4`` (below it the proportions give no RoPE channel: pass the
    sizes explicitly)."""
    d = check_int(head_dim, "head_dim", minimum=4, owner="mla")  # below 4, dr = 2 (D // 4) would be 0
    return MLASizes(kv_lora_rank=4 * d, qk_nope_head_dim=d, qk_rope_head_dim=2 * (d // 4), v_head_dim=d)


def mla_flops(sizes: MLASizes, num_heads: int, n_new: int, n_keys: int, form: str) -> int:
    """FLOPs (2 per multiply-add) of the key/value side of one MLA call, per batch element:
    ``n_new`` queries over ``n_keys`` cached keys (projections of ``x`` excluded: both forms share them).

    * ``materialised``: expand every key ``2 n_keys r H (dn + dv)`` + attention
      ``2 n_new n_keys H (dn + dr + dv)``;
    * ``absorbed``: fold the query and unfold the output ``2 n_new H r (dn + dv)`` + attention over
      the latent ``2 n_new n_keys H (2 r + dr)``.
    """
    H, r, dn, dr, dv = num_heads, sizes.kv_lora_rank, sizes.qk_nope_head_dim, sizes.qk_rope_head_dim, sizes.v_head_dim
    if form == "materialised":
        return 2 * n_keys * r * H * (dn + dv) + 2 * n_new * n_keys * H * (dn + dr + dv)
    if form == "absorbed":
        return 2 * n_new * H * r * (dn + dv) + 2 * n_new * n_keys * H * (2 * r + dr)
    raise ValueError(f"mla_flops: form must be 'materialised' or 'absorbed', got {form!r}")


# --------------------------------------------------------------------------- the cache
class LatentCache(_LengthCache):
    """MLA's decode cache: ``latent [B, max_len, r + dr]``, per token the normalised latent ``c_kv``
    (``r``) then the roped shared key ``k_pe`` (``dr``). Preallocated, written in place by position.

    Protocol as :mod:`attnzoo.nn.cache` (``length``, ``batch_size``, ``nbytes``, ``reset``,
    ``mark``/``rollback``/``commit``); :meth:`update` returns the view of every token so far.
    Memory: ``batch_size * max_len * (r + dr) * itemsize`` bytes.
    """

    _batch_tensors = ("latent",)

    def __init__(self, batch_size: int, max_len: int, kv_lora_rank: int, rope_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self._batch_size = check_int(batch_size, "batch_size")
        self.max_len = check_int(max_len, "max_len")
        self.kv_lora_rank = check_int(kv_lora_rank, "kv_lora_rank")
        self.rope_dim = check_int(rope_dim, "rope_dim", minimum=0)
        self.latent = torch.zeros(self._batch_size, self.max_len, self.kv_lora_rank + self.rope_dim, device=device,
                                  dtype=dtype or torch.get_default_dtype())
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes held (the whole preallocated buffer)."""
        return self.latent.nbytes

    def bytes_per_token(self) -> float:
        """Bytes per cached token slot, the whole batch (``nbytes / max_len``, as :class:`KVCache`):
        ``batch_size * (r + dr) * itemsize``."""
        return self.nbytes / self.max_len

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the stored latents."""
        return self.latent.dtype

    def update(self, c_kv: Tensor, k_pe: Tensor) -> Tensor:
        """Write ``c_kv [B, n, r]`` and ``k_pe [B, n, dr]`` at positions ``length ..``; return
        ``latent [B, length, r + dr]`` (a view of every token so far)."""
        B, n = c_kv.shape[:2]
        if (B, c_kv.shape[-1], k_pe.shape[-1]) != (self._batch_size, self.kv_lora_rank, self.rope_dim) \
                or k_pe.shape[:2] != c_kv.shape[:2]:
            raise ValueError(f"LatentCache.update: expected c_kv [{self._batch_size}, n, {self.kv_lora_rank}] and "
                             f"k_pe [{self._batch_size}, n, {self.rope_dim}], got {tuple(c_kv.shape)} and "
                             f"{tuple(k_pe.shape)}")
        if c_kv.dtype != self.latent.dtype or k_pe.dtype != self.latent.dtype:
            raise TypeError(f"LatentCache: the cache stores {self.latent.dtype}, got {c_kv.dtype} and {k_pe.dtype}")
        start = self.length
        if start + n > self.max_len:
            raise ValueError(f"LatentCache overflow: {start} tokens cached + {n} new > max_len={self.max_len} "
                             f"(build the cache with a larger max_len)")
        idx = torch.arange(start, start + n, device=self.latent.device)
        self.latent.index_copy_(1, idx, torch.cat((c_kv, k_pe), dim=-1))
        self.length = start + n
        return self.latent[:, : self.length]

    def __repr__(self) -> str:
        return (f"LatentCache(batch_size={self.batch_size}, max_len={self.max_len}, kv_lora_rank={self.kv_lora_rank}, "
                f"rope_dim={self.rope_dim}, length={self.length}, dtype={self.latent.dtype})")


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class MLAOptions:
    """The less common :class:`MultiHeadLatentAttention` settings, one value passed as ``options=``
    (checked here: a wrong type is a ``TypeError``, a bad value a ``ValueError``, each naming the field).

    Attributes:
        rope_base: RoPE base (``rope_theta``) when the module builds its own rotary embedding.
        rope_interleave: rotate adjacent channel pairs (DeepSeek's checkpoints, transformers'
            ``rope_interleave=True``) instead of split halves.
        rope_scaling: a transformers ``rope_parameters`` dict (``rope_type`` ``linear``, ``yarn``,
            ``llama3``...): inverse frequencies and cos/sin scaling from
            :func:`attnzoo.nn.rope_scaling.rope_inv_freq`, and DeepSeek's softmax-scale factor
            ``mscale(factor, mscale_all_dim)^2``.
        max_position_embeddings: for rope types that derive ``factor`` from it.
        norm_eps: epsilon of the latent RMSNorms (transformers: 1e-6).
        scale: score scale, overriding the one above.
        dropout: attention-weight dropout (training only).
        form: ``"auto"``, ``"absorbed"`` or ``"materialised"`` (see the module docstring).
    """

    rope_base: float | None = None
    rope_interleave: bool | None = None
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int | None = None
    norm_eps: float = 1e-6
    scale: float | None = None
    dropout: float = 0.0
    form: str = "auto"

    def __post_init__(self) -> None:
        owner = "MLAOptions"
        check_nonnegative_float(self.norm_eps, "norm_eps", owner)
        if self.scale is not None:
            check_positive_float(self.scale, "scale", owner)
        if self.rope_base is not None:
            check_positive_float(self.rope_base, "rope_base", owner)
        if self.rope_interleave is not None:
            check_bool(self.rope_interleave, "rope_interleave", owner)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Mapping):
            raise TypeError(f"{owner}: rope_scaling must be a dict of rope parameters or None, got "
                            f"{type(self.rope_scaling).__name__}")
        if self.max_position_embeddings is not None:
            check_int(self.max_position_embeddings, "max_position_embeddings", owner=owner)
        check_probability(self.dropout, "dropout", owner)
        check_choice(self.form, "form", owner, choices=FORMS)


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


# --------------------------------------------------------------------------- the module
class MultiHeadLatentAttention(AttentionBase):
    """Multi-head latent attention (DeepSeek-V2/V3), causal self-attention with a latent cache.

    See the module docstring for the math. Parameters (names as transformers' DeepSeek-V3):
    ``q_proj [H (dn + dr), C]`` (no ``q_lora_rank``) or ``q_a_proj [rq, C]``, ``q_a_norm``
    (RMSNorm ``rq``), ``q_b_proj [H (dn + dr), rq]``; ``kv_a_proj [r + dr, C]`` (transformers'
    ``kv_a_proj_with_mqa``), ``kv_a_norm`` (RMSNorm ``r``), ``kv_b_proj [H (dn + dv), r]`` (rows of
    head ``h``: ``W_UK_h`` then ``W_UV_h``), ``out_proj [C, H dv]``. ``bias`` puts biases on
    ``q_a_proj``, ``kv_a_proj`` and ``out_proj`` (transformers' ``attention_bias``).

    Args:
        dim: model width ``C``.
        num_heads: heads ``H``.
        kv_lora_rank: latent width ``r``.
        qk_nope_head_dim: ``dn``, the per-head query/key channels without RoPE.
        qk_rope_head_dim: ``dr``, the RoPE channels (the key's are shared by all heads); even; 0 (a
            NoPE layer: keys of the latent alone) with ``rope=False``.
        v_head_dim: ``dv``.
        q_lora_rank: ``rq``, a low-rank query bottleneck (``None``: a full query projection).
        causal: causal attention (required with a cache).
        bias: see above.
        rope: ``None``/``True`` (a RoPE of ``dr`` channels with ``rope_base``), ``False`` (none), or
            a :class:`RotaryEmbedding` whose base, pairing and scaling are applied to the ``dr``
            channels (e.g. a ``DecoderLM``'s shared rope, built for the model's head width).
        backend: backend of :func:`attnzoo.attention`.
        options: an :class:`MLAOptions` (``rope_base``, ``rope_interleave``, ``rope_scaling``,
            ``max_position_embeddings``, ``norm_eps``, ``scale``, ``dropout``, ``form``); ``None``: the
            defaults. Device/dtype: build under ``with torch.device(...)`` and ``.to(dtype)``, or through
            ``build_attention("mla", ..., device=, dtype=, <MLAOptions fields>)``.

    Attributes:
        sizes: the :class:`MLASizes`; ``head_dim`` is ``v_head_dim`` (the width of a head's output,
            the ``D`` of the cost model's proportions), ``num_kv_heads`` is ``num_heads``.
        form: see the module docstring (settable).
        softmax_scale: the score scale in use.

    Shapes:
        ``forward(x [B, N, C]) -> [B, N, C]``; with ``return_weights`` also ``[B, H, N, Nk]``.
    """

    def __init__(self, dim: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None, causal: bool = True,
                 bias: bool = False, rope: bool | RotaryEmbedding | None = None, backend: str = "auto",
                 options: MLAOptions | None = None) -> None:
        cls = type(self).__name__
        if options is not None and not isinstance(options, MLAOptions):
            raise TypeError(f"{cls}: options must be an MLAOptions or None, got {type(options).__name__}")
        opts = MLAOptions() if options is None else options
        self.sizes = _check_sizes(cls, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank)
        self._norm_eps = opts.norm_eps
        # head_dim: the width of a head's output, dv (= dn = D with DeepSeek's proportions, as the cost model)
        super().__init__(dim, num_heads, head_dim=self.sizes.v_head_dim, bias=bias)
        self.causal = check_bool(causal, "causal", cls)
        self.backend = check_backend(backend, cls)
        self.options = opts
        self.form = opts.form
        self.rope, self._scaled = self._make_rope(cls, rope, opts)
        self.softmax_scale = self._scale(opts)

    # ------------------------------------------------------------------ construction
    def _make_projections(self, bias: bool, fk: dict[str, Any], kv_dim: int) -> None:
        s, C, H = self.sizes, self.dim, self.num_heads
        if s.q_lora_rank is None:
            self.q_proj = nn.Linear(C, H * s.qk_head_dim, bias=False, **fk)
        else:
            self.q_a_proj = nn.Linear(C, s.q_lora_rank, bias=bias, **fk)
            self.q_a_norm = nn.RMSNorm(s.q_lora_rank, eps=self._norm_eps, **fk)
            self.q_b_proj = nn.Linear(s.q_lora_rank, H * s.qk_head_dim, bias=False, **fk)
        self.kv_a_proj = nn.Linear(C, s.cache_width, bias=bias, **fk)
        self.kv_a_norm = nn.RMSNorm(s.kv_lora_rank, eps=self._norm_eps, **fk)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, H * (s.qk_nope_head_dim + s.v_head_dim), bias=False, **fk)
        self.out_proj = nn.Linear(H * s.v_head_dim, C, bias=bias, **fk)

    def _parts(self, attr: str) -> tuple[Tensor, Tensor, Tensor] | None:
        raise TypeError(f"{type(self).__name__} has no separate q/k/v projections (keys and values are "
                        f"up-projections of a latent); load q_proj/kv_a_proj/kv_b_proj directly")

    def _make_rope(self, cls: str, rope: object, opts: MLAOptions) -> tuple[RotaryEmbedding | None,
                                                                          tuple[Tensor, float] | None]:
        dr = self.sizes.qk_rope_head_dim
        if dr == 0 and rope is not False:
            raise ValueError(f"{cls}: qk_rope_head_dim=0 (no RoPE channels: a NoPE layer) needs rope=False")
        if rope is False:
            if opts.rope_scaling is not None or opts.rope_base is not None:
                raise ValueError(f"{cls}: rope=False does not take rope_base or rope_scaling")
            return None, None
        if rope is None or rope is True:
            built = RotaryEmbedding(dr, base=10000.0 if opts.rope_base is None else opts.rope_base,
                                    interleaved=bool(opts.rope_interleave))
        elif isinstance(rope, RotaryEmbedding):
            if opts.rope_base is not None:
                raise ValueError(f"{cls}: rope_base is given twice (a RotaryEmbedding carries its own base)")
            interleaved = rope.interleaved if opts.rope_interleave is None else opts.rope_interleave
            built = rope if rope.dim == dr and interleaved == rope.interleaved else RotaryEmbedding(
                dr, base=rope.base, interleaved=interleaved, scaling=rope.scaling, scaling_factor=rope.scaling_factor)
        else:
            raise TypeError(f"{cls}: rope must be None, a bool or a RotaryEmbedding, got {type(rope).__name__}")
        if opts.rope_scaling is None:
            return built, None
        if built.scaling is not None:
            raise ValueError(f"{cls}: rope_scaling is given twice (the RotaryEmbedding has scaling={built.scaling!r})")
        params = {"rope_theta": built.base, **dict(opts.rope_scaling)}
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type in _SEQ_DEPENDENT_ROPE:
            raise ValueError(f"{cls}: rope_type {rope_type!r} changes the frequencies with the sequence length, which "
                             f"a cache of rotated keys cannot follow; use 'default', 'linear', 'yarn' or 'llama3'")
        inv, att = rope_inv_freq(params, dr, max_position_embeddings=opts.max_position_embeddings, device="cpu")
        return built, (inv, att)

    def _scale(self, opts: MLAOptions) -> float:
        if opts.scale is not None:
            return opts.scale
        scale = self.sizes.qk_head_dim ** -0.5
        p = opts.rope_scaling or {}
        m_all = p.get("mscale_all_dim")
        if (p.get("rope_type", p.get("type", "default")) or "default") != "default" and m_all:
            factor = p.get("factor")
            if factor is None:
                raise ValueError(f"{type(self).__name__}: rope_scaling with mscale_all_dim needs 'factor'")
            m = _yarn_mscale(float(factor), float(m_all))
            scale = scale * m * m
        return scale

    @property
    def form(self) -> str:
        """``"auto"``, ``"absorbed"`` or ``"materialised"``: which form computes a call."""
        return self._form

    @form.setter
    def form(self, value: str) -> None:
        if value not in FORMS:
            raise ValueError(f"{type(self).__name__}: form must be one of {FORMS}, got {value!r}")
        self._form = value

    # ------------------------------------------------------------------ caches
    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LatentCache:
        """A :class:`LatentCache` of ``max_len`` tokens (``r + dr`` numbers each); device/dtype default
        to the module's."""
        return super().init_cache(batch_size, max_len, device=device, dtype=dtype)  # type: ignore[no-any-return]

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype) -> LatentCache:
        return LatentCache(batch_size, max_len, self.sizes.kv_lora_rank, self.sizes.qk_rope_head_dim, device=device,
                           dtype=dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,
                cache: LatentCache | None = None, positions: Tensor | None = None, return_weights: bool = False,
                cu_seqlens: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x [B, N, C]`` to itself.

        Args:
            x: the tokens; with a cache only the NEW ones (positions ``cache.length ..``).
            context: not supported (MLA is self-attention); must be ``None``.
            mask: as :func:`attnzoo.attention` accepts, on top of ``causal``; its key axis is
                absolute (``cache.length + N`` with a cache).
            cache: from :meth:`init_cache`; updated in place (a call that raises leaves it unchanged).
            positions: int ``[N]`` or ``[B, N]`` RoPE positions (default ``cache.length + arange(N)``).
            return_weights: also return the attention weights ``[B, H, N, Nk]``.
            cu_seqlens: packed input: ``x [1, T, C]`` holds ``S`` sequences end to end, int32
                cumulative lengths ``[S+1]``; RoPE positions restart at 0 in every sequence and the
                materialised form runs through :func:`attnzoo.attention_varlen` (equal to running each
                sequence alone). Not with a cache, ``mask``, ``positions`` or ``return_weights``.

        Returns:
            ``out [B, N, C]``, or ``(out, weights)``.
        """
        cls = type(self).__name__
        x = self.check_call(x, cache, positions, return_weights, LatentCache)
        if context is not None:
            raise ValueError(f"{cls}: context= (cross-attention) is not supported; MLA is self-attention")
        if cu_seqlens is not None:
            if cache is not None or mask is not None or positions is not None or return_weights:
                raise ValueError(f"{cls}: packed input (cu_seqlens) takes no cache, mask, positions or return_weights")
            return self.merge_heads(self._packed(x, cu_seqlens))
        if cache is not None and not self.causal:
            raise ValueError(f"{cls}: decoding with a cache needs causal=True")
        out, weights = self.guarded(cache, lambda: self._attention(x, mask, cache, positions, return_weights))
        y = self.merge_heads(out)  # [B, N, C]
        return (y, weights) if return_weights else y

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``q_nope [B, H, N, dn]``, ``q_pe [B, H, N, dr]`` (before RoPE)."""
        if self.sizes.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))  # [B, N, H (dn + dr)]
        B, N, _ = q.shape
        q = q.view(B, N, self.num_heads, self.sizes.qk_head_dim).transpose(1, 2)  # [B, H, N, dn + dr]
        return q[..., : self.sizes.qk_nope_head_dim], q[..., self.sizes.qk_nope_head_dim:]

    def _cos_sin(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        assert self.rope is not None
        if self._scaled is None:
            return self.rope.cos_sin(pos, dtype)
        inv, att = self._scaled
        ang = pos.to(dtype).unsqueeze(-1) * inv.to(pos.device, dtype)  # [N, dr/2] or [B, N, dr/2]
        ang = ang[None, None] if ang.dim() == 2 else ang[:, None]  # [1 | B, 1, N, dr/2]
        return torch.cos(ang) * att, torch.sin(ang) * att

    def _rotate(self, q_pe: Tensor, k_pe: Tensor, positions: Tensor | None, start: int) -> tuple[Tensor, Tensor]:
        """RoPE on ``q_pe [B, H, N, dr]`` and the shared ``k_pe [B, N, dr]``."""
        if self.rope is None:
            return q_pe, k_pe
        B, _, N, _ = q_pe.shape
        pos = resolve_positions(positions, N, start, q_pe.device, batch=B)
        cos, sin = self._cos_sin(pos, torch.float64 if q_pe.dtype == torch.float64 else torch.float32)
        return self.rope.rotate(q_pe, cos, sin), self.rope.rotate(k_pe[:, None], cos, sin)[:, 0]

    def _attention(self, x: Tensor, mask: Tensor | Mask | None, cache: LatentCache | None, positions: Tensor | None,
                   return_weights: bool) -> tuple[Tensor, Tensor | None]:
        s = self.sizes
        B, N, _ = x.shape
        start = 0 if cache is None else cache.length
        _check_mask(type(self).__name__, mask, B, self.num_heads, N, start + N)  # before anything is written
        q_nope, q_pe = self._queries(x)  # [B, H, N, dn], [B, H, N, dr]
        c_kv, k_pe = self.kv_a_proj(x).split((s.kv_lora_rank, s.qk_rope_head_dim), dim=-1)  # [B, N, r], [B, N, dr]
        c_kv = self.kv_a_norm(c_kv)
        q_pe, k_pe = self._rotate(q_pe, k_pe, positions, start)
        latent = None
        if cache is not None:
            latent = cache.update(c_kv, k_pe)  # [B, start + N, r + dr]
            c_kv, k_pe = latent[..., : s.kv_lora_rank], latent[..., s.kv_lora_rank:]
        kw: dict[str, Any] = {"mask": mask, "q_offset": start, "return_weights": return_weights}
        if self._absorbed_for(N, start + N, cache is not None):
            if latent is None:
                latent = torch.cat((c_kv, k_pe), dim=-1)
            return self._absorbed(q_nope, q_pe, latent, **kw)
        return self._materialised(q_nope, q_pe, c_kv, k_pe, **kw)

    def _packed(self, x: Tensor, cu_seqlens: Tensor) -> Tensor:
        """Packed ``x [1, T, C]``: positions restart per sequence, varlen attention; ``[1, H, T, dv]``."""
        if x.shape[0] != 1:
            raise ValueError(f"{type(self).__name__}: packed input (cu_seqlens) must be [1, T, C], got {tuple(x.shape)}")
        s, T = self.sizes, x.shape[1]
        cu = _check_cu(cu_seqlens, "cu_seqlens", T, x.device)
        t = torch.arange(T, device=x.device)
        pos = t - cu.long()[torch.searchsorted(cu.long()[1:], t, right=True)]  # [T], restarting per sequence
        q_nope, q_pe = self._queries(x)  # [1, H, T, dn], [1, H, T, dr]
        c_kv, k_pe = self.kv_a_proj(x).split((s.kv_lora_rank, s.qk_rope_head_dim), dim=-1)
        q_pe, k_pe = self._rotate(q_pe, k_pe, pos, 0)
        kv = self.kv_b_proj(self.kv_a_norm(c_kv))[0].view(T, self.num_heads, -1)  # [T, H, dn + dv]
        k_nope, v = kv.split((s.qk_nope_head_dim, s.v_head_dim), dim=-1)
        k = torch.cat((k_nope, k_pe[0, :, None].expand(-1, self.num_heads, -1)), dim=-1)  # [T, H, dn + dr]
        q = torch.cat((q_nope, q_pe), dim=-1)[0].transpose(0, 1)  # [T, H, dn + dr]
        out = attention_varlen(q, k, v, cu, cu, causal=self.causal, scale=self.softmax_scale, backend=self.backend)
        return out.transpose(0, 1)[None]  # [1, H, T, dv]

    def _absorbed_for(self, n_new: int, n_keys: int, cached: bool) -> bool:
        if self.form != "auto":
            return self.form == "absorbed"
        if not cached:
            return False
        H = self.num_heads
        return mla_flops(self.sizes, H, n_new, n_keys, "absorbed") < mla_flops(self.sizes, H, n_new, n_keys,
                                                                                 "materialised")

    def _core(self, q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor | None]:
        res = self.attend(q, k, v, scale=self.softmax_scale, dropout_p=self.options.dropout if self.training else 0.0,
                          backend=self.backend, **kw)
        return (res[0], res[1]) if kw["return_weights"] else (res, None)

    def _materialised(self, q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, *, mask: Tensor | Mask | None,
                      q_offset: int, return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Expand the latent into per-head keys and values, then softmax attention."""
        s = self.sizes
        B, M, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv).view(B, M, self.num_heads, -1).transpose(1, 2)  # [B, H, M, dn + dv]
        k_nope, v = kv.split((s.qk_nope_head_dim, s.v_head_dim), dim=-1)  # [B, H, M, dn], [B, H, M, dv]
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, self.num_heads, -1, -1)), dim=-1)  # [B, H, M, dn + dr]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [B, H, N, dn + dr]
        return self._core(q, k, v, mask=mask, causal=self.causal, q_offset=q_offset, return_weights=return_weights)

    def _absorbed(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor, *, mask: Tensor | Mask | None, q_offset: int,
                  return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Fold ``W_UK`` into the queries, attend over the latent as one shared head, unfold with ``W_UV``.

        The ``H`` heads' queries are laid along the query axis (``[B, 1, H N, r + dr]``, rows
        ``(h, n)``) so the single latent head is never repeated per head; causality and the user's
        mask are folded the same way."""
        s = self.sizes
        B, H, N, _ = q_nope.shape
        w = self.kv_b_proj.weight.view(H, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        w_uk, w_uv = w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim:]  # [H, dn, r], [H, dv, r]
        q_lat = torch.einsum("bhnd,hdr->bhnr", q_nope, w_uk.to(q_nope.dtype))  # [B, H, N, r]
        q = torch.cat((q_lat, q_pe), dim=-1).reshape(B, 1, H * N, -1)  # [B, 1, H N, r + dr]
        k = latent[:, None]  # [B, 1, M, r + dr]: one key head shared by all query heads
        v = k[..., : s.kv_lora_rank]  # [B, 1, M, r]: the latent is the value
        folded = self._folded_mask(mask, B, N, latent.shape[1], q_offset, q.device)
        o_lat, weights = self._core(q, k, v, mask=folded, causal=False, return_weights=return_weights)
        o_lat = o_lat.view(B, H, N, s.kv_lora_rank)  # [B, H, N, r]
        if weights is not None:
            weights = weights.view(B, H, N, -1)  # [B, H, N, M]
        return torch.einsum("bhnr,hvr->bhnv", o_lat, w_uv.to(o_lat.dtype)), weights  # [B, H, N, dv]

    def _folded_mask(self, mask: Tensor | Mask | None, B: int, N: int, M: int, start: int,
                     device: torch.device) -> Tensor | None:
        """Causality and ``mask`` over the folded queries: ``[B | 1, 1, H N, M]`` (``None``: all visible)."""
        H = self.num_heads
        causal = self.causal and N > 1  # one query at the last position sees every key
        if mask is None and not causal:
            return None
        if isinstance(mask, Mask):
            mask = mask.evaluate(B, H, start, 0, N, 0, M, device=device, expand=False)  # [B|1, H|1, N|1, M]
        if causal:
            vis = torch.arange(M, device=device) <= torch.arange(start, start + N, device=device)[:, None]  # [N, M]
            mask = vis if mask is None else mask & vis if mask.dtype == torch.bool else mask.masked_fill(
                ~vis, float("-inf"))
        assert mask is not None
        m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        return m4.expand(m4.shape[0], H, N, M).reshape(m4.shape[0], 1, H * N, M)

    def extra_repr(self) -> str:
        s = self.sizes
        out = (f"dim={self.dim}, num_heads={self.num_heads}, kv_lora_rank={s.kv_lora_rank}, "
               f"qk_nope_head_dim={s.qk_nope_head_dim}, qk_rope_head_dim={s.qk_rope_head_dim}, "
               f"v_head_dim={s.v_head_dim}")
        if s.q_lora_rank is not None:
            out += f", q_lora_rank={s.q_lora_rank}"
        return out + f", causal={self.causal}, form={self.form!r}"


def _check_sizes(cls: str, r: object, dn: object, dr: object, dv: object, rq: object) -> MLASizes:
    sizes = MLASizes(kv_lora_rank=check_int(r, "kv_lora_rank", owner=cls),
                     qk_nope_head_dim=check_int(dn, "qk_nope_head_dim", owner=cls),
                     qk_rope_head_dim=check_int(dr, "qk_rope_head_dim", owner=cls, minimum=0),
                     v_head_dim=check_int(dv, "v_head_dim", owner=cls),
                     q_lora_rank=None if rq is None else check_int(rq, "q_lora_rank", owner=cls))
    if sizes.qk_rope_head_dim % 2:
        raise ValueError(f"{cls}: qk_rope_head_dim rotates channel pairs and must be even, got {dr}")
    return sizes


# --------------------------------------------------------------------------- variant spec
#: the ``mla`` builder's keyword settings that make its :class:`MLAOptions`
OPTION_SETTINGS = tuple(MLAOptions.__dataclass_fields__)


def _build(dim: int, num_heads: int, *, causal: bool = True, head_dim: int | None = None,
           num_kv_heads: int | None = None, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           **kw: Any) -> nn.Module:
    if num_kv_heads is not None and num_kv_heads != num_heads:
        raise ValueError(f"mla: every head reads the shared latent; num_kv_heads must be None or num_heads "
                         f"({num_heads}), got {num_kv_heads}")
    sizes = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if any(name not in kw for name in sizes):  # DeepSeek-V3's proportions for the sizes not given
        if head_dim is None and dim % num_heads:
            raise ValueError(f"mla: dim ({dim}) must be divisible by num_heads ({num_heads}), or pass head_dim / "
                             f"the sizes")
        d = mla_sizes(dim // num_heads if head_dim is None else head_dim)
        for name in sizes:
            kw.setdefault(name, getattr(d, name))
    options = MLAOptions(**{k: kw.pop(k) for k in OPTION_SETTINGS if k in kw})
    with contextlib.nullcontext() if device is None else torch.device(device):
        module = MultiHeadLatentAttention(dim, num_heads, causal=causal, options=options, **kw)
    return placed(module, dtype, keep=(module.rope,))


def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """Materialised forward of ``N`` tokens with DeepSeek-V3's proportions (:func:`mla_sizes` of
    ``head_dim``); the cache holds ``r + dr`` numbers per token."""
    s = mla_sizes(cfg.head_dim)
    B, N, C, H, e = shape.batch, shape.seq_len, cfg.dim, cfg.num_heads, shape.elem_bytes
    r, dn, dr, dv = s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
    params = C * H * (dn + dr) + C * (r + dr) + r + r * H * (dn + dv) + H * dv * C
    flops_proj = 2 * B * N * (C * H * (dn + dr) + C * (r + dr) + r * H * (dn + dv) + H * dv * C)
    used = resolve_backend(cfg, shape)
    pairs, visible = computed_pairs(cfg, N, used), visible_pairs(cfg, N)
    flops_attn = 2 * B * H * pairs * (dn + dr + dv + (1 if used == "tiled" else 0))
    qkv_bytes = B * N * (2 * H * (dn + dr) + H * dv + r + dr) * e  # q, expanded k, v, the latent
    scores = B * H * N * N * shape.acc_bytes
    residue = B * H * N * (dv * e + shape.acc_bytes)  # kernel output and LSE
    if used == "reference":
        residue = 3 * scores
    elif used == "sdpa" and dn + dr != dv:  # torch's CPU SDPA falls back to its math kernel: P is kept
        residue = scores + B * H * N * dv * e
    per_token = (r + dr) * e
    return Cost(backend=used, flops_projections=flops_proj, flops_attention=flops_attn,
                flops_useful=2 * B * H * visible * (dn + dr + dv),
                flops_backward=2 * flops_proj + (2 * flops_attn if used == "reference" else (5 * flops_attn) // 2),
                bytes_moved=2 * B * N * C * e + params * e + 2 * qkv_bytes + 2 * B * N * H * dv * e,
                activation_bytes=B * N * C * e + qkv_bytes + B * N * H * dv * e + residue,
                kv_cache_bytes_per_token=per_token, kv_cache_bytes=B * N * per_token, kv_cache_max_tokens=None,
                params=params, visible_pairs=visible)


register(VariantSpec(
    "mla", "softmax", True, "O(N C^2 + N^2 C)", "O(N) (fused/tiled)",
    "latent c_kv + shared RoPE key (r + dr per token)", _build, _cost,
    causal_modes=(True, False), check={"q_lora_rank": 16}, masks="any", positions="rope",
))
