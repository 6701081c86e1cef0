"""Beam (transformers ``model_type="beam"``: ``BeamForCausalLM``, ``BeamModel``) and Ergo (``"ergo"``:
``ErgoForCausalLM``, ``ErgoModel``) -> :class:`~attnzoo.DecoderLM`: two 2026 decoders of one lineage
(DeepSeek-V3's MoE on OLMo-3-style sliding / NoPE-full layers with four norms a layer and a residual
that mixes instead of adding).

What transformers computes (``models/beam/modeling_beam.py``, ``models/ergo/modeling_ergo.py`` of
transformers 5.25; the line numbers are those files'), each reproduced here:

Both:

* Layer kinds (``layer_types``): ``sliding_attention`` layers see ``sliding_window`` keys (the query's
  own included: ``window = sliding_window - 1``), ``full_attention`` layers every key. RoPE per kind
  from ``rope_parameters[kind]`` (a dict keyed by kind); a kind whose entry is ``None`` runs without
  positions (NoPE; by default the full layers). Per-head q/k RMSNorms over ``head_dim`` (``rms_norm_eps``)
  before RoPE. GQA with ``num_key_value_heads``.
* Four RMSNorms a layer (``input_layernorm``, ``post_attention_layernorm`` on the attention's output,
  ``pre_feedforward_layernorm``, ``post_feedforward_layernorm`` on the feed-forward's output), the weight
  applied in float32 before the cast (:func:`~attnzoo.models.families._common.float32_scale_norms`), and
  a residual that mixes the normed output ``y`` with the stream ``x`` instead of adding them
  (:class:`MixedResidualBlock`).
* ``mlp_layer_types``: ``dense`` / ``sparse`` per layer.

Beam (``BeamConfig``: by default every sixth layer and the last full, three dense layers first):

* Attention (l. 199-279): q/k/v/o biases by ``attention_bias``; an element-wise output gate with one
  bias per head, ``out * sigmoid(gate_proj(x) + gate_bias[h])`` before ``o_proj`` (:class:`HeadBiasedGate`);
  on a NoPE layer the queries (after the q-norm) are multiplied by the scalable-softmax factor
  ``(1 + (p + 1) / 2048) ** 0.1`` of their position ``p`` in float32 (l. 253, 491-493;
  :class:`LengthScaledAttention`).
* Residual (l. 387-446): sub-layer ``j`` (attention ``2 (i + 1)``, MLP ``2 (i + 1) + 1`` of layer ``i``)
  adds ``y / sqrt(j) + x * sqrt((j - 1) / j)`` (:class:`DepthScaledResidual`).
* Feed-forward: a gated MLP (``hidden_act``) on ``dense`` layers; on ``sparse`` layers DeepSeek-V3's MoE
  without shared experts (:func:`~attnzoo.models.families._moe.deepseek_moe`: float32 sigmoid router,
  ``e_score_correction_bias`` picking among the ``topk_group`` best of ``n_group`` groups,
  ``norm_topk_prob`` (``+ 1e-20``), ``routed_scaling_factor``; l. 335-386; the router weight kept float32).
* Logits soft-capped by ``final_logit_softcapping`` (l. 634-638).

Ergo (``ErgoConfig``: by default every ``global_attention_every_n_layers``-th layer full, ``num_dense_blocks``
dense layers first):

* Attention (l. 196-272): one fused ``qkv_proj`` (rows ``[q; k; v]``, attnzoo's own layout), no
  biases, ``head_dim = hidden_size // num_attention_heads`` (a ``head_dim`` key is not read), RoPE on
  *adjacent* channel pairs (l. 121-126), the full layers' scores times ``global_attention_scale`` when
  set (q and k each times its square root, l. 206-210, 245-249: the score scale here).
* Residual (l. 429-440, :class:`ResidualGate`): ``sigmoid(w) y + sqrt(1 + sigmoid(w)) exp(-softplus(w) / 2) x``
  with a learned ``w [C]`` per sub-layer (float32).
* Feed-forward: ``dense`` layers an ungated ReLU² MLP of ``first_dense_intermediate_size``; ``sparse``
  layers ReLU² experts each followed by its own RMSNorm (``post_expert_norm [E, C]``, :class:`ExpertNormMoE`),
  routed by the top-k of ``sigmoid(logits) + e_score_correction_bias`` (no groups), the picked sigmoids
  renormalised (``+ 1e-20``) times ``moe_routed_scaling_factor``; plus a shared ReLU² expert followed by an
  RMSNorm (l. 275-420). ``hidden_act`` is not read. The LM head is never tied (no ``_tied_weights_keys``).
* Saved folders use the serving layout (``tok_embeddings``, ``attention.wqkv``, ``feed_forward.gate_kernel``
  transposed, ...; transformers' ``conversion_mapping`` for ``ergo``): both load.

Half precision (``from_hf(dtype=)``, later casts): the RMSNorms scale in float32 and round once, as
both families' norms; what transformers keeps float32 stays float32 (``_keep_in_fp32_modules_strict``):
Beam's router weight; Ergo's token embedding (:class:`Float32Embedding`), RMSNorms, residual gates,
router and expert norms, its residual stream running in float32 around sub-layers in the model's dtype
(:meth:`MixedResidualBlock.branch_dtype`) and read by the head in its own (:class:`CastLMHead`: logits
in the model's dtype, transformers' in float32); Ergo's q/k norms are not kept float32 here.

Positions: a NoPE layer's Beam factor reads absolute positions; attnzoo counts them from each row's
first real token, as transformers' ``generate`` does (its forward without ``position_ids`` counts a
left-padded row's pads too). Packed sequences run one at a time through Beam's NoPE layers.

A ``config.json`` that leaves keys out reads them as :data:`DEFAULTS` (the config classes' defaults,
``layer_types`` / ``mlp_layer_types`` / ``rope_parameters`` derived as they derive them).

Refused by name: ``rope_parameters`` not keyed by layer kind or without an entry for a kind in use,
a ``partial_rotary_factor``, ``layer_types`` / ``mlp_layer_types`` entries other than the two kinds,
``sliding_attention`` layers without a ``sliding_window``, Beam's expert activation other than SiLU
(its experts use ``hidden_act``) and expert groups that do not divide the experts into groups of
>= 2 holding ``num_experts_per_tok`` in the ``topk_group`` kept (``n_group``/``topk_group`` ``None``
included: transformers cannot run them), ``pretraining_tp != 1``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._devices import KeepsFloat32
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import deepseek_moe, put_moe
from attnzoo.models.families.deepseek import PostNormMoE
from attnzoo.models.families.kimi_linear import saved_names
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.parts import LMHead, head_for
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.moe import Experts, MixtureOfExperts, Routing
from attnzoo.nn.parts import AttentionParts, OutputGate, Scores, qk_rmsnorm
from attnzoo.nn.positional import resolve_positions

__all__ = ["DEFAULTS", "DISPATCH", "CastLMHead", "DepthScaledResidual", "ExpertNormMoE", "Float32Embedding",
           "HeadBiasedGate", "LengthScaledAttention", "MixedResidualBlock", "ResidualGate", "build_beam", "canonical",
           "convert_beam"]

KINDS = ("sliding_attention", "full_attention")

_BEAM: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 20480, "num_hidden_layers": 52,
    "num_attention_heads": 48, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "sliding_window": 512,
    "attention_dropout": 0.0, "moe_intermediate_size": 2560, "num_experts_per_tok": 8, "num_experts": 256,
    "norm_topk_prob": True, "head_dim": 128, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "final_logit_softcapping": 30.0}
_ERGO: dict[str, Any] = {
    "vocab_size": 262144, "hidden_size": 8192, "num_hidden_layers": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "first_dense_intermediate_size": 32768, "num_dense_blocks": 1,
    "moe_intermediate_size": 4096, "shared_intermediate_size": 8192, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_routed_scaling_factor": 8 ** 0.5, "max_position_embeddings": 524288, "rms_norm_eps": 1e-12,
    "sliding_window": 512, "global_attention_every_n_layers": 4, "global_attention_scale": None}
#: the config classes' defaults of the keys read here (``BeamConfig``, ``ErgoConfig``), by ``model_type``
DEFAULTS: dict[str, dict[str, Any]] = {"beam": _BEAM, "ergo": _ERGO}
#: the default rope theta of each family (``default_theta``)
_THETA = {"beam": 10000.0, "ergo": 1_000_000.0}

#: Ergo's serving names -> transformers' (its ``conversion_mapping``; the transposed ones in :func:`_ergo_names`)
_ERGO_SAVED = tuple((re.compile(p), r) for p, r in (
    (r"^tok_embeddings\.", "model.embed_tokens."), (r"^norm\.", "model.norm."), (r"^output\.", "lm_head."),
    (r"^layers\.", "model.layers."), (r"\.attention_norm\.", ".input_layernorm."),
    (r"\.post_attention_norm\.", ".post_attention_layernorm."), (r"\.ffn_norm\.", ".pre_feedforward_layernorm."),
    (r"\.post_ffn_norm\.", ".post_feedforward_layernorm."),
    (r"\.post_attention_residual\.scale", ".attention_residual_gate.weight"),
    (r"\.post_ffn_residual\.scale", ".feedforward_residual_gate.weight"), (r"\.attention\.wqkv\.", ".self_attn.qkv_proj."),
    (r"\.attention\.wo\.", ".self_attn.o_proj."), (r"\.attention\.q_norm\.", ".self_attn.q_norm."),
    (r"\.attention\.k_norm\.", ".self_attn.k_norm."), (r"\.feed_forward\.up\.", ".mlp.up_proj."),
    (r"\.feed_forward\.down\.", ".mlp.down_proj."), (r"\.feed_forward\.router_bias", ".mlp.gate.e_score_correction_bias"),
    (r"\.feed_forward\.up_proj", ".mlp.experts.up_proj"), (r"\.feed_forward\.down_proj", ".mlp.experts.down_proj"),
    (r"\.feed_forward\.expert_output_norm\.scale", ".mlp.experts.post_expert_norm.weight"),
    (r"\.feed_forward\.shared_expert_output_norm\.scale", ".mlp.shared_experts.norm.weight")))
_ERGO_TRANSPOSED = {"feed_forward.gate_kernel": "mlp.gate.linear.weight",
                    "feed_forward.shared_up_proj": "mlp.shared_experts.up_proj.weight",
                    "feed_forward.shared_down_proj": "mlp.shared_experts.down_proj.weight"}


# --------------------------------------------------------------------------- attention
class HeadBiasedGate(OutputGate):
    """Beam's output gate: ``out * sigmoid(gate_proj(x) + head_bias[h])``, one gate per channel with
    one bias per head (broadcast over ``head_dim``).

    Weights: ``weight [H D, C]`` (``gate_proj``), ``head_bias [H]`` (``gate_bias``).
    Shapes: ``out [B, H, N, D]``, ``x [B, N, C]`` -> ``[B, H, N, D]``."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__(dim, num_heads, head_dim, "element")
        self.head_bias = nn.Parameter(torch.zeros(num_heads))

    def gate(self, out: Tensor, x: Tensor) -> Tensor:
        B, H, N, D = out.shape
        if (self.num_heads, self.head_dim) != (H, D):
            raise ValueError(f"HeadBiasedGate: out must be [B, {self.num_heads}, N, {self.head_dim}], got "
                             f"{tuple(out.shape)}")
        g = self(x).view(B, N, H, D) + self.head_bias.to(x.dtype)[:, None]
        return out * torch.sigmoid(g).transpose(1, 2).to(out.dtype)


class LengthScaledAttention(MultiHeadAttention):
    """:class:`~attnzoo.MultiHeadAttention` whose queries (after the q-norm and RoPE) are multiplied by
    Beam's scalable-softmax factor ``(1 + (p + 1) / 2048) ** 0.1`` at their position ``p``, in float32
    (``exp(0.1 log1p((p + 1) / 2048))``, l. 491-493) when ``length_scaled`` is set (after building).
    Packed input then runs one sequence at a time (positions restart per sequence).

    Shapes: as :class:`~attnzoo.MultiHeadAttention`."""

    length_scaled: bool = False

    def _project_self(self, x: Tensor, positions: Tensor | None, start: int, *,
                      rotate: bool) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super()._project_self(x, positions, start, rotate=rotate)
        if not self.length_scaled:
            return q, k, v
        B, N, _ = x.shape
        pos = resolve_positions(positions, N, start, x.device, batch=B)  # [N] or [B, N]
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        scale = torch.exp(0.1 * torch.log1p((pos.to(wide) + 1) / 2048))
        return (q.to(wide) * scale.unsqueeze(-1).unsqueeze(-3)).to(q.dtype), k, v  # [.., 1, N, 1] over [B, H, N, D]

    def _packed(self, x: Tensor, cu_seqlens: object, context: object, mask: object, cache: object,
                positions: object, return_weights: bool) -> Tensor:
        if self.length_scaled:
            raise ValueError("LengthScaledAttention: packed input (cu_seqlens) runs one sequence at a time here "
                             "(the query factor needs each token's position)")
        return super()._packed(x, cu_seqlens, context, mask, cache, positions, return_weights)


# --------------------------------------------------------------------------- residual mixing
class DepthScaledResidual(nn.Module):
    """Beam's residual of sub-layer ``index`` ``j``: ``y / sqrt(j) + x sqrt((j - 1) / j)`` (l. 387-393).
    No weights. Shapes: ``y, x [..., C] -> [..., C]``."""

    def __init__(self, index: int) -> None:
        super().__init__()
        if isinstance(index, bool) or not isinstance(index, int) or index < 1:
            raise ValueError(f"DepthScaledResidual: index must be an int >= 1, got {index!r}")
        self.index = index

    def forward(self, y: Tensor, x: Tensor) -> Tensor:
        j = self.index
        return y * (1.0 / math.sqrt(j)) + x * math.sqrt((j - 1) / j)

    def extra_repr(self) -> str:
        return f"index={self.index}"


class ResidualGate(KeepsFloat32, nn.Module):
    """Ergo's learned residual mix (``ErgoResidualGate``, l. 429-440): with ``b = sigmoid(w)``,
    ``b y + sqrt(1 + b) exp(-softplus(w) / 2) x`` (``w = 0``: ``y / 2 + sqrt(3 / 4) x``), ``w`` float32
    and kept so through half casts.

    Weight: ``weight [C]``. Shapes: ``y, x [..., C] -> [..., C]``."""

    float32_params = ("weight",)

    def __init__(self, dim: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, device=device, dtype=torch.float32))


    def forward(self, y: Tensor, x: Tensor) -> Tensor:
        w = self.weight.to(torch.promote_types(y.dtype, torch.float32))
        branch = torch.sigmoid(w)
        keep = torch.sqrt(1.0 + branch) * torch.exp(-0.5 * F.softplus(w))
        return (branch * y + keep * x).to(x.dtype)


class Float32Embedding(KeepsFloat32, nn.Embedding):
    """Ergo's token embedding, float32 whatever the model's dtype and kept so through half casts
    (transformers builds it in float32 and keeps it, l. 551): the float32 residual stream's start.
    Weight: ``weight [V, C]``. Shapes: ``tokens [B, N] -> [B, N, C]``."""

    float32_params = ("weight",)

    def __init__(self, num_embeddings: int, embedding_dim: int, *, device: torch.device | str | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=torch.float32)



class CastLMHead(LMHead):
    """:class:`~attnzoo.models.parts.LMHead` reading the (float32) stream in its weight's dtype
    (Ergo's ``cast_input_to_weight_dtype``, l. 369-384). Shapes: ``[B, N, C] -> [B, N, V]``."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self.weight.dtype))


class MixedResidualBlock(TransformerBlock):
    """A pre- and post-normed layer (``sublayer_norm="both"``) whose residual connections are
    modules ``mix(y, x)`` of the sub-layer's normed output ``y`` and the stream ``x``::

        x = attn_residual(attn_out_norm(attn(attn_norm(x))), x)
        x = ffn_residual(ffn_out_norm(ffn(ffn_norm(x))), x)

    The sub-layers run in :meth:`branch_dtype` and the stream keeps its own (Ergo's float32 stream
    under a half-precision model; the same dtype otherwise).

    Args:
        dim: model width ``C``.
        layers: the :class:`~attnzoo.blocks.BlockLayers` (``sublayer_norm="both"``).
        attn_residual, ffn_residual: the two mixes (:class:`DepthScaledResidual`, :class:`ResidualGate`).

    Shapes: ``x [B, N, C] -> [B, N, C]``."""

    def __init__(self, dim: int, layers: BlockLayers, *, attn_residual: nn.Module, ffn_residual: nn.Module) -> None:
        super().__init__(dim, layers=layers)
        if self.ffn is None or layers.sublayer_norm != "both":
            raise ValueError("MixedResidualBlock: needs a feed-forward and sublayer_norm='both'")
        self.attn_residual, self.ffn_residual = attn_residual, ffn_residual

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Any = None,  # type: ignore[override]
                key_padding: Tensor | None = None, context_mask: Any = None, cache: Any = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The arguments of :meth:`TransformerBlock.forward` (no ``context``: no cross-attention)."""
        mask = self._self_only(x, context, context_mask, mask, key_padding)
        assert self.ffn is not None and self.ffn_norm is not None
        branch = self.branch_dtype(x)
        h = self._mix(self.attn_norm(x).to(branch), mask, cache, positions, cu_seqlens)
        x = self.attn_residual(self.attn_out_norm(h.to(x.dtype)), x)
        return self.ffn_residual(self.ffn_out_norm(self.ffn(self.ffn_norm(x).to(branch)).to(x.dtype)), x)

    def branch_dtype(self, x: Tensor) -> torch.dtype:
        """The sub-layers' dtype: the attention's output projection's (a half-precision model under a
        float32 residual stream, as Ergo's: l. 463-482), else ``x``'s."""
        weight = getattr(self.attn, "out_proj", None)
        return weight.weight.dtype if isinstance(weight, nn.Linear) else x.dtype


# --------------------------------------------------------------------------- feed-forward
class ExpertNormMoE(KeepsFloat32, MixtureOfExperts):
    """A :class:`~attnzoo.nn.moe.MixtureOfExperts` whose every expert's output is RMS-normalised with
    that expert's own weight (Ergo's ``post_expert_norm``, l. 316-366), in float32, before the routing
    weight: ``rmsnorm(expert_e(x)) * expert_norm[e]``. The other arguments as the base class's;
    ``eps``: the norm's epsilon.

    Weights: also ``expert_norm [E, C]`` (float32, kept so through half casts).
    Shapes: ``x [..., C] -> [..., C]``."""

    float32_params = ("expert_norm",)

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, eps: float, routing: Routing,
                 experts: Experts, shared_expert: nn.Module | None = None, keep_router_float32: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=routing, experts=experts, shared_expert=shared_expert,
                         keep_router_float32=keep_router_float32, device=device, dtype=dtype)
        self.eps = float(eps)
        self.expert_norm = nn.Parameter(torch.ones(num_experts, dim, device=device, dtype=torch.float32))


    def expert(self, e: int, x: Tensor) -> Tensor:
        y = super().expert(e, x)  # [T, C]
        wide = torch.promote_types(y.dtype, torch.float32)
        return (F.rms_norm(y.to(wide), (self.dim,), eps=self.eps) * self.expert_norm[e].to(wide)).to(y.dtype)


def _ergo_moe(hf: HFConfig, *, device: Any = None, dtype: Any = None) -> ExpertNormMoE:
    """An Ergo ``sparse`` layer: :class:`ExpertNormMoE` of ReLU² experts plus the normed shared expert."""
    C, eps, kw = hf.req("hidden_size"), hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    shared = PostNormMoE(FeedForward(C, hf.req("shared_intermediate_size"), "relu2", bias=False, **kw),
                         parts.rms_norm(C, eps, **kw)())
    routing = Routing("sigmoid_topk", norm_topk_prob=True, scaling=hf.req("moe_routed_scaling_factor", float))
    return ExpertNormMoE(C, hf.req("moe_intermediate_size"), hf.req("num_experts"), hf.req("num_experts_per_tok"),
                         eps=eps, routing=routing, experts=Experts("relu2"), shared_expert=shared,
                         keep_router_float32=True, **kw)


# --------------------------------------------------------------------------- config
def _kinds(hf: HFConfig, model_type: str, depth: int) -> list[str]:
    """``layer_types`` as the config classes derive them when absent."""
    if model_type == "beam":
        default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(depth)]
        default[-1] = "full_attention"
    else:
        every = hf.req("global_attention_every_n_layers")
        default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(depth)]
    return parts.layer_types(hf, depth, KINDS, default=default)


def _mlp_kinds(hf: HFConfig, model_type: str, depth: int) -> list[str]:
    dense = min(3, depth) if model_type == "beam" else min(hf.req("num_dense_blocks"), depth)
    default = ["dense"] * dense + ["sparse"] * (depth - dense)
    return parts.layer_types(hf, depth, ("dense", "sparse"), key="mlp_layer_types", default=default)


def _ropes(hf: HFConfig, model_type: str, kinds: list[str]) -> dict[str, dict[str, Any] | None]:
    """``rope_parameters`` keyed by layer kind (``None``: NoPE), as the config classes fill them
    (Ergo's flat dict: the sliding layers', the full ones NoPE)."""
    rp = hf.raw("rope_parameters")
    if rp is None:
        rp = {"sliding_attention": {"rope_type": "default", "rope_theta": _THETA[model_type]}, "full_attention": None}
    elif model_type == "ergo" and isinstance(rp, dict) and ("rope_type" in rp or "rope_theta" in rp):
        rp = {"sliding_attention": rp, "full_attention": None}
    if not isinstance(rp, dict) or any(k not in rp or (rp[k] is not None and not isinstance(rp[k], dict))
                                       for k in set(kinds)):
        raise hf.unsupported(f"rope_parameters={rp!r} (supported: a dict keyed by the layer kinds in use, each a "
                             f"rope dict or None)")
    for kind in set(kinds):
        factor = (rp[kind] or {}).get("partial_rotary_factor")
        if factor not in (None, 1, 1.0):
            raise hf.unsupported(f"partial_rotary_factor={factor!r} in rope_parameters[{kind!r}]")
    return {k: rp[k] for k in set(kinds)}


def canonical(hf: HFConfig, model_type: str) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS` for absent keys, not for ``None`` ones; the
    per-layer kinds and rope dicts filled in); refuses what has no equivalent (module docstring)."""
    data = {**DEFAULTS[model_type], **hf.data}
    hf = HFConfig(data, hf.source, hf.arch)
    if model_type == "ergo":
        if hf.has("local_attention_window") and not hf.has("sliding_window"):
            data["sliding_window"] = hf.raw("local_attention_window")
        data["tie_word_embeddings"] = False  # ErgoForCausalLM ties nothing
        data["head_dim"] = hf.req("hidden_size") // hf.req("num_attention_heads")
    depth = hf.req("num_hidden_layers")
    data["layer_types"] = _kinds(hf, model_type, depth)
    data["mlp_layer_types"] = _mlp_kinds(hf, model_type, depth)
    data["rope_parameters"] = _ropes(hf, model_type, data["layer_types"])
    hf = HFConfig(data, hf.source, hf.arch)
    parts.unsupported_keys(hf, {"pretraining_tp": lambda v: v in (None, 1)})
    parts.sliding_windows(hf, data["layer_types"])  # a sliding layer needs a window
    if model_type == "beam" and "sparse" in data["mlp_layer_types"]:
        _check_beam_routing(hf)
    return hf


def _check_beam_routing(hf: HFConfig) -> None:
    """Beam's experts: SiLU (they use ``hidden_act``), groups of >= 2 experts holding the top-k."""
    parts.unsupported_keys(hf, {"hidden_act": lambda v: v in ("silu", "swish")})
    E, k = hf.req("num_experts"), hf.req("num_experts_per_tok")
    G, g = hf.raw("n_group"), hf.raw("topk_group")
    ok = isinstance(G, int) and isinstance(g, int) and G >= 1 and 1 <= g <= G and E % G == 0 and (
        G == 1 or E // G >= 2) and k <= g * (E // G)
    if not ok:
        raise hf.unsupported(f"n_group={G} with topk_group={g} (groups of >= 2 of the num_experts={E} experts "
                             f"holding num_experts_per_tok={k})")


# --------------------------------------------------------------------------- build
def _attention(hf: HFConfig, model_type: str, kind: str, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of a layer's attention (module docstring)."""
    C, H, D = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("head_dim")
    Hkv, eps = hf.get("num_key_value_heads", H), hf.req("rms_norm_eps", float)
    params = hf.req("rope_parameters", dict)[kind]
    rope = None if params is None else parts.rotary(hf, params, D)
    if rope is not None and model_type == "ergo":
        rope.interleaved = True  # adjacent pairs: the rotation reads the flag (RotaryEmbedding.rotate)
    window = hf.req("sliding_window") - 1 if kind == "sliding_attention" else None
    scale = None
    if model_type == "ergo" and kind == "full_attention" and hf.has("global_attention_scale"):
        scale = D ** -0.5 * hf.req("global_attention_scale", float)

    def make() -> nn.Module:
        q_norm, k_norm = qk_rmsnorm("head", H, Hkv, D, eps)
        gate = HeadBiasedGate(C, H, D) if model_type == "beam" else None
        settings = AttentionParts(q_norm=q_norm, k_norm=k_norm, output_gate=gate, scores=Scores(scale=scale))
        module = build_softmax(LengthScaledAttention, C, H, num_kv_heads=Hkv, head_dim=D, causal=True, window=window,
                               rope=rope, bias=model_type == "beam" and hf.get("attention_bias", False, bool),
                               dropout=hf.get("attention_dropout", 0.0, float), parts=settings, **kw)
        module.length_scaled = model_type == "beam" and rope is None
        return module
    return make


def _feed_forward(hf: HFConfig, model_type: str, sparse: bool, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    C = hf.req("hidden_size")
    if model_type == "ergo":
        if sparse:
            return functools.partial(_ergo_moe, hf, **kw)
        return functools.partial(FeedForward, C, hf.req("first_dense_intermediate_size"), "relu2", bias=False, **kw)
    if sparse:
        return functools.partial(deepseek_moe, hf, keep_router_float32=True, **kw)
    return parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)


def _residuals(model_type: str, i: int, dim: int, device: Any) -> tuple[nn.Module, nn.Module]:
    if model_type == "beam":
        return DepthScaledResidual(2 * (i + 1)), DepthScaledResidual(2 * (i + 1) + 1)
    return ResidualGate(dim, device=device), ResidualGate(dim, device=device)


def build_beam(hf: HFConfig, model_type: str, *, head_size: int | None = None, device: Any = None,
               dtype: Any = None) -> DecoderLM:
    """The decoder of a ``BeamConfig`` / ``ErgoConfig`` (``model_type``; random weights; see the module docstring)."""
    hf = canonical(hf, model_type)
    C, eps, kw = hf.req("hidden_size"), hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    norm = parts.rms_norm(C, eps, **kw)
    blocks = []
    for i, (kind, mlp) in enumerate(zip(hf.req("layer_types", list), hf.req("mlp_layer_types", list), strict=True)):
        layers = BlockLayers(attention=_attention(hf, model_type, kind, kw), norm=norm, sublayer_norm="both",
                             feed_forward=_feed_forward(hf, model_type, mlp == "sparse", kw))
        mix_attn, mix_ffn = _residuals(model_type, i, C, device)
        blocks.append(MixedResidualBlock(C, layers, attn_residual=mix_attn, ffn_residual=mix_ffn))
    if model_type == "beam":
        softcap = hf.get("final_logit_softcapping", None, float)
        model = parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, logit_softcap=softcap, **kw)
        return parts.float32_scale_norms(model)
    V = hf.req("vocab_size")  # Ergo: the embedding, the norms and the residual stream in float32
    model = parts.decoder(hf, blocks, head_size=0, norm_eps=eps, embedding=Float32Embedding(V, C, device=device), **kw)
    model.lm_head = CastLMHead(C, V, **kw) if head_size is None else head_for(C, V, head_size, **kw)
    return parts.float32_scale_norms(model, keep_float32=True)


# --------------------------------------------------------------------------- convert
def _ergo_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """A saved Ergo folder's serving names -> transformers' (the router and shared expert transposed)."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        for saved, name in _ERGO_TRANSPOSED.items():
            if key.endswith(saved):
                key, t = "model." + key[: -len(saved)] + name, t.t().contiguous()
                break
        out[key] = t
    return saved_names(out, _ERGO_SAVED)


def _put_beam_layer(plan: Plan, o: str, h: str, hf: HFConfig, sparse: bool) -> None:
    parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.get("attention_bias", False, bool), qk_norm=True)
    plan.put(f"{o}attn.frontier.gate_proj.weight", f"{h}self_attn.gate_proj.weight")
    plan.put(f"{o}attn.frontier.gate_proj.head_bias", f"{h}self_attn.gate_bias")
    if sparse:
        put_moe(plan, f"{o}ffn.", f"{h}mlp.", "stacked")
        plan.put(f"{o}ffn.score_bias", f"{h}mlp.gate.e_score_correction_bias")
    else:
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")


def _put_ergo_layer(plan: Plan, o: str, h: str, sparse: bool) -> None:
    a = f"{h}self_attn."
    plan.put_pairs(f"{o}attn.", a, [("qkv_proj", "qkv_proj"), ("out_proj", "o_proj")], bias=False)
    for n in ("q_norm", "k_norm"):
        plan.put(f"{o}attn.frontier.{n}_weight", f"{a}{n}.weight")
    plan.put(f"{o}attn_residual.weight", f"{h}attention_residual_gate.weight")
    plan.put(f"{o}ffn_residual.weight", f"{h}feedforward_residual_gate.weight")
    m, t = f"{o}ffn.", lambda w: w.transpose(-1, -2).contiguous()
    if not sparse:
        plan.put_pairs(m, f"{h}mlp.", [("up_proj", "up_proj"), ("down_proj", "down_proj")], bias=False)
        return
    plan.put(f"{m}router.weight", f"{h}mlp.gate.linear.weight")
    plan.put(f"{m}score_bias", f"{h}mlp.gate.e_score_correction_bias")
    plan.put(f"{m}up_proj", f"{h}mlp.experts.up_proj", t)
    plan.put(f"{m}down_proj", f"{h}mlp.experts.down_proj", t)
    plan.put(f"{m}expert_norm", f"{h}mlp.experts.post_expert_norm.weight")
    plan.put_pairs(f"{m}shared_expert.moe.", f"{h}mlp.shared_experts.", [(n, n) for n in ("up_proj", "down_proj")],
                   bias=False)
    plan.put(f"{m}shared_expert.post_mlp_layernorm.weight", f"{h}mlp.shared_experts.norm.weight")


def convert_beam(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a Beam / Ergo decoder (by ``model_type``) and copy the weights (the head follows them;
    Ergo's saved names too)."""
    model_type = str(hf.raw("model_type"))
    if model_type not in DEFAULTS:
        raise ValueError(f"convert_beam: model_type must be one of {list(DEFAULTS)}, got {model_type!r}")
    if model_type == "ergo" and any(k == "tok_embeddings.weight" or ".attention.wqkv." in k for k in sd):
        sd = _ergo_names(sd)
    hf = canonical(hf, model_type)
    build = functools.partial(build_beam, model_type=model_type)
    model, plan, head_size = parts.start(hf, sd, build, device=device, dtype=dtype)
    norms = parts.GEMMA_NORMS
    for i, mlp in enumerate(hf.req("mlp_layer_types", list)):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if model_type == "beam":
            _put_beam_layer(plan, o, h, hf, mlp == "sparse")
        else:
            _put_ergo_layer(plan, o, h, mlp == "sparse")
        plan.put_pairs(o, h, norms, bias=False)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "beam": parts.Dispatch("Beam", convert_beam, ("BeamForCausalLM", "BeamModel")),
    "ergo": parts.Dispatch("Ergo", convert_beam, ("ErgoForCausalLM", "ErgoModel")),
}
