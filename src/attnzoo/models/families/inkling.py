"""Inkling (``inkling_text``) -> :class:`~attnzoo.DecoderLM`: ``InklingForCausalLM`` and
``InklingTextModel`` (Thinking Machines' Inkling, its text model; the multimodal
``InklingForConditionalGeneration`` / ``inkling_mm_model`` is not converted).

Line numbers below are transformers 5.25's ``models/inkling/modeling_inkling.py`` (``modeling``) and
``configuration_inkling.py`` (``config``). Every layer (``InklingDecoderLayer``, modeling 578-625)
is pre-norm with a residual short convolution after each sub-layer::

    h   = x + conv_attn(attn(input_layernorm(x)))
    out = h + conv_mlp(mlp(post_attention_layernorm(h)))

* The short convolutions (``InklingShortConvolution``, modeling 531-575): ``conv(t) = t +
  dwconv(t * keep)``, a causal depthwise convolution of kernel ``conv_kernel_size`` (no bias, no
  activation) over the input with the padded tokens zeroed (``apply_mask_to_padding_states``,
  modeling 421-431; the mask is the batch's 2-D padding mask, ``None`` on a one-token step), plus
  the unmasked input. Four per layer: on the attention's keys and values (``k_sconv`` /
  ``v_sconv``, modeling 221-222), on the attention's output (``attn_sconv``) and on the
  feed-forward's (``mlp_sconv``, modeling 617, 623). Here :class:`~attnzoo.nn.recurrent.ShortConv`
  through :func:`residual_conv`; their last ``kernel - 1`` inputs are the decode cache (a
  :class:`~attnzoo.nn.recurrent.RecurrentCache`), packed sequences each restart from zeros.
* Attention (``InklingAttention``, modeling 176-274): a ``"hybrid_sliding"`` layer has
  ``swa_num_attention_heads`` / ``swa_num_key_value_heads`` heads of ``swa_head_dim`` and a window of
  ``sliding_window_size`` keys (the query and ``W - 1`` before it), a ``"hybrid"`` layer
  ``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim`` and no window (modeling 181-187).
  ``q = q_norm(q_proj(x))``, ``k = k_norm(conv_k(k_proj(x)))``, ``v = conv_v(v_proj(x))`` (per-head
  RMSNorms, eps ``rms_norm_eps``; modeling 219-227), no rotary embedding, the score scale
  ``1 / head_dim`` (modeling 189), ``o_proj``. :class:`InklingAttention` (a
  :class:`~attnzoo.MultiHeadAttention` with its QK-norm parts and KV cache).
* The relative-position logits (``InklingRelativeLogits``, modeling 110-133, added to the scaled
  scores before the mask, modeling 164): ``r = r_proj(x)`` gives each query token ``d_rel``
  channels per head; ``table = r @ proj`` (``proj [d_rel, R]``) one bias per backward distance
  ``0 <= q - k < R``, zero beyond; ``R = sliding_window_size`` on the sliding layers,
  ``rel_extent`` on the full ones (modeling 187). Distances are stream positions (the cache's
  offsets, modeling 230-241), not ``position_ids``. Here the table ``[B, H, N, R]`` is computed once
  per call and read by a ``score_mod`` of :func:`attnzoo.attention` (:func:`relative_bias`:
  ``score + table[b, h, q - q0, q - k]``), exact with a cache (each new query reads its own row;
  the keys are the cache's) and on packed sequences (positions within each sequence, through
  :func:`attnzoo.attention_varlen`). It is additive, so the tiled backward does not re-run it for
  the score's gradient; its gradients reach ``r_proj`` and ``proj``.
* Logarithmic scaling on the full layers when ``log_scaling_n_floor`` is set (modeling 245-253):
  ``tau(p) = 1 + log_scaling_alpha * log(max((p + 1) / n_floor, 1))`` for the query at stream
  position ``p`` multiplies its query and its bias row (so its scores), in float32 or wider.
* Feed-forward by ``mlp_layer_types`` (modeling 582-586): ``"dense"`` the SwiGLU ``InklingMLP``
  times its learned ``global_scale`` (modeling 277-292; folded into ``down_proj``); ``"sparse"``
  ``InklingMoE`` (modeling 295-418): router logits over ``E`` routed then ``S`` shared experts in
  float32, the ``k`` routed experts of largest ``sigmoid + e_score_correction_bias`` chosen; each
  chosen and each shared expert weighs ``sigmoid(l_e) / sum(sigmoid over the k chosen and the S
  shared)`` (the softmax of the log-sigmoids, modeling 359-363) times ``route_scale`` times the
  router's ``global_scale`` (modeling 365). That is a :class:`~attnzoo.nn.moe.MixtureOfExperts`
  over ``E + S`` experts, top ``k + S``, ``Routing("sigmoid_topk", norm_topk_prob=True)``, whose
  ``score_bias`` is the correction bias with ``+inf`` for the shared experts (always chosen),
  the shared experts' weights stacked after the routed ones (same width
  ``moe_intermediate_size``) and ``route_scale * global_scale`` folded into every ``down_proj``.
* The embedding is normalised (``InklingNormedEmbedding``, modeling 628-634): the minimax family's
  :class:`~attnzoo.models.families.minimax.NormedEmbedding`; final ``norm``; the LM head divides
  the hidden states by ``logits_mup_width_multiplier`` (modeling 835; folded into ``lm_head``) and
  keeps the first ``unpadded_vocab_size`` logits (modeling 838-840): the converted model's
  ``vocab_size`` is that many (its head has that many rows; the embedding keeps all
  ``vocab_size`` rows, token ids past the head's are refused). ``lm_head`` is never tied
  (modeling 778), whatever ``tie_word_embeddings`` says. Multi-token-prediction weights
  (``model.mtp.*``) are ignored, as transformers ignores them (modeling 650).

The layer is family-local (:class:`InklingLayer`): the feed-forward's convolution needs a decode
cache, which a :class:`~attnzoo.TransformerBlock`'s feed-forward has not.

Half precision: transformers keeps the four convolutions in float32 (modeling 651-658); here they
run in the model's dtype (equal in float32 / float64).

Memory: the relative table of a call is ``B * H * N * R`` scores (transformers' eager path
materialises the bias densely, ``B * H * N * Nk``); the attention itself stays linear in ``N``
(the tiled backend reads the table one tile at a time).

Config keys a ``config.json`` leaves out take ``InklingTextConfig``'s defaults (:data:`DEFAULTS`),
its aliases (``sconv_kernel_size``, ``sliding_window``, ``num_local_experts``,
``model_max_length``, ``embedding_multiplier``; config 95-105) and legacy keys (``local_layer_ids``,
``dense_mlp_idx``, ``dense_intermediate_size``; config 151-170) read as transformers reads them
(:func:`canonical`). Refused by name: ``hidden_act`` other than SiLU, ``shared_expert_sink=False``
(transformers' router always scores the shared experts in the softmax and does not read the flag),
``n_shared_experts < 1`` (transformers' router slices ``[:-0]``, nothing), an unknown
``layer_types`` / ``mlp_layer_types`` entry, a ``logits_mup_width_multiplier`` of zero, a
non-positive ``log_scaling_n_floor``, a non-finite ``route_scale``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_int, is_finite_number
from attnzoo.functional.softmax.varlen import attention_varlen
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.minimax import NormedEmbedding
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.cache import CacheList
from attnzoo.nn.feature_attention import key_padding_from_mask, refuse_context
from attnzoo.nn.frontier import packed_positions
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.packing import check_packed_call
from attnzoo.nn.parts import AttentionParts, Scores, placed, qk_rmsnorm
from attnzoo.nn.recurrent import RecurrentCache, ShortConv

__all__ = ["DEFAULTS", "DISPATCH", "InklingAttention", "InklingLayer", "build_inkling", "canonical", "convert_inkling",
           "log_scale", "relative_bias", "residual_conv"]

#: ``InklingTextConfig``'s defaults of the keys read here (config 106-147), for a ``config.json``
#: that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 201024, "hidden_size": 6144, "num_hidden_layers": 66, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "swa_num_attention_heads": 64, "swa_num_key_value_heads": 16,
    "swa_head_dim": 128, "sliding_window_size": 512, "d_rel": 16, "rel_extent": 1024, "log_scaling_alpha": 0.1,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "conv_kernel_size": 4, "intermediate_size": 24576,
    "hidden_act": "silu", "moe_intermediate_size": 3072, "n_routed_experts": 256, "num_experts_per_tok": 6,
    "n_shared_experts": 2, "shared_expert_sink": True, "route_scale": 8.0, "logits_mup_width_multiplier": 24.0,
    "attention_dropout": 0.0,
}

#: ``InklingTextConfig.attribute_map`` (config 95-105): alias -> the key it stands for
ALIASES = {"sconv_kernel_size": "conv_kernel_size", "sliding_window": "sliding_window_size",
           "num_local_experts": "n_routed_experts", "model_max_length": "max_position_embeddings",
           "embedding_multiplier": "logits_mup_width_multiplier"}

#: the layer kinds of ``layer_types`` and ``mlp_layer_types``
TYPES = ("hybrid", "hybrid_sliding")
MLP_TYPES = ("dense", "sparse")

#: multi-token-prediction weights of a saved checkpoint (transformers ignores them: modeling 650)
_MTP = r"(model\.)?mtp\..*"

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------- parts
def residual_conv(conv: ShortConv, t: Tensor, keep: Tensor | None, prev: Tensor | None,
                  cu: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Inkling's short convolution (modeling 553-575): ``t + conv(t * keep)``, ``t [B, N, Ch]``,
    ``keep [B, N]`` bool (``None``: every token real), ``prev [B, Ch, K - 1]`` the inputs before
    ``t`` (``None``: zeros); ``cu``: packed sequences. Returns ``(y [B, N, Ch], last inputs)``."""
    u = t if keep is None else t * keep[..., None].to(t.dtype)
    y, last = conv(u, prev, cu)
    return t + y, last


def log_scale(positions: Tensor, n_floor: float, alpha: float, dtype: torch.dtype) -> Tensor:
    """``tau [N]`` of the queries at ``positions [N]`` (modeling 246-251):
    ``1 + alpha * log(max((p + 1) / n_floor, 1))``, in ``dtype``."""
    n = (positions + 1).to(dtype)
    return 1.0 + alpha * torch.log((n / n_floor).clamp(min=1.0))


def relative_bias(table: Tensor, q_offset: int, starts: Tensor | None = None) -> ScoreMod:
    """The ``score_mod`` adding Inkling's relative logits: ``table [B, H, Nq, R]`` holds query ``i``'s
    bias for the backward distances ``0 .. R - 1``; a score at query position ``q`` and key ``k``
    gets ``table[b, h, q - q_offset, q - k]`` when ``0 <= q - k < R``, else nothing. ``starts``
    (``[S]``, packed sequences: ``table [1, H, T, R]``, ``b`` the sequence, positions within it)
    gives each sequence's first row."""
    extent = table.shape[-1]

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        dist = q_idx - kv_idx
        if starts is None:
            row, batch = q_idx - q_offset, b
        else:
            row, batch = starts[b] + q_idx, torch.zeros_like(b)
        bias = table[batch, h, row, dist.clamp(0, extent - 1)].to(score.dtype)  # [B, H, bq, bk]
        return score + torch.where((dist >= 0) & (dist < extent), bias, 0.0)

    return mod


class InklingAttention(MultiHeadAttention):
    """Inkling's attention (transformers' ``InklingAttention``; see the module docstring): GQA
    without RoPE, short convolutions on the keys and values, per-head QK RMSNorm, scale
    ``1 / head_dim``, hidden-state-conditioned relative-position logits (a ``score_mod``), an
    optional window and logarithmic query scaling.

    Args:
        dim: model width ``C``.
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv``, ``D``.
        window: the keys before the query it sees (``sliding_window_size - 1``), ``None``: all.
        rel_extent: ``R``, the distances with a relative logit.
        d_rel: the relative channels per head.
        conv_size: the convolutions' kernel ``K``.
        norm_eps: the QK-norms' epsilon.
        log_scaling: ``(n_floor, alpha)`` of the logarithmic scaling, or ``None``.
        dropout: attention-weight dropout (training only).

    Weights: ``qkv_proj [(H + 2 Hkv) D, C]`` (rows ``[q; k; v]``), ``out_proj [C, H D]``,
    ``frontier.q_norm_weight`` / ``k_norm_weight [D]``, ``r_proj [H d_rel, C]``, ``rel_proj
    [d_rel, R]``, ``k_conv`` / ``v_conv`` (:class:`ShortConv`, ``weight [Hkv D, 1, K]``).

    ``forward(x [B, N, C], *, mask=, cache=, positions=, cu_seqlens=) -> [B, N, C]``: ``mask`` a key
    padding mask (bool ``[B, Nk]`` or ``[B, 1, 1, Nk]``, True = real token; ``Nk`` every token
    written so far plus the new ones), ``positions`` validated and unused (positions are stream
    positions), ``cu_seqlens`` packed sequences. Decode cache: a :class:`CacheList` of the KV cache
    (a sliding one with a window) and a :class:`RecurrentCache` of the key / value convolutions'
    inputs.
    """

    no_weights_reason = "not implemented for Inkling's attention"
    _cache_types = (CacheList,)

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, window: int | None,
                 rel_extent: int, d_rel: int, conv_size: int, norm_eps: float,
                 log_scaling: tuple[float, float] | None = None, dropout: float = 0.0) -> None:
        q_norm, k_norm = qk_rmsnorm("head", num_heads, num_kv_heads, head_dim, norm_eps)
        attn_parts = AttentionParts(q_norm=q_norm, k_norm=k_norm, scores=Scores(scale=1.0 / head_dim))
        super().__init__(dim, num_heads, num_kv_heads, head_dim=head_dim, bias=False, causal=True,
                         window=None if window is None else (window, 0), dropout=dropout, parts=attn_parts)
        owner = type(self).__name__
        self.rel_extent = check_int(rel_extent, "rel_extent", owner)
        self.d_rel = check_int(d_rel, "d_rel", owner)
        self.conv_size = check_int(conv_size, "conv_size", owner)
        self.log_scaling = None if log_scaling is None else (float(log_scaling[0]), float(log_scaling[1]))
        self.r_proj = nn.Linear(dim, self.num_heads * self.d_rel, bias=False)
        self.rel_proj = nn.Parameter(torch.randn(self.d_rel, self.rel_extent) * 0.02)
        kv = self.num_kv_heads * self.head_dim
        self.k_conv = ShortConv(kv, self.conv_size, False, {})
        self.v_conv = ShortConv(kv, self.conv_size, False, {})

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str,
                   dtype: torch.dtype) -> CacheList:
        kv = self.num_kv_heads * self.head_dim
        convs = {"k": (kv, self.conv_size - 1), "v": (kv, self.conv_size - 1)}
        return CacheList([super()._new_cache(batch_size, max_len, device, dtype),
                          RecurrentCache(batch_size, max_len, (1, 1, 1), convs, device=device, dtype=dtype)])

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,  # type: ignore[override]
                cache: CacheList | None = None, positions: Tensor | None = None, return_weights: bool = False,
                cu_seqlens: Tensor | None = None) -> Tensor:
        cls = type(self).__name__
        refuse_context(cls, context, "Inkling's attention is causal self-attention")
        x = self.check_call(x, cache, positions, return_weights, self._cache_types)
        if cu_seqlens is not None:
            cu = check_packed_call(cls, x, cu_seqlens, cache=cache, mask=mask, positions=positions)
            return self._packed_call(x, cu)
        return self._call(x, mask, cache)

    def _project(self, x: Tensor, keep: Tensor | None, prev: Mapping[str, Tensor],
                 cu: Tensor | None) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        """``q [B, H, N, D]``, ``k, v [B, Hkv, N, D]`` (convolved, normed) and the convolutions' last inputs."""
        D, H, Hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q_, k_, v_ = self.qkv_proj(x).split((H * D, Hkv * D, Hkv * D), dim=-1)
        k_, last_k = residual_conv(self.k_conv, k_, keep, prev.get("k"), cu)
        v_, last_v = residual_conv(self.v_conv, v_, keep, prev.get("v"), cu)
        q = self.frontier.norm_q(self.split_heads(q_))
        k = self.frontier.norm_k(self.split_heads(k_))
        return q, k, self.split_heads(v_), {"k": last_k, "v": last_v}

    def _table(self, x: Tensor, q: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``(q, table [B, H, N, R])``: the relative logits of ``x [B, N, C]``'s queries; with the
        logarithmic scaling both times ``tau`` of ``positions [N]`` (modeling 245-253)."""
        B, N, _ = x.shape
        table = (self.r_proj(x).view(B, N, self.num_heads, self.d_rel) @ self.rel_proj).transpose(1, 2)
        if self.log_scaling is None:
            return q, table
        wide = torch.promote_types(q.dtype, torch.float32)
        tau = log_scale(positions, *self.log_scaling, wide)[:, None]  # [N, 1]
        return (q.to(wide) * tau).to(q.dtype), (table.to(wide) * tau).to(table.dtype)

    def _call(self, x: Tensor, mask: Tensor | None, cache: CacheList | None) -> Tensor:
        """Self-attention of the new tokens ``x [B, N, C]`` (after ``cache``'s)."""
        B, N, _ = x.shape
        kv_cache, conv_cache = (None, None) if cache is None else (cache[0], cache[1])
        self._check_self_cache(kv_cache)
        start = 0 if cache is None else cache.length
        total = start + N
        padding = key_padding_from_mask(type(self).__name__, mask, B, total, total, x.device)  # [B, total]
        keep = None if padding is None else padding[:, start:]
        q, k, v, last = self._project(x, keep, {} if conv_cache is None else conv_cache.conv, None)
        q, table = self._table(x, q, torch.arange(start, total, device=x.device))
        if kv_cache is not None and conv_cache is not None:
            k, v, _ = kv_cache.update(k, v)  # the keys the new queries may need, from position `first`
            conv_cache.update(conv_cache.state, last, N)
        first = total - k.shape[2]
        key_mask = None if padding is None else padding[:, None, None, first:]  # [B, 1, 1, held]
        out = self.attend(q, k, v, mask=key_mask, causal=True, window=self.window, q_offset=start - first,
                          scale=self.scale, dropout_p=self.dropout if self.training else 0.0, backend=self.backend,
                          score_mod=relative_bias(table, start - first))
        return self.merge_heads(out)  # [B, N, C]

    def _packed_call(self, x: Tensor, cu: Tensor) -> Tensor:
        """Packed sequences ``x [1, T, C]`` (``cu [S+1]``), each as if alone."""
        if self.training and self.dropout:
            raise ValueError(f"{type(self).__name__}: packed input (cu_seqlens) has no attention dropout")
        q, k, v, _ = self._project(x, None, {}, cu)
        q, table = self._table(x, q, packed_positions(cu, x.shape[1]))
        out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                               causal=True, window=self.window, scale=self.scale, backend=self.backend,
                               score_mod=relative_bias(table, 0, cu[:-1].long()))  # [T, H, D]
        return self.merge_heads(out.transpose(0, 1).unsqueeze(0))  # [1, T, C]

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, rel_extent={self.rel_extent}, d_rel={self.d_rel}, "
                f"conv_size={self.conv_size}, log_scaling={self.log_scaling}")


class InklingLayer(nn.Module):
    """One Inkling layer (transformers' ``InklingDecoderLayer``): ``h = x + conv_attn(attn(attn_norm(x)))``,
    ``out = h + conv_ffn(ffn(ffn_norm(h)))`` with the residual short convolutions of
    :func:`residual_conv` (``attn_conv``, ``ffn_conv``: :class:`ShortConv` ``weight [C, 1, K]``).

    Decode cache: a :class:`CacheList` of the attention's cache and a :class:`RecurrentCache` of the
    two convolutions' inputs. ``forward`` takes :meth:`attnzoo.TransformerBlock.forward`'s arguments
    (no context)."""

    def __init__(self, attn_norm: nn.Module, attn: InklingAttention, ffn_norm: nn.Module, ffn: nn.Module,
                 *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.dim = attn.dim
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.attn_conv = ShortConv(self.dim, attn.conv_size, False, fk)
        self.ffn_conv = ShortConv(self.dim, attn.conv_size, False, fk)

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> CacheList:
        """The attention's cache, then the two convolutions' inputs."""
        attn = self.attn.init_cache(batch_size, max_len, device=device, dtype=dtype)
        w = self.attn_conv.weight
        convs = {"attn": (self.dim, self.attn.conv_size - 1), "ffn": (self.dim, self.attn.conv_size - 1)}
        return CacheList([attn, RecurrentCache(batch_size, max_len, (1, 1, 1), convs,
                                               device=w.device if device is None else device,
                                               dtype=w.dtype if dtype is None else dtype)])

    def forward(self, x: Tensor, context: Tensor | None = None, *, key_padding: Tensor | None = None,
                context_mask: Any = None, cache: CacheList | None = None, positions: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """``x [B, N, C]`` (with a cache the new tokens; with ``cu_seqlens`` packed ``[1, T, C]``) ->
        ``[B, N, C]``; ``key_padding [B, Nk]`` bool, True for real tokens."""
        if context is not None or context_mask is not None:
            raise ValueError("InklingLayer: no cross-attention; context must be None")
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"InklingLayer: x must be [B, N, {self.dim}], got {got}")
        attn_cache, conv_cache = (None, None) if cache is None else (cache[0], cache[1])
        kw: dict[str, Any] = {}
        for name, value in (("mask", key_padding), ("cache", attn_cache), ("positions", positions),
                            ("cu_seqlens", cu_seqlens)):
            if value is not None:
                kw[name] = value
        keep = None if key_padding is None else key_padding[:, key_padding.shape[1] - x.shape[1]:]  # [B, N]
        prev = {} if conv_cache is None else conv_cache.conv
        a, last_attn = residual_conv(self.attn_conv, self.attn(self.attn_norm(x), **kw), keep, prev.get("attn"),
                                     cu_seqlens)
        x = x + a
        f, last_ffn = residual_conv(self.ffn_conv, self.ffn(self.ffn_norm(x)), keep, prev.get("ffn"), cu_seqlens)
        if conv_cache is not None:
            conv_cache.update(conv_cache.state, {"attn": last_attn, "ffn": last_ffn}, x.shape[1])
        return x + f  # [B, N, C]


# --------------------------------------------------------------------------- the config
def _layer_kinds(hf: HFConfig, depth: int) -> list[str]:
    """``layer_types`` as transformers derives it when absent (config 152-159): sliding on the
    ``local_layer_ids``, else on every layer whose index plus one is not a multiple of 6."""
    if hf.get("layer_types", None, list) is not None:
        return parts.layer_types(hf, depth, TYPES)
    local = hf.get("local_layer_ids", None, list)
    ids = set(local) if local is not None else {i for i in range(depth) if (i + 1) % 6}
    return ["hybrid_sliding" if i in ids else "hybrid" for i in range(depth)]


def _mlp_kinds(hf: HFConfig, depth: int) -> list[str]:
    """``mlp_layer_types`` (config 160-162: absent, the first ``dense_mlp_idx`` layers dense)."""
    dense = hf.get("dense_mlp_idx", 0)
    return parts.layer_types(hf, depth, MLP_TYPES, key="mlp_layer_types",
                             default=["dense" if i < dense else "sparse" for i in range(depth)])


def _refuse(hf: HFConfig) -> None:
    """Refuse, by name, what the converter cannot reproduce (see the module docstring)."""
    act = hf.req("hidden_act", str)
    if act not in ("silu", "swish"):
        raise hf.unsupported(f"hidden_act={act!r} (the MLPs' and experts' activation; supported: 'silu')")
    parts.unsupported_keys(hf, {
        "shared_expert_sink": lambda v: v is True,
        "n_shared_experts": lambda v: isinstance(v, int) and v >= 1,
        "logits_mup_width_multiplier": lambda v: is_finite_number(v) and v != 0,
        "route_scale": is_finite_number,
        "log_scaling_alpha": is_finite_number,
    })
    floor = hf.raw("log_scaling_n_floor")
    if floor is not None and not (is_finite_number(floor) and floor > 0):
        raise hf.unsupported(f"log_scaling_n_floor={floor!r} (a positive number, or None)")


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads an ``InklingTextConfig``: its aliases resolved, the legacy
    ``dense_intermediate_size`` applied (config 164-168), :data:`DEFAULTS` where a key is absent,
    ``layer_types`` / ``mlp_layer_types`` derived when absent; unsupported options refused."""
    data = dict(hf.data)
    for alias, key in ALIASES.items():
        if data.get(key) is None and data.get(alias) is not None:
            data[key] = data[alias]
    dense = data.pop("dense_intermediate_size", None)
    if dense is not None:  # the experts' width was under intermediate_size
        data["moe_intermediate_size"] = data.get("intermediate_size", DEFAULTS["intermediate_size"])
        data["intermediate_size"] = dense
    out = HFConfig(data, hf.source, hf.arch).with_defaults(DEFAULTS)
    depth = out.req("num_hidden_layers")
    out.data["layer_types"] = _layer_kinds(out, depth)
    out.data["mlp_layer_types"] = _mlp_kinds(out, depth)
    _refuse(out)
    return out


def _attention_factory(hf: HFConfig, kind: str, kw: dict[str, Any]) -> Callable[[], InklingAttention]:
    """The factory of a ``kind`` layer's :class:`InklingAttention` on ``kw``'s device and dtype."""
    sliding = kind == "hybrid_sliding"
    pre = "swa_" if sliding else ""
    window = hf.req("sliding_window_size")
    floor = hf.raw("log_scaling_n_floor")
    settings: dict[str, Any] = dict(
        window=window - 1 if sliding else None, rel_extent=window if sliding else hf.req("rel_extent"),
        d_rel=hf.req("d_rel"), conv_size=hf.req("conv_kernel_size"), norm_eps=hf.req("rms_norm_eps", float),
        log_scaling=None if sliding or floor is None else (floor, hf.req("log_scaling_alpha", float)),
        dropout=hf.req("attention_dropout", float))
    heads = (hf.req("hidden_size"), hf.req(f"{pre}num_attention_heads"), hf.req(f"{pre}num_key_value_heads"),
             hf.req(f"{pre}head_dim"))

    def make() -> InklingAttention:
        with contextlib.nullcontext() if kw["device"] is None else torch.device(kw["device"]):
            module = InklingAttention(*heads, **settings)
        return placed(module, kw["dtype"])  # type: ignore[return-value]

    return make


def _ffn_factory(hf: HFConfig, kind: str, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """A dense SwiGLU, or the mixture over the routed then the shared experts (module docstring)."""
    C = hf.req("hidden_size")
    if kind == "dense":
        return parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", **kw)
    E, k, S = hf.req("n_routed_experts"), hf.req("num_experts_per_tok"), hf.req("n_shared_experts")
    if k > E:  # transformers' topk fails too
        raise CheckpointFormatError(f"{hf.source}: num_experts_per_tok={k} is more than n_routed_experts={E}")
    return functools.partial(MixtureOfExperts, C, hf.req("moe_intermediate_size"), E + S, k + S,
                             routing=Routing("sigmoid_topk", norm_topk_prob=True), **kw)


def _vocab(hf: HFConfig, head_size: int | None) -> int:
    """The converted model's vocabulary: ``unpadded_vocab_size`` when an LM head keeps fewer logits."""
    V = hf.req("vocab_size")
    unpadded = hf.get("unpadded_vocab_size", None)
    return V if head_size is not None or unpadded is None else min(V, unpadded)


def build_inkling(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of an ``InklingTextConfig`` (random weights; nothing folded: see the module docstring)."""
    hf = canonical(hf)
    C, eps, kw = hf.req("hidden_size"), hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    norm = parts.rms_norm(C, eps, **kw)
    blocks = [InklingLayer(norm(), _attention_factory(hf, kind, kw)(), norm(), _ffn_factory(hf, mlp, kw)(), **kw)
              for kind, mlp in zip(hf.data["layer_types"], hf.data["mlp_layer_types"], strict=True)]
    embedding = NormedEmbedding(hf.req("vocab_size"), C, norm=norm(), **kw)
    view = HFConfig({**hf.data, "vocab_size": _vocab(hf, head_size), "tie_word_embeddings": False}, hf.source, hf.arch)
    return parts.decoder(view, blocks, head_size=head_size, norm_eps=eps, embedding=embedding, **kw)


# --------------------------------------------------------------------------- the weights
def _scaled(t: Tensor, factor: Tensor | float) -> Tensor:
    """``t * factor`` in float32 or wider (the copy into the model rounds once)."""
    wide = torch.promote_types(t.dtype, torch.float32)
    return t.to(wide) * (factor.to(wide) if isinstance(factor, Tensor) else factor)


def _put_attention(plan: Plan, ours: str, theirs: str) -> None:
    """An :class:`InklingAttention` at ``ours`` from ``InklingAttention`` at ``theirs``."""
    plan.put_cat(f"{ours}qkv_proj.weight", [f"{theirs}{n}_proj.weight" for n in "qkv"])
    plan.put(f"{ours}out_proj.weight", f"{theirs}o_proj.weight")
    plan.put(f"{ours}r_proj.weight", f"{theirs}r_proj.weight")
    plan.put(f"{ours}rel_proj", f"{theirs}rel_logits_proj.proj")
    for n in "kv":
        plan.put(f"{ours}{n}_conv.weight", f"{theirs}{n}_sconv.conv1d.weight")
    for n in "qk":
        plan.put(f"{ours}frontier.{n}_norm_weight", f"{theirs}{n}_norm.weight")


def _put_dense(plan: Plan, ours: str, theirs: str) -> None:
    """``InklingMLP``: SwiGLU, its ``global_scale`` folded into ``down_proj``."""
    plan.put_pairs(ours, theirs, [("gate_proj", "gate_proj"), ("up_proj", "up_proj")], bias=False)
    scale = plan.src.take(f"{theirs}global_scale")
    if scale is not None:
        plan.put(f"{ours}down_proj.weight", f"{theirs}down_proj.weight", lambda w: _scaled(w, scale))


def _put_moe(plan: Plan, ours: str, theirs: str, route_scale: float) -> None:
    """``InklingMoE``: the routed experts then the shared ones stacked, the router as is, ``+inf``
    choice biases for the shared experts, ``route_scale * gate.global_scale`` folded into ``down_proj``."""
    take = plan.src.take
    gate_up, down = take(f"{theirs}experts.gate_up_proj"), take(f"{theirs}experts.down_proj")
    shared = {n: take(f"{theirs}shared_experts.{n}") for n in ("gate_proj", "up_proj", "down_proj")}
    bias, scale = take(f"{theirs}gate.e_score_correction_bias"), take(f"{theirs}gate.global_scale")
    plan.put(f"{ours}router.weight", f"{theirs}gate.weight")
    if gate_up is None or down is None or bias is None or scale is None or any(t is None for t in shared.values()):
        return  # named as missing by Plan.apply
    width, where = gate_up.shape[1] // 2, f"{plan.src.prefix}{theirs}"
    plan.put_tensor(f"{ours}gate_proj", torch.cat([gate_up[:, :width], shared["gate_proj"]]),
                    f"{where}experts.gate_up_proj[:, :F] + shared_experts.gate_proj")
    plan.put_tensor(f"{ours}up_proj", torch.cat([gate_up[:, width:], shared["up_proj"]]),
                    f"{where}experts.gate_up_proj[:, F:] + shared_experts.up_proj")
    plan.put_tensor(f"{ours}down_proj", _scaled(torch.cat([down, shared["down_proj"]]), scale * route_scale),
                    f"{where}experts.down_proj + shared_experts.down_proj x route_scale x gate.global_scale")
    sink = torch.full((shared["down_proj"].shape[0],), float("inf"), dtype=torch.float32)
    plan.put_tensor(f"{ours}score_bias", torch.cat([bias.float(), sink]),
                    f"{where}gate.e_score_correction_bias + inf (the shared experts)")


def _put_head(plan: Plan, model: DecoderLM, head_size: int | None, multiplier: float) -> list[str]:
    """The final norm and the LM head (its first ``vocab_size`` rows, divided by the multiplier);
    returns the checkpoint keys to ignore."""
    plan.put("norm.weight", "norm.weight")
    ignore = [_MTP]
    if head_size is None:
        rows = model.vocab_size
        plan.src.prefix = ""
        plan.put("lm_head.weight", "lm_head.weight", lambda w: _scaled(w[:rows], 1.0 / multiplier))
    elif head_size > 0:
        plan.src.prefix = ""
        plan.put("lm_head.weight", "score.weight")
    else:
        ignore.append(r"lm_head\.weight")
    return ignore


def convert_inkling(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build an Inkling decoder and copy the weights (the multipliers and scales folded in: see the
    module docstring)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_inkling, device=device, dtype=dtype)
    plan.put("tok_emb.norm.weight", "embed_tokens.embed_norm.weight")
    route_scale = hf.req("route_scale", float)
    for i, mlp in enumerate(hf.data["mlp_layer_types"]):
        o, h = f"blocks.{i}.", f"layers.{i}."
        _put_attention(plan, f"{o}attn.", f"{h}self_attn.")
        if mlp == "dense":
            _put_dense(plan, f"{o}ffn.", f"{h}mlp.")
        else:
            _put_moe(plan, f"{o}ffn.", f"{h}mlp.", route_scale)
        plan.put_pairs(o, h, [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                              ("attn_conv", "attn_sconv.conv1d"), ("ffn_conv", "mlp_sconv.conv1d")], bias=False)
    ignore = _put_head(plan, model, head_size, hf.req("logits_mup_width_multiplier", float))
    plan.apply(model, ignore=ignore)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"inkling_text": parts.Dispatch("Inkling", convert_inkling, ("InklingForCausalLM", "InklingTextModel"))}
