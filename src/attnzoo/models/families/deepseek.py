"""The DeepSeek MLA lineage -> :class:`~attnzoo.DecoderLM`: transformers' ``deepseek_v3``
(DeepSeek-V3, R1, V3.1, Kimi K2), ``deepseek_v2`` (DeepSeek-V2, V2-Lite, V2.5) and their
descendants ``glm4_moe_lite``, ``mistral4`` and ``minicpm5_moe``; the ``*ForCausalLM`` and base
``*Model`` classes of each.

Every layer is pre-norm (``input_layernorm``, ``post_attention_layernorm``: RMSNorms of
``rms_norm_eps``) around:

* Attention: :class:`~attnzoo.nn.mla.MultiHeadLatentAttention` with RoPE on its
  ``qk_rope_head_dim`` channels (``modeling_deepseek_v3.py`` 333-468, ``modular_deepseek_v2.py``
  232-365). The weights keep transformers' names except ``kv_a_proj_with_mqa -> kv_a_proj``,
  ``q_a_layernorm -> q_a_norm``, ``kv_a_layernorm -> kv_a_norm``, ``o_proj -> out_proj``; the
  latent RMSNorms use transformers' fixed epsilon 1e-6 (``DeepseekV3RMSNorm(q_lora_rank)``).
  ``q_lora_rank=None``: a full ``q_proj``. ``attention_bias``: biases on ``q_a_proj``,
  ``kv_a_proj_with_mqa`` and ``o_proj`` only. RoPE rotates adjacent channel pairs: ``rope_interleave``
  (``modeling_deepseek_v3.py`` 294-330), DeepSeek-V2's complex product on pairs ``(2i, 2i + 1)``
  (``modular_deepseek_v2.py`` 139-152, always interleaved); ``rope_interleave=False`` rotates split
  halves. YaRN and the other fixed-frequency rope types scale cos/sin by their attention factor and
  the softmax scale ``1 / sqrt(dn + dr)`` by ``mscale(factor, mscale_all_dim)^2``
  (``modeling_deepseek_v3.py`` 389, ``yarn_apply_mscale``).
* Feed-forward: a dense SwiGLU (``intermediate_size``) on the dense layers -- ``i <
  first_k_dense_replace`` (``modeling_deepseek_v3.py`` 470-480, ``modular_deepseek_v2.py`` 369), or
  ``mlp_layer_types[i] == "dense"`` (GLM-4-MoE-Lite, MiniCPM5-MoE; by default the first layer only,
  ``modular_glm4_moe_lite.py`` 125, 164) -- and a mixture of experts on the others, stacked as
  transformers holds them (``experts.gate_up_proj [E, 2F, C]`` rows ``[gate; up]``,
  ``experts.down_proj [E, C, F]``; saved folders with one tensor per expert load too), plus
  ungated shared experts (a SwiGLU of ``moe_intermediate_size * n_shared_experts``; none when 0):

  - DeepSeek-V3, GLM-4-MoE-Lite, MiniCPM5-MoE (``modeling_deepseek_v3.py`` 119-226):
    :func:`~._moe.deepseek_moe`: router logits in float32, sigmoid scores; the experts chosen by
    ``score + e_score_correction_bias`` among the ``topk_group`` best of ``n_group`` groups (a
    group's score: its two best biased scores), weighted by the unbiased scores, renormalised
    (``norm_topk_prob``, ``+ 1e-20``), times ``routed_scaling_factor``.
  - DeepSeek-V2 (``modular_deepseek_v2.py`` 159-209): :class:`SoftmaxGroupMoE`: float32 softmax
    scores, ``topk_method="greedy"`` the top ``num_experts_per_tok``, ``"group_limited_greedy"``
    the top among the ``topk_group`` groups of best *maximum* score (the others zeroed); never
    renormalised (transformers' V2 router drops ``norm_topk_prob``), times
    ``routed_scaling_factor``. ``mlp_bias`` puts biases on the dense MLP and the shared experts
    (``LlamaMLP``), not on the routed experts.
  - Mistral-4 (``modular_mistral4.py`` 65-96): :class:`SoftmaxGroupMoE` with softmax scores in the
    hidden states' dtype, groups scored by their two best, renormalised (``norm_topk_prob``).
* Mistral-4's attention (``modular_mistral4.py`` 106-160) also scales every query channel by
  ``1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings))``
  (:class:`PositionScaledLatentAttention`); ``p`` counts from a row's first real token, as
  transformers' ``generate`` computes it (its forward without ``position_ids`` counts left
  padding too). Its ``partial_rotary_factor`` is the rope channels' share of the query head
  (``configuration_mistral4.py`` 107-128: the absent ``rope_parameters`` default to that YaRN).
* MiniCPM5-MoE's attention is not latent (``modular_minicpm5_moe.py`` 174-227): grouped-query
  attention (``head_dim``, ``num_key_value_heads``) with split-half RoPE of ``rope_parameters`` and
  an element-wise sigmoid output gate: ``q_gate_proj`` rows ``[q_h; gate_h]`` per head go to the
  query rows of :class:`~attnzoo.MultiHeadAttention` and its ``output_gate="element"``.
* Multi-token-prediction layers (``layers.{j}`` with ``j >= num_hidden_layers``, V3's
  ``num_nextn_predict_layers``) are not part of the causal LM: their weights are dropped, as
  transformers drops them (``modeling_deepseek_v3.py`` 536).

A ``config.json`` that leaves keys out reads them as :data:`DEFAULTS` (the config classes' defaults).

Refused by name: ``num_key_value_heads != num_attention_heads`` for latent attention (every head
reads the one latent), ``pretraining_tp != 1``, the ``dynamic`` / ``longrope`` rope types and a
``partial_rotary_factor`` other than the rope channels' (:func:`~attnzoo.models.hf.deepseek.mla_rope`;
MiniCPM5-MoE: other than 1), an activation other than SiLU in the experts (the dense layers take
any gated one), a ``topk_method`` other than ``greedy`` / ``group_limited_greedy`` (V2),
``moe_layer_freq != 1`` (transformers ignores it: a checkpoint trained with it would run
differently there), expert groups that do not divide the experts (into groups of >= 2 where a
group is scored by its two best) or cannot hold ``num_experts_per_tok`` in the ``topk_group``
kept, MiniCPM5-MoE's ``attention_bias``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import FeedForward
from attnzoo.masks import Mask
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import deepseek_moe, put_moe
from attnzoo.models.families.kimi_linear import mlp_types, put_mla
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.deepseek import extra_layer, mla_rope
from attnzoo.nn.mla import LatentCache, MLAOptions, MLASizes, MultiHeadLatentAttention
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.parts import placed
from attnzoo.nn.positional import resolve_positions
from attnzoo.variants import build_attention

__all__ = ["DEFAULTS", "DISPATCH", "PositionScaledLatentAttention", "SoftmaxGroupMoE", "SoftmaxRouting",
           "build_deepseek", "canonical", "convert_deepseek_v2", "convert_deepseek_v3", "convert_glm4_moe_lite",
           "convert_minicpm5_moe", "convert_mistral4", "moe_layers", "position_scaled_attention"]

_COMMON: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "pretraining_tp": 1, "rope_theta": 10000.0,
}

#: the config classes' defaults of the keys read here (``DeepseekV3Config``, ``DeepseekV2Config``),
#: for a ``config.json`` that leaves them out
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {**_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8,
                    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "max_position_embeddings": 4096, "rope_interleave": True},
    "deepseek_v2": {**_COMMON, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                    "moe_intermediate_size": 1407, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
                    "first_k_dense_replace": 0, "max_position_embeddings": 2048, "topk_method": "greedy",
                    "mlp_bias": False},
    "glm4_moe_lite": {**_COMMON, "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
                      "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
                      "n_shared_experts": 1, "n_routed_experts": 64, "routed_scaling_factor": 1.8, "q_lora_rank": 768,
                      "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
                      "num_experts_per_tok": 4, "norm_topk_prob": True, "max_position_embeddings": 202752,
                      "rms_norm_eps": 1e-5, "rope_interleave": True},
    "mistral4": {**_COMMON, "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 12288,
                 "moe_intermediate_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0, "kv_lora_rank": 256,
                 "q_lora_rank": 1024, "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1,
                 "num_experts_per_tok": 4, "first_k_dense_replace": 0, "norm_topk_prob": True,
                 "max_position_embeddings": 1048576, "rope_interleave": True},
    "minicpm5_moe": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
                     "attention_dropout": 0.0, "rope_theta": 5_000_000.0, "vocab_size": 130560, "hidden_size": 2048,
                     "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 32,
                     "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 524288,
                     "moe_intermediate_size": 512, "num_experts_per_tok": 16, "n_shared_experts": 1,
                     "n_routed_experts": 160, "routed_scaling_factor": 3.66, "n_group": 1, "topk_group": 1,
                     "norm_topk_prob": True},
}

TOPK_METHODS = ("greedy", "group_limited_greedy")
#: the model types routing as DeepSeek-V3 (sigmoid scores, ``e_score_correction_bias``)
SIGMOID = ("deepseek_v3", "glm4_moe_lite", "minicpm5_moe")
#: the model types whose layers list their kinds in ``mlp_layer_types`` (default: one dense layer)
LAYER_TYPED = ("glm4_moe_lite", "minicpm5_moe")


@dataclass(frozen=True)
class SoftmaxRouting:
    """The softmax routing of :class:`SoftmaxGroupMoE`.

    Attributes:
        scaling: ``routed_scaling_factor`` on the kept weights.
        groups: expert groups ``G`` (1: plain top-k).
        topk_groups: the groups a token's experts may come from.
        group_score: a group's score: ``"max"`` its best probability (DeepSeek-V2), ``"top2"`` the
            sum of its two best (Mistral-4).
        norm_topk_prob: renormalise the kept probabilities (``+ 1e-20``; Mistral-4; V2 never does).
        float32: the router's matmul in float32 (V2 keeps its router in float32; Mistral-4 routes
            in the hidden states' dtype).
    """

    scaling: float = 1.0
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    norm_topk_prob: bool = False
    float32: bool = True


class SoftmaxGroupMoE(MixtureOfExperts):
    """DeepSeek-V2's / Mistral-4's mixture of experts: softmax routing, optionally group-limited.

    Args:
        dim, hidden, num_experts, top_k: as :class:`~attnzoo.nn.moe.MixtureOfExperts`.
        routing: a :class:`SoftmaxRouting`.
        shared_expert: the ungated shared experts' module, or ``None``.
        device, dtype: of the parameters.

    Routing of ``x [T, C]``: ``p = softmax(x W_r^T)`` (``[T, E]``); with groups, the experts
    outside the ``topk_groups`` groups of best score get ``p = 0``; the weights are the top-``k``
    ``p`` (renormalised with ``norm_topk_prob``) times ``scaling``. Weights as
    :class:`~attnzoo.nn.moe.MixtureOfExperts` (no ``score_bias``).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, routing: SoftmaxRouting,
                 shared_expert: nn.Module | None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=Routing("softmax_topk", scaling=routing.scaling),
                         shared_expert=shared_expert, device=device, dtype=dtype)
        G, g, smallest = routing.groups, routing.topk_groups, 2 if routing.group_score == "top2" else 1
        if routing.group_score not in ("max", "top2"):
            raise ValueError(f"SoftmaxGroupMoE: group_score must be 'max' or 'top2', got {routing.group_score!r}")
        if G < 1 or num_experts % G or (G > 1 and num_experts // G < smallest) or not 1 <= g <= G \
                or top_k > g * (num_experts // G):
            raise ValueError(f"SoftmaxGroupMoE: groups={G} must divide num_experts={num_experts} (groups of >= "
                             f"{smallest}), 1 <= topk_groups={g} <= groups, and top_k={top_k} fit the kept groups")
        self.softmax_routing = routing

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(weights [T, k], experts [T, k], logits [T, E])`` of ``x [T, C]`` (see the class docstring)."""
        r = self.softmax_routing
        wide = torch.promote_types(x.dtype, torch.float32) if r.float32 else x.dtype
        logits = F.linear(x.to(wide), self.router.weight.to(wide))  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)).to(wide)
        choice = probs
        if r.groups > 1:
            by_group = probs.unflatten(-1, (r.groups, -1))  # [T, G, E / G]
            score = by_group.amax(-1) if r.group_score == "max" else by_group.topk(2, dim=-1).values.sum(-1)  # [T, G]
            best = score.topk(r.topk_groups, dim=-1).indices  # [T, topk_groups]
            keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, best, True)  # [T, G]
            choice = by_group.masked_fill(~keep.unsqueeze(-1), 0.0).flatten(-2)
        experts = torch.topk(choice, self.top_k, dim=-1).indices  # [T, k]
        weights = probs.gather(-1, experts)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * r.scaling).to(x.dtype), experts, logits

    def extra_repr(self) -> str:
        r = self.softmax_routing
        return (f"{super().extra_repr()}, groups={r.groups}, topk_groups={r.topk_groups}, "
                f"group_score={r.group_score!r}, norm_topk_prob={r.norm_topk_prob}")


class PositionScaledLatentAttention(MultiHeadLatentAttention):
    """Multi-head latent attention whose queries are scaled by their position (Mistral-4's
    ``llama_4_scaling_beta``, ``modeling_ministral3.py`` 105-107)::

        q(p) = q * (1 + beta * log(1 + floor(p / original_max_position_embeddings)))

    on every channel (nope and rope) before attention, in every form (materialised, absorbed, packed:
    positions restarting per sequence as the RoPE's).

    Args (``dim``, ``num_heads``, ``sizes``, ``bias``, ``options`` as for
    :class:`~attnzoo.nn.mla.MultiHeadLatentAttention`):
        beta: ``llama_4_scaling_beta``.
        original: ``original_max_position_embeddings`` (``> 0``).

    Build under ``with torch.device(...)`` for the device (or through :func:`position_scaled_attention`).
    """

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions, beta: float,
                 original: int) -> None:
        super().__init__(dim, num_heads, kv_lora_rank=sizes.kv_lora_rank, qk_nope_head_dim=sizes.qk_nope_head_dim,
                         qk_rope_head_dim=sizes.qk_rope_head_dim, v_head_dim=sizes.v_head_dim,
                         q_lora_rank=sizes.q_lora_rank, bias=bias, rope=True, options=options)
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ValueError(f"PositionScaledLatentAttention: original must be an int >= 1, got {original!r}")
        self.beta, self.original = float(beta), original
        self._query_scale: Tensor | None = None

    def _scale_of(self, pos: Tensor) -> Tensor:
        """``[..., 1, N, 1]`` factors of positions ``pos [N]`` or ``[B, N]``."""
        f = 1 + self.beta * torch.log1p(torch.floor(pos.to(torch.float64) / self.original))
        f = f[None, None] if f.dim() == 1 else f[:, None]  # [1 | B, 1, N]
        return f.unsqueeze(-1)

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q_nope, q_pe = super()._queries(x)  # [B, H, N, dn], [B, H, N, dr]
        if self._query_scale is None:
            return q_nope, q_pe
        f = self._query_scale.to(q_nope.dtype)
        return q_nope * f, q_pe * f

    def _attention(self, x: Tensor, mask: Tensor | Mask | None, cache: LatentCache | None, positions: Tensor | None,
                   return_weights: bool) -> tuple[Tensor, Tensor | None]:
        start = 0 if cache is None else cache.length
        self._query_scale = self._scale_of(resolve_positions(positions, x.shape[1], start, x.device, batch=x.shape[0]))
        try:
            return super()._attention(x, mask, cache, positions, return_weights)
        finally:
            self._query_scale = None

    def _packed(self, x: Tensor, cu_seqlens: Tensor) -> Tensor:
        t, cu = torch.arange(x.shape[1], device=x.device), cu_seqlens.to(x.device).long()
        self._query_scale = self._scale_of(t - cu[torch.searchsorted(cu[1:], t, right=True)])  # restarting per sequence
        try:
            return super()._packed(x, cu_seqlens)
        finally:
            self._query_scale = None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, beta={self.beta}, original={self.original}"


def position_scaled_attention(dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                              scaling: tuple[float, int], device: Any = None,
                              dtype: Any = None) -> PositionScaledLatentAttention:
    """A :class:`PositionScaledLatentAttention` (``scaling = (beta, original)``) on ``device`` in
    ``dtype`` (its rotary embedding kept in its own)."""
    with contextlib.nullcontext() if device is None else torch.device(device):
        module = PositionScaledLatentAttention(dim, num_heads, sizes, bias=bias, options=options, beta=scaling[0],
                                               original=scaling[1])
    placed(module, dtype, keep=(module.rope,))
    return module


def canonical(hf: HFConfig, model_type: str) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS` where a key is absent); refuses what has
    no equivalent (see the module docstring)."""
    full = hf.with_defaults(DEFAULTS[model_type])
    if "q_lora_rank" in hf.data and hf.data["q_lora_rank"] is None:  # null: a full query projection
        full = HFConfig({**full.data, "q_lora_rank": None}, hf.source, hf.arch)
    hf = _mistral4_defaults(full) if model_type == "mistral4" else full
    H = hf.req("num_attention_heads")
    if model_type == "minicpm5_moe":
        parts.unsupported_keys(hf, {"attention_bias": lambda v: not v, "use_gated_attention": lambda v: v is not False,
                                    "partial_rotary_factor": lambda v: v in (None, 1, 1.0)})
    else:
        parts.unsupported_keys(hf, {"num_key_value_heads": lambda v: v in (None, H)})
    parts.unsupported_keys(hf, {"pretraining_tp": lambda v: v in (None, 1), "moe_layer_freq": lambda v: v in (None, 1)})
    if model_type == "deepseek_v2":
        parts.unsupported_keys(hf, {"topk_method": lambda v: v in TOPK_METHODS})
    if any(moe_layers(hf, model_type)):
        parts.unsupported_keys(hf, {"hidden_act": lambda v: v in ("silu", "swish")})
        (groups, topk_groups), E = _groups(hf, model_type), hf.req("n_routed_experts")
        smallest = 1 if model_type == "deepseek_v2" else 2  # the others score a group by its two best
        if groups > 1 and (E % groups or E // groups < smallest or not 1 <= topk_groups <= groups
                           or hf.req("num_experts_per_tok") > topk_groups * (E // groups)):
            raise hf.unsupported(f"n_group={groups} with topk_group={topk_groups} (groups of >= {smallest} of the "
                                 f"n_routed_experts={E} experts holding num_experts_per_tok={hf.raw('num_experts_per_tok')})")
    return hf


def _mistral4_defaults(hf: HFConfig) -> HFConfig:
    """``rope_parameters`` as ``Mistral4Config`` fills them when absent (``configuration_mistral4.py``
    107-128): YaRN x128 from 8192 positions, ``llama_4_scaling_beta`` 0.1."""
    if hf.has("rope_parameters") or hf.has("rope_scaling"):
        return hf
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
    return HFConfig({**hf.data, "rope_parameters": rope}, hf.source, hf.arch)


def _query_scaling(hf: HFConfig) -> tuple[HFConfig, tuple[float, int] | None]:
    """Mistral-4's rope dict split: ``(hf without the keys that are not the rotary's, (beta,
    original_max_position_embeddings) or None)``. Its ``partial_rotary_factor`` must be the rope
    channels' share ``qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim)`` (the rotary's
    width is then ``qk_rope_head_dim``, as MLA rotates)."""
    key = "rope_parameters" if hf.has("rope_parameters") else "rope_scaling"
    rope = dict(hf.get(key, {}, dict))
    dr, dn = hf.req("qk_rope_head_dim"), hf.req("qk_nope_head_dim")
    share = rope.pop("partial_rotary_factor", None)
    if share is not None and abs(share - dr / (dn + dr)) > 1e-9:
        raise hf.unsupported(f"partial_rotary_factor={share} (MLA rotates the qk_rope_head_dim channels: "
                             f"{dr / (dn + dr)})")
    beta = rope.pop("llama_4_scaling_beta", None)
    rope.pop("max_position_embeddings", None)
    original = rope.get("original_max_position_embeddings")
    scaling = None if not beta else (float(beta), int(original or parts.max_positions(hf)))
    return HFConfig({**hf.data, key: rope}, hf.source, hf.arch), scaling


def moe_layers(hf: HFConfig, model_type: str) -> list[bool]:
    """Per layer: a mixture of experts (``i >= first_k_dense_replace``; GLM-4-MoE-Lite:
    ``mlp_layer_types[i] == "sparse"``, by default every layer but the first) or the dense MLP."""
    depth = hf.req("num_hidden_layers")
    if model_type in LAYER_TYPED:
        return [t == "sparse" for t in mlp_types(hf, depth)]
    first = hf.get("first_k_dense_replace", 0)
    return [i >= first for i in range(depth)]


def _groups(hf: HFConfig, model_type: str) -> tuple[int, int]:
    """``(n_group, topk_group)`` as the router uses them (V2's ``greedy`` ignores them: 1 group)."""
    if model_type == "deepseek_v2" and hf.get("topk_method", "greedy", str) == "greedy":
        return 1, 1
    return hf.get("n_group", 1) or 1, hf.get("topk_group", 1) or 1


def _attention(hf: HFConfig, model_type: str, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of a layer's :class:`~attnzoo.nn.mla.MultiHeadLatentAttention` (Mistral-4's with
    ``llama_4_scaling_beta``: a :class:`PositionScaledLatentAttention`)."""
    query_scaling = None
    if model_type == "minicpm5_moe":
        params = parts.rope_params(hf)
        if params.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
            raise hf.unsupported(f"partial_rotary_factor={params['partial_rotary_factor']}")
        C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
        rope = parts.rotary(hf, params, hf.get("head_dim", C // H))
        return parts.attention_factory(hf, window=None, rope=rope, output_gate="element", **kw)
    if model_type == "mistral4":
        hf, query_scaling = _query_scaling(hf)
    base, scaling = mla_rope(hf)
    akw: dict[str, Any] = {
        "kv_lora_rank": hf.req("kv_lora_rank"), "q_lora_rank": hf.get("q_lora_rank", None),
        "qk_nope_head_dim": hf.req("qk_nope_head_dim"), "qk_rope_head_dim": hf.req("qk_rope_head_dim"),
        "v_head_dim": hf.req("v_head_dim"), "bias": hf.get("attention_bias", False, bool), "rope_base": base,
        "rope_interleave": model_type == "deepseek_v2" or hf.get("rope_interleave", True, bool), "norm_eps": 1e-6,
        "dropout": hf.get("attention_dropout", 0.0, float)}
    if scaling is not None:
        akw.update(rope_scaling=scaling, max_position_embeddings=parts.max_positions(hf))
    if query_scaling is not None:
        sizes = MLASizes(**{k: akw.pop(k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                      "v_head_dim", "q_lora_rank")})
        bias = akw.pop("bias")
        return functools.partial(position_scaled_attention, hf.req("hidden_size"), hf.req("num_attention_heads"),
                                 sizes, bias=bias, options=MLAOptions(**akw), scaling=query_scaling, **kw)
    return functools.partial(build_attention, "mla", hf.req("hidden_size"), hf.req("num_attention_heads"), **akw,
                             **kw)


def _moe(hf: HFConfig, model_type: str, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of a mixture-of-experts layer (V3: :func:`~._moe.deepseek_moe`; V2: :class:`SoftmaxGroupMoE`)."""
    C, F_ = hf.req("hidden_size"), hf.req("moe_intermediate_size")
    n_shared, bias = hf.get("n_shared_experts", 0) or 0, hf.get("mlp_bias", False, bool)
    shared = functools.partial(FeedForward, activation="swiglu", bias=bias, **kw)
    if model_type in SIGMOID:
        return functools.partial(deepseek_moe, hf, shared_expert=shared, keep_router_float32=True, **kw)
    groups, topk_groups = _groups(hf, model_type)
    v2 = model_type == "deepseek_v2"
    routing = SoftmaxRouting(hf.get("routed_scaling_factor", 1.0, float), groups, topk_groups,
                             "max" if v2 else "top2", not v2 and hf.get("norm_topk_prob", True, bool), v2)

    def make() -> nn.Module:
        moe = SoftmaxGroupMoE(C, F_, hf.req("n_routed_experts"), hf.req("num_experts_per_tok"), routing=routing,
                              shared_expert=shared(C, F_ * n_shared) if n_shared else None, **kw)
        return moe.keep_router_in_float32() if v2 else moe  # V2 keeps gate.weight float32, Mistral 4 not
    return make


def build_deepseek(hf: HFConfig, model_type: str, *, head_size: int | None = None, device: Any = None,
                   dtype: Any = None) -> DecoderLM:
    """The decoder of a ``DeepseekV3Config`` / ``DeepseekV2Config`` (``model_type``; random weights;
    see the module docstring)."""
    hf = canonical(hf, model_type)
    C, eps = hf.req("hidden_size"), hf.get("rms_norm_eps", 1e-6, float)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    attention, norm = _attention(hf, model_type, kw), parts.rms_norm(C, eps, **kw)
    dense = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"),
                            bias=hf.get("mlp_bias", False, bool), **kw)
    moe = _moe(hf, model_type, kw)
    blocks = [parts.block(C, attention, moe if sparse else dense, norm) for sparse in moe_layers(hf, model_type)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _put_moe(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """A mixture-of-experts layer: the router, its correction bias (V3), the stacked or per-expert
    experts, the shared experts (with ``mlp_bias``'s biases) when ``n_shared_experts > 0``."""
    put_moe(plan, ours, theirs, "stacked")
    if hf.raw("model_type") in SIGMOID:
        plan.put(f"{ours}score_bias", f"{theirs}gate.e_score_correction_bias")
    if hf.get("n_shared_experts", 0):
        parts.put_mlp(plan, f"{ours}shared_expert.", f"{theirs}shared_experts.", bias=hf.get("mlp_bias", False, bool))


def _put_gated_attention(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """MiniCPM5-MoE's attention: ``q_gate_proj`` (saved folders: ``q_proj``) rows ``[q_h; gate_h]``
    per head (``D`` each) -> the
    query rows of ``qkv_proj`` (with ``k_proj``, ``v_proj``) and the element-wise output gate."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    D = hf.get("head_dim", C // H)
    fused = "q_gate_proj" if plan.src.has(f"{theirs}q_gate_proj.weight") else "q_proj"  # saved folders: q_proj
    qg, k, v = (plan.src.take(f"{theirs}{n}.weight") for n in (fused, "k_proj", "v_proj"))
    if qg is not None and k is not None and v is not None:
        q, gate = (t.reshape(H * D, -1) for t in qg.reshape(H, 2 * D, -1).split(D, dim=1))
        where = f"{plan.src.prefix}{theirs}{fused}.weight"
        plan.put_tensor(f"{ours}.qkv_proj.weight", torch.cat([q, k, v]), f"{where} (query rows) + k_proj + v_proj")
        plan.put_tensor(f"{ours}.frontier.gate_proj.weight", gate, f"{where} (gate rows)")
    plan.put(f"{ours}.out_proj.weight", f"{theirs}o_proj.weight")


def _convert(model_type: str, hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; MTP layers dropped)."""
    hf = canonical(HFConfig({**hf.data, "model_type": model_type}, hf.source, hf.arch), model_type)
    prefix = parts.head_size_of(hf, sd)[0]
    sd = {k: v for k, v in sd.items() if not extra_layer(k, prefix, hf.req("num_hidden_layers"))}
    build = functools.partial(build_deepseek, model_type=model_type)
    model, plan, head_size = parts.start(hf, sd, build, device=device, dtype=dtype)
    for i, sparse in enumerate(moe_layers(hf, model_type)):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if model_type == "minicpm5_moe":
            _put_gated_attention(plan, f"{o}attn", f"{h}self_attn.", hf)
        else:
            put_mla(plan, f"{o}attn.", f"{h}self_attn.", hf)
        if sparse:
            _put_moe(plan, f"{o}ffn.", f"{h}mlp.", hf)
        else:
            parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.", bias=hf.get("mlp_bias", False, bool))
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    unused = [] if hf.get("n_shared_experts", 0) else [r"(model\.)?layers\.\d+\.mlp\.shared_experts\..*"]
    return parts.finish(plan, model, head_size, ignore=unused)


def convert_deepseek_v3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """A ``DeepseekV3ForCausalLM`` / ``DeepseekV3Model`` (see the module docstring)."""
    return _convert("deepseek_v3", hf, sd, device=device, dtype=dtype)


def convert_deepseek_v2(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """A ``DeepseekV2ForCausalLM`` / ``DeepseekV2Model`` (see the module docstring)."""
    return _convert("deepseek_v2", hf, sd, device=device, dtype=dtype)


def convert_mistral4(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """A ``Mistral4ForCausalLM`` / ``Mistral4Model`` (see the module docstring)."""
    return _convert("mistral4", hf, sd, device=device, dtype=dtype)


def convert_minicpm5_moe(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """A ``MiniCPM5MoeForCausalLM`` / ``MiniCPM5MoeModel`` (see the module docstring)."""
    return _convert("minicpm5_moe", hf, sd, device=device, dtype=dtype)


def convert_glm4_moe_lite(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """A ``Glm4MoeLiteForCausalLM`` / ``Glm4MoeLiteModel`` (see the module docstring)."""
    return _convert("glm4_moe_lite", hf, sd, device=device, dtype=dtype)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "deepseek_v3": parts.Dispatch("DeepSeek-V3", convert_deepseek_v3, ("DeepseekV3ForCausalLM", "DeepseekV3Model")),
    "deepseek_v2": parts.Dispatch("DeepSeek-V2", convert_deepseek_v2, ("DeepseekV2ForCausalLM", "DeepseekV2Model")),
    "glm4_moe_lite": parts.Dispatch("GLM-4-MoE-Lite", convert_glm4_moe_lite,
                                    ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteModel")),
    "mistral4": parts.Dispatch("Mistral-4", convert_mistral4, ("Mistral4ForCausalLM", "Mistral4Model")),
    "minicpm5_moe": parts.Dispatch("MiniCPM5-MoE", convert_minicpm5_moe, ("MiniCPM5MoeForCausalLM", "MiniCPM5MoeModel")),
}
