"""GLM-5-Next, the text model (transformers ``model_type="glm5_next_text"``: ``Glm5NextTextModel``;
the language model of ``Glm5NextForConditionalGeneration``, ``model_type="glm5_next"``, with its
``lm_head``) -> :class:`Glm5NextLM`, a :class:`~attnzoo.DecoderLM` whose layers run on ``hc_mult``
residual streams.

What transformers computes (``models/glm5_next/modeling_glm5_next.py`` of transformers 5.25; the
line numbers are that file's), each reproduced here:

* Streams (``Glm5NextTextModel.forward``, l. 1544-1607): the token embedding copied onto
  ``hc_mult`` streams ``[B, N, S, C]``; after the last layer their mean (``Glm5NextTextHyperHead``,
  l. 331), then the final RMSNorm and the head. No positions anywhere (NoPE).
* Hyper-connections (``Glm5NextTextHyperConnection``, l. 220-328; the layer, l. 1391-1441), one
  before the mixer (``attn_hc``) and one before the feed-forward (``ffn_hc``)::

      a = rmsnorm_unweighted(flatten(x)) @ fn^T        # float32, eps rms_norm_eps; [B, N, (2 + S) S]
      pre  = sigmoid(a_pre * scale[0] + base_pre) + hc_eps           # [B, N, S]
      post = 2 * sigmoid(a_post * scale[1] + base_post)              # [B, N, S]
      comb = softmax(a_comb * scale[2] + base_comb, -1) + hc_eps     # [B, N, S, S], then Sinkhorn:
             columns normalised, then hc_sinkhorn_iters - 1 times rows then columns (each + hc_eps)
      h    = sum_s pre_s x_s  ->  norm  ->  mixer (or feed-forward)
      x'_t = post_t * h + sum_s comb_{s t} x_s

  :class:`HyperConnection` (weights ``fn``, ``base``, ``scale`` under transformers' names).
* ``linear_attention`` layers (``Glm5NextTextLinearAttention``, l. 679-858):
  :class:`~attnzoo.nn.kda.KimiDeltaAttention` (Kimi Linear's KDA: short convolutions of
  ``linear_conv_kernel_dim`` with SiLU, L2 norm ``x / sqrt(|x|^2 + 1e-6)``, the low-rank forget
  and output gates, the sigmoid-gated RMSNorm) whose decay is bounded when ``linear_lower_bound``
  is set (``Glm5NextTextForgetGate``, l. 338-370): ``g = lower_bound * sigmoid(exp(A_log) * f)``,
  else Kimi's ``-exp(A_log) * softplus(f)``; ``f = x W_fa W_fb + dt_bias`` (:class:`BoundedKDA`).
  Padded tokens are zeroed before the layer (l. 733), which the recurrence skips.
* ``indexed_attention`` layers (``Glm5NextTextAttention``, l. 1190-1366): multi-head latent
  attention without RoPE (``qk_rope_head_dim`` must be 0, as transformers validates), softmax scale
  ``qk_nope_head_dim ** -0.5``, over the keys the DSA indexer selects for each query, eager form:
  the selected keys as an additive mask (0, or the dtype's minimum: l. 1328-1366)
  (:class:`IndexedLatentAttention`).
* The indexer (``Glm5NextTextIndexer``, l. 861-1150): per token ``k = LayerNorm(x W_k)`` and a
  pooling gate ``x W_gate``; tokens grouped into pools of ``index_kpool`` starting at each row's
  first real token; a pool's key is the softmax(gate + ape)-weighted mean of its tokens' keys; a
  pool is a candidate for a query when all its tokens are real and its last is visible;
  ``score = sum_h w_h(x) H^-1/2 relu(q_h . k_pool / sqrt(index_head_dim))`` with
  ``q = q_resid W_q``; the ``index_topk / index_kpool`` best pools are kept and expanded to their
  tokens, plus (``index_kpool_always_select_tail``) the visible tokens after the last complete
  pool. With a cache the indexer keeps every token's packed ``[k; gate; real]`` and rebuilds the
  pools from it each call (l. 937-944), as :class:`IndexedCache` does here. ``indexer_types``:
  a ``shared`` layer has no indexer and reuses the selection of the layer just before it, which
  must be a ``full`` indexed layer (l. 1293-1301, 1567-1578).
* Feed-forward (``mlp_layer_types``): ``dense`` a SwiGLU, ``sparse`` DeepSeek-V3's MoE (sigmoid
  scores, ``e_score_correction_bias`` choosing, group-limited routing, ``routed_scaling_factor``,
  ``n_shared_experts`` shared experts; l. 146-208), every SwiGLU clamped before the activation:
  ``silu(min(gate, swiglu_limit)) * clamp(up, -swiglu_limit, swiglu_limit)`` (l. 99-106,
  138-143) (:class:`ClampedSwiGLU`, :class:`ClampedMoE`).

Saved folders use the checkpoint's names (``hc_attn_fn``, the forget gate's weights on the layer,
``{q,k,v}_conv1d``, one tensor per expert): both load. Multi-token-prediction layers
(``layers.{j}``, ``j >= num_hidden_layers``) and the vision tower are dropped.

In half precision (``from_hf(dtype=)``, later ``.to()`` / ``.half()`` / ``.bfloat16()``) what
transformers keeps in float32 stays float32 (``_keep_in_fp32_modules_strict``, l. 1464-1474): the
MoE routers' weight (``gate.weight``), the KDA's ``dt_bias``, ``A_log`` and short convolutions
(``conv1d``: convolution and SiLU then in float32, rounded once, as its ``causal_conv1d_fn``), the
hyper-connections' ``base`` and ``scale``; ``e_score_correction_bias`` is ``score_bias``, float32 always.

Refused by name: ``qk_rope_head_dim != 0``, ``num_key_value_heads != num_attention_heads``,
``q_lora_rank=None`` (all three refused by transformers too), an activation other than SiLU,
``swiglu_limit`` ``None`` or ``<= 0``, ``index_topk`` not a multiple of ``index_kpool``, and ``indexer_types``
whose ``shared`` layer does not follow a ``full`` indexed layer (transformers fails there at run time).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._devices import KeepsFloat32
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.families._moe import put_moe
from attnzoo.models.families.bailing_hybrid import LimitedSwiGLU
from attnzoo.models.families.kimi_linear import put_kda, put_mla, saved_names
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.deepseek import extra_layer
from attnzoo.models.loop import StreamsLM
from attnzoo.models.parts import DecoderParts, head_for
from attnzoo.nn.cache import _LengthCache
from attnzoo.nn.kda import KimiDeltaAttention
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.recurrent import wide

__all__ = ["DEFAULTS", "DISPATCH", "BoundedKDA", "ClampedMoE", "ClampedSwiGLU", "DSAIndexer", "Glm5NextLM",
           "HyperBlock", "HyperConnection", "IndexedCache", "IndexedLatentAttention", "build_glm5_next", "canonical",
           "convert_glm5_next", "put_hyper_connections", "text_key"]

#: ``Glm5NextTextConfig``'s defaults of the keys read here, for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "n_shared_experts": 1, "n_routed_experts": 288,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0,
    "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 32, "swiglu_limit": 10.0, "linear_head_dim": 128,
    "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 4,
    "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "index_kpool": 16, "index_kpool_always_select_tail": True,
}

#: the KDA parameters transformers keeps in float32 (l. 1464-1474; ``"conv"``: ``conv1d``)
KDA_FLOAT32 = ("dt_bias", "A_log", "conv")

#: the checkpoint's names -> transformers' module names (its ``conversion_mapping`` for the family)
_SAVED = ((re.compile(r"\.self_attn\.(A_log|dt_bias|f_a_proj\.weight|f_b_proj\.weight)$"), r".self_attn.forget_gate.\1"),
          (re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".\1_hc.\2"))


# --------------------------------------------------------------------------- hyper-connections
class HyperConnection(KeepsFloat32, nn.Module):
    """Manifold-constrained hyper-connection of ``streams`` residual streams (see the module docstring).

    Args:
        dim: model width ``C``.
        streams: ``S`` (``hc_mult``).
        iters: Sinkhorn iterations (``hc_sinkhorn_iters``).
        eps: the floor added to ``pre``, ``comb`` and the Sinkhorn sums (``hc_eps``).
        norm_eps: epsilon of the unweighted RMSNorm of the flattened streams (``rms_norm_eps``).
        device, dtype: of ``fn`` (``base`` and ``scale`` are float32, as transformers keeps them, and
            stay so through half casts).

    Weights: ``fn [(2 + S) S, S C]``, ``base [(2 + S) S]``, ``scale [3]``.
    Shapes: :meth:`forward` ``x [B, N, S, C] -> (post [B, N, S], comb [B, N, S, S], h [B, N, C])``.
    """

    float32_params = ("base", "scale")

    def __init__(self, dim: int, streams: int, *, iters: int, eps: float, norm_eps: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"HyperConnection: streams must be an int >= 1, got {streams!r}")
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
            raise ValueError(f"HyperConnection: iters must be an int >= 1, got {iters!r}")
        self.streams, self.iters, self.eps, self.norm_eps = streams, iters, float(eps), float(norm_eps)
        width = (2 + streams) * streams
        self.fn = nn.Parameter(torch.randn(width, streams * dim, device=device, dtype=dtype) * 0.02)
        self.base = nn.Parameter(torch.zeros(width, device=device, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, device=device, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, N, S, _ = x.shape
        flat = x.reshape(B, N, -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        a = F.linear(flat, self.fn.float())  # [B, N, (2 + S) S]
        pre_w, post_w, comb_w = a.split([S, S, S * S], dim=-1)
        pre_b, post_b, comb_b = self.base.split([S, S, S * S])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(B, N, S, S) * comb_s + comb_b.view(S, S), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)

    @staticmethod
    def merge(x: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """The new streams: ``post_t * out + sum_s comb_{s t} x_s`` (``[B, N, S, C]``)."""
        return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(x.dtype).transpose(-1, -2), x)

    def extra_repr(self) -> str:
        return f"streams={self.streams}, iters={self.iters}, eps={self.eps}"


# --------------------------------------------------------------------------- feed-forward
class ClampedSwiGLU(LimitedSwiGLU):
    """Ling's :class:`~attnzoo.models.families.bailing_hybrid.LimitedSwiGLU` clamping before the
    activation instead of after it (GLM-5-Next's dense layers and shared experts):
    ``down(silu(min(gate(x), limit)) * clamp(up(x), -limit, limit))``, no biases; ``limit > 0``.

    Weights: ``gate_proj``, ``up_proj [F, C]``, ``down_proj [C, F]``. Shapes: ``[..., C] -> [..., C]``.
    """

    def forward(self, x: Tensor) -> Tensor:
        g = self.gate_proj(x).clamp(max=self.limit)  # [..., F]
        return self.down_proj(F.silu(g) * self.up_proj(x).clamp(-self.limit, self.limit))


class ClampedMoE(MixtureOfExperts):
    """A :class:`~attnzoo.nn.moe.MixtureOfExperts` of SwiGLU experts that clamp before the
    activation, as :class:`ClampedSwiGLU` (``limit``); the arguments, weights and routing as the
    base class's (``keep_router_float32``: the router weight in float32 whatever ``dtype``)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, routing: Routing, limit: float,
                 shared_expert: nn.Module | None = None, keep_router_float32: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=routing, shared_expert=shared_expert,
                         keep_router_float32=keep_router_float32, device=device, dtype=dtype)
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise ValueError(f"ClampedMoE: limit must be a number, got {limit!r}")
        self.limit = float(limit)

    def expert(self, e: int, x: Tensor) -> Tensor:
        g = F.linear(x, self.gate_proj[e]).clamp(max=self.limit)  # [T, F]
        u = F.linear(x, self.up_proj[e]).clamp(-self.limit, self.limit)
        return F.linear(F.silu(g) * u, self.down_proj[e])  # [T, C]


def _moe(hf: HFConfig, limit: float, kw: dict[str, Any]) -> nn.Module:
    """A ``sparse`` layer's :class:`ClampedMoE` (DeepSeek-V3's routing, ``n_shared_experts`` shared experts)."""
    C, F_, E, k = (hf.req(n) for n in ("hidden_size", "moe_intermediate_size", "n_routed_experts",
                                       "num_experts_per_tok"))
    routing = Routing("sigmoid_topk", norm_topk_prob=hf.get("norm_topk_prob", True, bool),
                      scaling=hf.get("routed_scaling_factor", 1.0, float), groups=hf.get("n_group", 1) or 1,
                      topk_groups=hf.get("topk_group", 1) or 1)
    n_shared = hf.get("n_shared_experts", 0) or 0
    shared = ClampedSwiGLU(C, F_ * n_shared, limit, **kw) if n_shared else None
    return ClampedMoE(C, F_, E, k, routing=routing, shared_expert=shared, limit=limit, keep_router_float32=True, **kw)


# --------------------------------------------------------------------------- linear layers
class BoundedKDA(KimiDeltaAttention):
    """:class:`~attnzoo.nn.kda.KimiDeltaAttention` whose decay is bounded when ``lower_bound`` is set:
    ``lower_bound * sigmoid(exp(A_log) * f)`` in ``[lower_bound, 0]``; ``None``: Kimi's
    ``-exp(A_log) * softplus(f)``; ``f = x W_fa W_fb + dt_bias``. ``keep_float32``: parameter groups
    kept in float32 whatever ``dtype`` (:meth:`~attnzoo.nn.kda.KimiDeltaAttention.keep_in_float32`).
    The other arguments as the base class's; the L2 norm of q and k is ``x / sqrt(|x|^2 + 1e-6)``,
    as transformers'."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, conv_size: int, norm_eps: float,
                 lower_bound: float | None, keep_float32: tuple[str, ...] = (),
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))):
            raise ValueError(f"BoundedKDA: lower_bound must be a number or None, got {lower_bound!r}")
        self_bound = None if lower_bound is None else float(lower_bound)
        super().__init__(dim, num_heads, head_dim=head_dim, conv_size=conv_size, norm_eps=norm_eps, qk_norm_eps=1e-6,
                         device=device, dtype=dtype)
        self.lower_bound = self_bound
        self.keep_in_float32(*keep_float32)

    def _log_decay(self, x: Tensor) -> Tensor:
        if self.lower_bound is None:
            return super()._log_decay(x)
        f = self.heads(wide(self.f_b_proj(self.f_a_proj(x))) + wide(self.dt_bias))  # [B, Hv, N, D]
        return self.lower_bound * torch.sigmoid(wide(self.A_log).exp()[:, None, None] * f)


# --------------------------------------------------------------------------- indexed attention
class IndexedCache(_LengthCache):
    """An indexed layer's decode cache: ``latent [B, max_len, r]`` (the normalised latents) and, for a
    layer with its own indexer, ``index [B, max_len, 2 Di + 1]`` (per token the indexer key, the pooling
    gate and 1 for a real token, 0 for padding). Written in place by position; protocol as
    :class:`~attnzoo.nn.mla.LatentCache`."""

    _batch_tensors = ("latent", "index")

    def __init__(self, batch_size: int, max_len: int, latent_width: int, index_width: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self._batch_size, self.max_len, self.length = batch_size, max_len, 0
        self.latent = torch.zeros(batch_size, max_len, latent_width, device=device, dtype=dtype)
        self.index = torch.zeros(batch_size, max_len, index_width, device=device, dtype=dtype) if index_width else None

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes + (0 if self.index is None else self.index.nbytes)

    def update(self, latent: Tensor, index: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Write ``latent [B, n, r]`` (and ``index [B, n, 2 Di + 1]``) at ``length ..``; return every token's."""
        start, n = self.length, latent.shape[1]
        if start + n > self.max_len:
            raise ValueError(f"IndexedCache overflow: {start} tokens cached + {n} new > max_len={self.max_len}")
        self.latent[:, start:start + n] = latent
        if self.index is not None and index is not None:
            self.index[:, start:start + n] = index
        self.length = start + n
        return self.latent[:, :self.length], None if self.index is None else self.index[:, :self.length]


class DSAIndexer(nn.Module):
    """GLM-5-Next's DSA indexer with pooled keys (see the module docstring); weights under
    transformers' names: ``wq_b [H Di, rq]``, ``wk [Di, C]``, ``k_norm`` (LayerNorm, eps 1e-6),
    ``weights_proj [H, C]``, ``index_kpool_compress_ape [P, Di]``, ``index_kpool_compress_gate [Di, C]``.

    Args:
        dim: model width ``C``.
        q_rank: ``q_lora_rank`` (the query is read from the attention's normalised query latent).
        heads, head_dim: ``index_n_heads``, ``index_head_dim``.
        topk: ``index_topk`` (tokens; a multiple of ``pool``).
        pool: ``index_kpool``.
        tail: ``index_kpool_always_select_tail``.
    """

    def __init__(self, dim: int, q_rank: int, *, heads: int, head_dim: int, topk: int, pool: int, tail: bool,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if pool < 1 or topk % pool:
            raise ValueError(f"DSAIndexer: topk ({topk}) must be a multiple of pool ({pool}) >= 1")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.heads, self.head_dim, self.topk, self.pool, self.tail = heads, head_dim, topk, pool, bool(tail)
        self.wq_b = nn.Linear(q_rank, heads * head_dim, bias=False, **kw)
        self.wk = nn.Linear(dim, head_dim, bias=False, **kw)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, **kw)
        self.weights_proj = nn.Linear(dim, heads, bias=False, **kw)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(pool, head_dim, **kw))
        self.index_kpool_compress_gate = nn.Parameter(torch.ones(head_dim, dim, **kw))

    def packed(self, x: Tensor, real: Tensor) -> Tensor:
        """Per token ``[k; gate; real]`` ``[B, N, 2 Di + 1]`` (what the cache keeps)."""
        k = self.k_norm(self.wk(x))
        return torch.cat([k, F.linear(x, self.index_kpool_compress_gate), real.to(k.dtype)[..., None]], dim=-1)

    def forward(self, x: Tensor, q_resid: Tensor, real: Tensor, packed: Tensor) -> Tensor:
        """Selected key indices ``[B, N, W]`` (long; ``-1``: none) of the ``N`` new queries over the
        ``M`` tokens of ``packed [B, M, 2 Di + 1]`` (the new ones last). ``real [B, N]``: the new
        tokens that are not padding. As transformers' l. 900-1003."""
        B, N = x.shape[:2]
        q = self.wq_b(q_resid).view(B, N, -1, self.head_dim)
        valid_keys = packed[..., -1].bool()  # [B, M]
        M = valid_keys.shape[-1]
        q_pos = M - N + torch.arange(N, device=x.device)
        visible = (torch.arange(M, device=x.device)[None, None] <= q_pos[None, :, None]) & valid_keys[:, None]
        pool_keys, pool_idx, pool_valid = self._pools(packed)
        scores = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * self.head_dim ** -0.5)
        weights = self.weights_proj(x).float() * (self.heads ** -0.5)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, N, P]
        pool_end = pool_idx[..., -1].clamp(0, M - 1)
        candidates = visible.gather(-1, pool_end[:, None, :].expand(B, N, -1)) & pool_valid[:, None]
        index_scores = index_scores.masked_fill(~candidates, torch.finfo(index_scores.dtype).min)
        chosen = index_scores.topk(min(self.topk // self.pool, index_scores.shape[-1]), dim=-1).indices
        chosen_ok = candidates.gather(-1, chosen)
        chosen_idx = pool_idx[torch.arange(B, device=x.device)[:, None, None], chosen]  # [B, N, K, P]
        topk = chosen_idx.flatten(-2).masked_fill(~chosen_ok[..., None].expand_as(chosen_idx).flatten(-2), -1)
        width = self.topk
        if self.tail and self.pool > 1:
            topk = torch.cat([topk, self._tail(visible, valid_keys)], dim=-1)
            width += self.pool - 1
        topk = F.pad(topk, (0, width - topk.shape[-1]), value=-1)[..., :width]
        return topk.masked_fill(~real[..., None], -1)

    def _pools(self, packed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Pool keys ``[B, P, Di]``, their token indices ``[B, P, pool]`` (-1: outside) and whether each
        is complete ``[B, P]``; pools start at each row's first real token (transformers' l. 1025-1098)."""
        keys, gates, valid = torch.split(packed, [self.head_dim, self.head_dim, 1], dim=-1)
        valid = valid.bool().squeeze(-1)
        B, M = keys.shape[:2]
        count = (M + self.pool - 1) // self.pool
        first = torch.where(valid.any(-1), valid.long().argmax(-1), torch.full((B,), M, device=packed.device))
        idx = first[:, None, None] + torch.arange(count * self.pool, device=packed.device).view(1, count, self.pool)
        rows, safe = torch.arange(B, device=packed.device)[:, None, None], idx.clamp(0, M - 1)
        in_pool = valid[rows, safe] & (idx < M)
        complete = in_pool.all(-1)
        idx = idx.masked_fill(~in_pool, -1)
        logits = (gates[rows, safe].float() + self.index_kpool_compress_ape.float()[None, None])
        probs = torch.nan_to_num(logits.masked_fill(~in_pool[..., None], float("-inf")).softmax(dim=2))
        pool_keys = (probs.to(keys.dtype) * keys[rows, safe]).sum(dim=2)
        keep = complete.any(0)
        return pool_keys[:, keep], idx[:, keep], complete[:, keep]

    def _tail(self, visible: Tensor, valid_keys: Tensor) -> Tensor:
        """The visible tokens after the last complete pool, ``[B, N, pool - 1]`` (transformers' l. 1100-1150)."""
        B, _, M = visible.shape
        first = torch.where(valid_keys.any(-1), valid_keys.long().argmax(-1),
                            torch.full((B,), M, device=visible.device))
        count = visible.long().sum(-1)
        tail_count = count.remainder(self.pool)
        offsets = torch.arange(self.pool - 1, device=visible.device)
        idx = (first[:, None] + count - tail_count)[..., None] + offsets
        ok = (offsets[None, None, :] < tail_count[..., None]) & idx.lt(M)
        ok = ok & visible.gather(dim=-1, index=idx.clamp(0, M - 1))
        return idx.masked_fill(~ok, -1)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, topk={self.topk}, pool={self.pool}, tail={self.tail}"


class IndexedLatentAttention(nn.Module):
    """Multi-head latent attention without RoPE over the keys a :class:`DSAIndexer` selects
    (GLM-5-Next's ``indexed_attention`` layers), eager softmax as transformers'.

    Args:
        dim: model width ``C``.
        num_heads: heads ``H``.
        sizes: ``(kv_lora_rank, q_lora_rank, qk_nope_head_dim, v_head_dim)``.
        indexer: the layer's own indexer, or ``None`` (a ``shared`` layer: the selection is given).
        bias: biases on ``q_a_proj``, ``kv_a_proj`` and ``out_proj`` (``attention_bias``).
        norm_eps: epsilon of the latent RMSNorms.
        dropout: attention-weight dropout (training only).
        share: whether the next layer reuses this layer's selection (returned by :meth:`forward`).

    Weights (names as :class:`~attnzoo.nn.mla.MultiHeadLatentAttention`): ``q_a_proj``, ``q_a_norm``,
    ``q_b_proj``, ``kv_a_proj``, ``kv_a_norm``, ``kv_b_proj``, ``out_proj``, ``indexer``.
    """

    def __init__(self, dim: int, num_heads: int, sizes: tuple[int, int, int, int], *, indexer: DSAIndexer | None,
                 bias: bool, norm_eps: float, dropout: float = 0.0, share: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        r, rq, dn, dv = sizes
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.num_heads, self.sizes, self.dropout, self.share = num_heads, sizes, float(dropout), bool(share)
        self.q_a_proj = nn.Linear(dim, rq, bias=bias, **kw)
        self.q_a_norm = nn.RMSNorm(rq, eps=norm_eps, **kw)
        self.q_b_proj = nn.Linear(rq, num_heads * dn, bias=False, **kw)
        self.kv_a_proj = nn.Linear(dim, r, bias=bias, **kw)
        self.kv_a_norm = nn.RMSNorm(r, eps=norm_eps, **kw)
        self.kv_b_proj = nn.Linear(r, num_heads * (dn + dv), bias=False, **kw)
        self.out_proj = nn.Linear(num_heads * dv, dim, bias=bias, **kw)
        self.indexer = indexer
        self.scale = dn ** -0.5

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> IndexedCache:
        p = self.out_proj.weight
        width = 0 if self.indexer is None else 2 * self.indexer.head_dim + 1
        return IndexedCache(batch_size, max_len, self.sizes[0], width, device=device or p.device,
                            dtype=dtype or p.dtype)

    def forward(self, x: Tensor, *, real: Tensor, cache: IndexedCache | None = None,
                selected: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """``x [B, N, C]`` (with a cache the new tokens), ``real [B, N]`` the non-padding ones,
        ``selected`` the previous layer's selection (a ``shared`` layer) -> ``(out [B, N, C],
        the selection [B, N, W] if the next layer shares it, else None)``."""
        _, _, dn, dv = self.sizes
        B, N, _ = x.shape
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(B, N, self.num_heads, dn).transpose(1, 2)  # [B, H, N, dn]
        latent = self.kv_a_norm(self.kv_a_proj(x))  # [B, N, r]
        packed = None if self.indexer is None else self.indexer.packed(x, real)
        if cache is not None:
            latent, packed = cache.update(latent, packed)
        M = latent.shape[1]
        kv = self.kv_b_proj(latent).view(B, M, self.num_heads, dn + dv).transpose(1, 2)
        k, v = kv.split([dn, dv], dim=-1)
        if self.indexer is not None:
            assert packed is not None
            selected = self.indexer(x, q_resid, real, packed)
        elif selected is None:
            raise ValueError("IndexedLatentAttention: a shared layer needs the selection of the layer before it")
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale + _selection_bias(selected, M, q.dtype)
        weights = F.dropout(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), self.dropout,
                            self.training)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(B, N, self.num_heads * dv)
        return self.out_proj(out), selected if self.share else None


def _selection_bias(selected: Tensor, M: int, dtype: torch.dtype) -> Tensor:
    """``selected [B, N, W]`` (``-1``: none) -> ``[B, 1, N, M]``: 0 at the selected keys, the dtype's minimum elsewhere."""
    ok = selected.ge(0) & selected.lt(M)
    counts = torch.zeros(*selected.shape[:2], M, dtype=torch.int32, device=selected.device)
    counts.scatter_add_(-1, selected.clamp(0, M - 1).long(), ok.to(torch.int32))
    zero = torch.zeros((), dtype=dtype, device=selected.device)
    return torch.where(counts.ne(0).unsqueeze(1), zero, torch.finfo(dtype).min)


# --------------------------------------------------------------------------- layers and model
class HyperBlock(nn.Module):
    """One GLM-5-Next layer on the residual streams: ``attn_hc`` -> ``attn_norm`` -> ``attn`` (a
    :class:`BoundedKDA` or an :class:`IndexedLatentAttention`), then ``ffn_hc`` -> ``ffn_norm`` ->
    ``ffn``; each result merged into the streams by its hyper-connection.

    Shapes: ``x [B, N, S, C] -> [B, N, S, C]``.
    """

    def __init__(self, attn: nn.Module, ffn: nn.Module, norm: Callable[[], nn.Module],
                 hc: Callable[[], HyperConnection]) -> None:
        super().__init__()
        self.attn, self.ffn = attn, ffn
        self.attn_norm, self.ffn_norm = norm(), norm()
        self.attn_hc, self.ffn_hc = hc(), hc()

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Any:
        return self.attn.init_cache(batch_size, max_len, device=device, dtype=dtype)

    def forward(self, x: Tensor, *, key_padding: Tensor | None, cache: Any = None,
                selected: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """``key_padding [B, past + N]`` (True = real; ``None``: all real); returns the new streams and
        the selection the next layer shares (or ``None``)."""
        post, comb, h = self.attn_hc(x)
        h = self.attn_norm(h)
        if isinstance(self.attn, IndexedLatentAttention):
            N = x.shape[1]
            real = (torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if key_padding is None
                    else key_padding[:, -N:])
            h, selected = self.attn(h, real=real, cache=cache, selected=selected)
        else:
            h, selected = self.attn(h, mask=key_padding, cache=cache), None
        x = self.attn_hc.merge(x, h, post, comb)
        post, comb, h = self.ffn_hc(x)
        return self.ffn_hc.merge(x, self.ffn(self.ffn_norm(h)), post, comb), selected


class Glm5NextLM(StreamsLM):
    """A :class:`~attnzoo.models.loop.LayerLoopLM` of :class:`HyperBlock` layers on ``streams``
    residual streams: the embedding copied onto every stream, the streams' mean before the final
    norm. Position-free (``positions`` are accepted and unused). ``cu_seqlens`` runs each packed
    sequence alone. Generation, caches and the rest as :class:`~attnzoo.DecoderLM`."""

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The streams ``[B, N, S, C]`` through the blocks (each may hand its key selection to the
        next); their mean ``[B, N, C]``."""
        h = x.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()  # [B, N, S, C]
        selected = None
        for i, block in enumerate(self.blocks):
            h, selected = block(h, key_padding=key_padding, cache=None if cache is None else cache[i],
                                selected=selected)
        return h.mean(dim=2)


# --------------------------------------------------------------------------- config
def _indexer_types(hf: HFConfig, depth: int) -> list[str]:
    """``indexer_types``, or transformers' schedule from ``index_topk_pattern`` /
    ``index_topk_freq`` / ``index_skip_topk_offset`` (``Glm5NextTextConfig.__post_init__``)."""
    types = hf.get("indexer_types", None, list)
    pattern = hf.raw("index_topk_pattern")
    if types is None and pattern is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if types is None:
        freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(depth)]
    if len(types) != depth or any(t not in ("full", "shared") for t in types):
        raise hf.unsupported(f"indexer_types={types!r} (one of 'full'/'shared' per layer)")
    return list(types)


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS` for absent keys, not for ``None`` ones; ``linear_attn_config`` folded;
    ``layer_types``, ``mlp_layer_types``, ``indexer_types`` filled in); refuses what has no equivalent."""
    data = {**DEFAULTS, **hf.data}  # absent keys only: None is a value here (linear_lower_bound=None: softplus)
    hf = HFConfig(data, hf.source, hf.arch)
    depth = hf.req("num_hidden_layers")
    linear = hf.get("linear_attn_config", None, dict)
    if linear is not None:
        for ours, theirs in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                             ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                             ("linear_lower_bound", "gate_lower_bound")):
            data[ours] = linear.get(theirs, data[ours])
        if linear.get("safe_gate", True) and data["linear_lower_bound"] is None:
            data["linear_lower_bound"] = -5.0
    kinds = hf.get("layer_types", None, list) or ["indexed_attention" if i % 4 == 3 else "linear_attention"
                                                   for i in range(depth)]
    data["layer_types"] = ["indexed_attention" if k == "full_attention" else k for k in kinds]
    data["mlp_layer_types"] = hf.get("mlp_layer_types", None, list) or (["dense"] * min(3, depth)
                                                                        + ["sparse"] * (depth - 3))
    hf = HFConfig(data, hf.source, hf.arch)
    data["indexer_types"] = _indexer_types(hf, depth)
    hf = HFConfig(data, hf.source, hf.arch)
    heads = hf.req("num_attention_heads")
    parts.unsupported_keys(hf, {
        "hidden_act": lambda v: v in ("silu", "swish"), "qk_rope_head_dim": lambda v: v == 0,
        "num_key_value_heads": lambda v: v in (None, heads), "q_lora_rank": lambda v: v is not None,
        "swiglu_limit": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
        "index_topk": lambda v: v % hf.req("index_kpool") == 0})
    _check_schedules(hf, depth)
    return hf


def _check_schedules(hf: HFConfig, depth: int) -> None:
    """The per-layer kinds: known values, and every ``shared`` indexed layer right after a ``full`` one."""
    parts.layer_types(hf, depth, ("linear_attention", "indexed_attention"))
    mlps = hf.req("mlp_layer_types", list)
    if len(mlps) != depth or any(t not in ("dense", "sparse") for t in mlps):
        raise hf.unsupported(f"mlp_layer_types={mlps!r} (one of 'dense'/'sparse' per layer)")
    kinds, index = hf.req("layer_types", list), hf.req("indexer_types", list)
    for i in range(depth):
        if kinds[i] == "indexed_attention" and index[i] == "shared" and not (
                i > 0 and kinds[i - 1] == "indexed_attention" and index[i - 1] == "full"):
            raise hf.unsupported(f"indexer_types={index!r}: layer {i} is a shared indexed layer that does not follow "
                                 f"a full indexed layer (transformers has no selection to give it)")


# --------------------------------------------------------------------------- build and convert
def _indexed(hf: HFConfig, i: int, kw: dict[str, Any]) -> IndexedLatentAttention:
    """Layer ``i``'s :class:`IndexedLatentAttention` (with its own indexer unless ``shared``)."""
    index = hf.req("indexer_types", list)
    C, rq = hf.req("hidden_size"), hf.req("q_lora_rank")
    indexer = None if index[i] == "shared" else DSAIndexer(
        C, rq, heads=hf.req("index_n_heads"), head_dim=hf.req("index_head_dim"), topk=hf.req("index_topk"),
        pool=hf.req("index_kpool"), tail=hf.get("index_kpool_always_select_tail", True, bool), **kw)
    share = indexer is not None and index[min(i + 1, len(index) - 1)] == "shared"
    sizes = (hf.req("kv_lora_rank"), rq, hf.req("qk_nope_head_dim"), hf.req("v_head_dim"))
    return IndexedLatentAttention(C, hf.req("num_attention_heads"), sizes, indexer=indexer,
                                  bias=hf.get("attention_bias", False, bool), norm_eps=hf.req("rms_norm_eps", float),
                                  dropout=hf.get("attention_dropout", 0.0, float), share=share, **kw)


def _layer(hf: HFConfig, i: int, kw: dict[str, Any]) -> HyperBlock:
    C, eps, limit = hf.req("hidden_size"), hf.req("rms_norm_eps", float), hf.req("swiglu_limit", float)
    if hf.req("layer_types", list)[i] == "linear_attention":
        attn: nn.Module = BoundedKDA(C, hf.req("linear_num_heads"), hf.req("linear_head_dim"),
                                     conv_size=hf.req("linear_conv_kernel_dim"), norm_eps=eps,
                                     lower_bound=hf.get("linear_lower_bound", None, float),
                                     keep_float32=KDA_FLOAT32, **kw)
    else:
        attn = _indexed(hf, i, kw)
    sparse = hf.req("mlp_layer_types", list)[i] == "sparse"
    ffn = _moe(hf, limit, kw) if sparse else ClampedSwiGLU(C, hf.req("intermediate_size"), limit, **kw)
    hc = functools.partial(HyperConnection, C, hf.req("hc_mult"), iters=hf.req("hc_sinkhorn_iters"),
                           eps=hf.req("hc_eps", float), norm_eps=eps, **kw)
    return HyperBlock(attn, ffn, parts.rms_norm(C, eps, **kw), hc)


def build_glm5_next(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                    dtype: Any = None) -> Glm5NextLM:
    """The decoder of a ``Glm5NextTextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    V, C, depth = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers")
    cfg = DecoderConfig(V, C, depth, hf.req("num_attention_heads"), pos="none", norm="rms",
                        norm_eps=hf.req("rms_norm_eps", float), tie_embeddings=hf.get("tie_word_embeddings", False, bool),
                        max_seq_len=parts.max_positions(hf))
    blocks = [_layer(hf, i, kw) for i in range(depth)]
    return Glm5NextLM(streams=hf.req("hc_mult"), config=cfg,
                      parts=DecoderParts(blocks=blocks, head=head_for(C, V, head_size, **kw)), **kw)


def text_key(key: str) -> str:
    """``model.language_model.X`` (``Glm5NextForConditionalGeneration``) -> ``model.X``;
    ``language_model.X`` (``Glm5NextModel``, no head) -> ``X`` (as ``Glm5NextTextModel`` saves it)."""
    for wrapped, plain in (("model.language_model.", "model."), ("language_model.", "")):
        if key.startswith(wrapped):
            return plain + key[len(wrapped):]
    return key


def _text_part(hf: HFConfig, sd: dict[str, Tensor]) -> tuple[HFConfig, dict[str, Tensor]]:
    """The text model of a ``glm5_next`` checkpoint (``text_config``; its language model's keys
    read as the text model's, :func:`text_key`; the vision tower dropped); a text checkpoint as it is."""
    if not hf.has("text_config"):
        return hf, sd
    text = {**hf.req("text_config", dict)}
    if hf.has("tie_word_embeddings"):
        text["tie_word_embeddings"] = hf.raw("tie_word_embeddings")
    out = {text_key(k): v for k, v in sd.items() if not k.startswith(("model.visual.", "visual."))}
    return HFConfig(text, f"{hf.source} (text_config)", hf.arch), out


def _put_layer(plan: Plan, hf: HFConfig, i: int) -> None:
    o, h = f"blocks.{i}.", f"layers.{i}."
    if hf.req("layer_types", list)[i] == "linear_attention":
        put_kda(plan, f"{o}attn.", f"{h}self_attn.")
    else:
        put_mla(plan, f"{o}attn.", f"{h}self_attn.", hf)
        if hf.req("indexer_types", list)[i] == "full":
            ours, theirs = f"{o}attn.indexer.", f"{h}self_attn.indexer."
            plan.put_pairs(ours, theirs, [(n, n) for n in ("wq_b", "wk", "weights_proj")], bias=False)
            plan.put_pairs(ours, theirs, [("k_norm", "k_norm")], bias=True)
            for n in ("index_kpool_compress_ape", "index_kpool_compress_gate"):
                plan.put(f"{ours}{n}", f"{theirs}{n}")
    if hf.req("mlp_layer_types", list)[i] == "sparse":
        put_moe(plan, f"{o}ffn.", f"{h}mlp.", "deepseek")
    else:
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
    plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    put_hyper_connections(plan, o, h)


def put_hyper_connections(plan: Plan, ours: str, theirs: str) -> None:
    """Plan a layer's two hyper-connections, ``{ours}attn_hc`` / ``{ours}ffn_hc`` (``fn``, ``base``,
    ``scale``), from the same names under ``theirs`` (GLM-5-Next, DeepSeek-V4, HY-V4)."""
    for name in (f"{hc}.{n}" for hc in ("attn_hc", "ffn_hc") for n in ("fn", "base", "scale")):
        plan.put(ours + name, theirs + name)


def convert_glm5_next(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> Glm5NextLM:
    """Build a GLM-5-Next decoder and copy the weights (``Glm5NextTextModel``: no head;
    ``Glm5NextForConditionalGeneration``: its language model and ``lm_head``; saved-folder names too;
    multi-token-prediction layers and the vision tower dropped)."""
    hf, sd = _text_part(hf, sd)
    hf, sd = canonical(hf), saved_names(sd, _SAVED)
    depth, prefix = hf.req("num_hidden_layers"), parts.head_size_of(hf, sd)[0]
    sd = {k: v for k, v in sd.items() if not extra_layer(k, prefix, depth)}
    model, plan, head_size = parts.start(hf, sd, build_glm5_next, device=device, dtype=dtype)
    for i in range(depth):
        _put_layer(plan, hf, i)
    parts.finish(plan, model, head_size)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "glm5_next_text": parts.Dispatch("GLM-5-Next", convert_glm5_next, ("Glm5NextTextModel",)),
    "glm5_next": parts.Dispatch("GLM-5-Next", convert_glm5_next, ("Glm5NextForConditionalGeneration",)),
}
