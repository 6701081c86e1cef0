"""HY-V4 (Tencent Hy4; transformers ``model_type="hy_v4"``: ``HYV4ForCausalLM``, ``HYV4Model``) ->
:class:`HYV4LM`, a :class:`~attnzoo.DecoderLM` whose layers run on ``hc_mult`` residual streams.

What transformers computes (``models/hy_v4/modeling_hy_v4.py`` of transformers 5.25; the line numbers
are that file's; the defaults from ``configuration_hy_v4.py``), each reproduced here:

* Streams (``HYV4Model.forward``, l. 805-845): the token embedding copied onto ``hc_mult`` streams
  ``[B, N, S, C]``; after the last layer DeepSeek-V4's hyper-head collapses them
  (``HYV4HyperHead``, l. 637-656; :class:`~attnzoo.models.families.deepseek_v4.HyperHead`, reused), then
  the final RMSNorm and the head.
* Hyper-connections (``HYV4HyperConnection``, l. 599-634), one before the attention and one before
  the feed-forward, DeepSeek-V4's without the stream-mixing ``comb`` (:class:`IndependentHyperConnection`)::

      a    = (flat(x) @ fn^T) / rms(flat(x))                     # float32, eps rms_norm_eps; [B, N, 2 S]
      pre  = sigmoid(a_pre * scale[0] + base_pre) + hc_eps
      post = hc_magnitude * sigmoid(a_post * scale[1] + base_post) + hc_eps
      h    = sum_s pre_s x_s  ->  norm  ->  attention (or feed-forward)
      x'_t = post_t * h + x_t

* Attention (``HYV4Attention``, l. 319-482): DeepSeek-V3.2's sparse attention (deepseek's
  :class:`~attnzoo.models.families.deepseek.IndexedLatentAttention`: latent attention with interleaved
  RoPE on ``qk_rope_head_dim`` channels, YaRN's ``mscale_all_dim`` in the softmax scale, each query
  attending only the ``index_topk`` keys a Lightning indexer selects) plus one learnable sink logit per
  head (l. 290-316) and an element-wise output gate ``out * sigmoid(gate_proj(x))`` before ``o_proj``
  (l. 478); :class:`HYV4IndexedAttention`. The indexer (``HYV4Indexer``, l. 166-285; deepseek's
  :class:`~attnzoo.models.families.deepseek.LightningTopK`) rotates the *last* ``qk_rope_head_dim``
  channels of its queries and keys (adjacent pairs); attnzoo's rotates the first, so the rows of
  ``wq_b`` (per head), ``wk`` and ``k_norm`` are permuted at load to put those channels first (the
  scores are the same); its key LayerNorm's epsilon is ``rms_norm_eps``. ``indexer_types``: a
  ``shared`` layer has no indexer and attends the keys the last ``full`` layer selected
  (l. 432-443; :class:`HYV4SharedAttention`); by default layer 0 and every ``i`` with
  ``(i - 1) % 4 == 0`` are ``full``.
* Feed-forward (``mlp_layer_types``; by default the first layer ``dense``): a gated MLP of
  ``hidden_act``, or DeepSeek-V3's MoE (sigmoid router in float32, ``e_score_correction_bias`` picking
  among the ``topk_group`` best of ``n_group`` groups, ``norm_topk_prob``, ``routed_scaling_factor``;
  l. 500-528) whose routed experts are SiLU-gated and clamped, ``silu(min(gate, swiglu_limit)) *
  clamp(up, -swiglu_limit, swiglu_limit)`` (l. 558-563; glm5_next's
  :class:`~attnzoo.models.families.glm5_next.ClampedMoE`), plus ``n_shared_experts`` unclamped shared
  experts (a gated MLP of ``hidden_act``).
* ``num_key_value_heads`` and ``head_dim`` are overwritten by the config (``HYV4Config.__post_init__``):
  not read.

Cached decode keeps the latents, the full layers' index keys; at exact ties of the indexer's scores
(keys scoring 0 for every head) transformers' cached decode and its full forward differ (``torch.topk``
over a decode step's row breaks them otherwise than over the full forward's rows); attnzoo follows
transformers in each. Packed sequences run one at a time. Saved folders use the checkpoint's names
(``hc_pre.hc_attn_layer.hc_fn``, ``learnable_sink_param``, ``linear_gate``, ...; transformers'
``conversion_mapping``): both load; multi-token-prediction layers (``mtp_layers``) are dropped.

HY-V4-VL's text model (``hy_v4_vl_text``: ``HYV4VLTextModel`` inside ``HYV4VLForConditionalGeneration``,
``models/hy_v4_vl/modeling_hy_v4_vl.py``) is this decoder with two differences: its query / key-value
latent RMSNorms take ``rms_norm_eps`` (l. 282-291; HY-V4's the norm's default 1e-6, :func:`_latent_eps`),
and its RoPE is Qwen3-VL's interleaved multimodal one over three position streams (l. 1060-1110), which
are equal on text: the 1-D RoPE. Its config's defaults are larger (:data:`VL_DEFAULTS`); its
``mrope_section`` is not read (text only).

Refused by name: ``q_lora_rank=None`` (transformers' attention always has the query latent),
``index_head_dim < qk_rope_head_dim``, ``swiglu_limit`` ``None`` or ``<= 0`` (the config's docstring
says such values disable the clamp, its experts clamp at them anyway), ``layer_types`` entries other than
``indexed_attention``, ``indexer_types`` / ``mlp_layer_types`` entries other than their two kinds, a
first layer whose indexer is ``shared`` (transformers fails at run time), expert groups that do not
divide the experts into groups of >= 2 holding ``num_experts_per_tok``, the ``dynamic`` /
``longrope`` rope types and a ``partial_rotary_factor`` (:func:`~attnzoo.models.hf.deepseek.mla_rope`),
``pretraining_tp != 1``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._devices import KeepsFloat32
from attnzoo.blocks import FeedForward
from attnzoo.masks import Mask
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.families._moe import put_moe
from attnzoo.models.families.deepseek import IndexedLatentAttention, LightningTopK
from attnzoo.models.families.deepseek_v4 import DeepseekV4LM, HyperHead
from attnzoo.models.families.glm5_next import ClampedMoE, HyperBlock, put_hyper_connections
from attnzoo.models.families.kimi_linear import put_mla, saved_names
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.deepseek import extra_layer, mla_rope
from attnzoo.models.parts import DecoderParts, head_for
from attnzoo.nn.mla import LatentCache, MLAOptions, MLASizes, MultiHeadLatentAttention
from attnzoo.nn.moe import Routing
from attnzoo.nn.parts import placed

__all__ = ["DEFAULTS", "DISPATCH", "HYV4LM", "VL_DEFAULTS", "HYV4Block", "HYV4IndexedAttention", "HYV4SharedAttention",
           "IndependentHyperConnection", "SinkGatedLatent", "build_hy_v4", "canonical", "convert_hy_v4"]

#: ``HYV4Config``'s defaults of the keys read here, for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 120832, "hidden_size": 2816, "intermediate_size": 6912, "moe_intermediate_size": 768,
    "num_hidden_layers": 34, "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "routed_scaling_factor": 2.827,
    "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128,
    "index_n_heads": 16, "hc_mult": 4, "hc_magnitude": 2.0, "hc_eps": 1e-6, "swiglu_limit": 10.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

#: ``HYV4VLTextConfig``'s defaults (``configuration_hy_v4_vl.py``): HY-V4's with a larger model
VL_DEFAULTS: dict[str, Any] = {**DEFAULTS, "hidden_size": 6144, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                               "num_hidden_layers": 78, "num_attention_heads": 64, "q_lora_rank": 2048,
                               "index_n_heads": 32}

#: the checkpoint's names -> transformers' module names (its ``conversion_mapping`` for ``hy_v4``, in order)
_SAVED = tuple((re.compile(p), r) for p, r in (
    (r"\.hc_pre\.hc_", ".hc_"), (r"\.learnable_sink_param", ".sinks"), (r"\.linear_gate", ".gate_proj"),
    (r"\.hc_attn_layer\.hc_(fn|base|scale)", r".attn_hc.\1"), (r"\.hc_mlp_layer\.hc_(fn|base|scale)", r".ffn_hc.\1"),
    (r"\.hc_head_(fn|base|scale)", r".hc_\1")))


# --------------------------------------------------------------------------- hyper-connections
class IndependentHyperConnection(KeepsFloat32, nn.Module):
    """HY-V4's hyper-connection of ``streams`` residual streams (see the module docstring): DeepSeek-V4's
    ``pre`` / ``post`` weights without ``comb`` (each stream keeps itself), ``post`` scaled by
    ``magnitude``, all in float32.

    Args:
        dim: model width ``C``. streams: ``S`` (``hc_mult``). eps: ``hc_eps``. magnitude: ``hc_magnitude``.
        norm_eps: epsilon of the unweighted RMSNorm of the flattened streams (``rms_norm_eps``).

    Weights (float32, kept so through half casts): ``fn [2 S, S C]``, ``base [2 S]``, ``scale [2]``.
    Shapes: :meth:`forward` ``x [B, N, S, C] -> (post [B, N, S], h [B, N, C])``.
    """

    float32_params = ("fn", "base", "scale")

    def __init__(self, dim: int, streams: int, *, eps: float, magnitude: float, norm_eps: float,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"IndependentHyperConnection: streams must be an int >= 1, got {streams!r}")
        self.streams, self.eps, self.magnitude, self.norm_eps = streams, float(eps), float(magnitude), float(norm_eps)
        kw: dict[str, Any] = {"device": device, "dtype": torch.float32}
        self.fn = nn.Parameter(torch.randn(2 * streams, streams * dim, **kw) * 0.02)
        self.base = nn.Parameter(torch.zeros(2 * streams, **kw))
        self.scale = nn.Parameter(torch.ones(2, **kw))


    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        S = self.streams
        flat = x.flatten(2).float()  # [B, N, S C]
        a = F.linear(flat, self.fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        (pre_a, post_a), (pre_b, post_b) = a.split(S, dim=-1), self.base.float().split(S)
        pre = torch.sigmoid(pre_a * self.scale[0] + pre_b) + self.eps  # [B, N, S]
        post = self.magnitude * torch.sigmoid(post_a * self.scale[1] + post_b) + self.eps
        return post, (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)

    @staticmethod
    def merge(x: Tensor, out: Tensor, post: Tensor) -> Tensor:
        """The new streams ``post_t * out + x_t`` (``[B, N, S, C]``; float32, cast back to ``x``'s dtype)."""
        return (post.float().unsqueeze(-1) * out.float().unsqueeze(-2) + x.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"streams={self.streams}, magnitude={self.magnitude}, eps={self.eps}"


# --------------------------------------------------------------------------- attention
class SinkGatedLatent(KeepsFloat32):
    """What HY-V4 adds to a :class:`~attnzoo.nn.mla.MultiHeadLatentAttention` (mixed in before it):
    one learnable sink logit per head (``sinks [H]``, float32) in the softmax and an element-wise
    output gate ``out * sigmoid(gate_proj(x))`` (``gate_proj [H dv, C]``) before ``out_proj``; the
    materialised form always (the sinks are per head). :meth:`_sink_gate` adds them after the base
    constructor."""

    float32_params = ("sinks",)
    sinks: nn.Parameter
    gate_proj: nn.Linear
    _selection: Tensor | None = None

    def _sink_gate(self, dim: int) -> None:
        mla: Any = self
        p = mla.kv_b_proj.weight
        H, dv = mla.num_heads, mla.sizes.v_head_dim
        mla.sinks = nn.Parameter(torch.zeros(H, device=p.device, dtype=torch.float32))
        mla.gate_proj = nn.Linear(dim, H * dv, bias=False, device=p.device, dtype=p.dtype)
        mla.form = "materialised"

    def _core(self, q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor | None]:
        mla: Any = self
        res = mla.attend(q, k, v, scale=mla.softmax_scale, backend=mla.backend, sinks=self.sinks,
                         dropout_p=mla.options.dropout if mla.training else 0.0, **kw)
        return (res[0], res[1]) if kw["return_weights"] else (res, None)

    def _attention(self, x: Tensor, mask: Tensor | Mask | None, cache: LatentCache | None, positions: Tensor | None,
                   return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """The gated heads ``[B, H, N, dv]``; the mask used (the key selection) kept for :meth:`selection`."""
        self._selection = mask if isinstance(mask, Tensor) else None
        out, weights = super()._attention(x, mask, cache, positions, return_weights)  # type: ignore[misc]
        B, H, N, dv = out.shape
        gate = torch.sigmoid(self.gate_proj(x).view(B, N, H, dv).transpose(1, 2))
        return out * gate.to(out.dtype), weights


class HYV4IndexedAttention(SinkGatedLatent, IndexedLatentAttention):
    """A ``full`` layer's attention: deepseek's :class:`~attnzoo.models.families.deepseek.IndexedLatentAttention`
    (its own :class:`~attnzoo.models.families.deepseek.LightningTopK`) with :class:`SinkGatedLatent`'s
    sinks and output gate. Build under ``with torch.device(...)`` (or through :func:`_attention`).

    Shapes: ``forward(x [B, N, C], *, mask, cache, positions) -> (out [B, N, C], selection [B, 1, N, M])``
    (``mask`` a ``[B, 1, 1, M]`` key padding, ``M`` the keys cached and new; ``selection`` the keys each
    query attends, for the ``shared`` layers after it)."""

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                 indexer: LightningTopK) -> None:
        super().__init__(dim, num_heads, sizes, bias=bias, options=options, indexer=indexer)
        self._sink_gate(dim)

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,  # type: ignore[override]
                cache: Any = None, positions: Tensor | None = None, selected: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        out = super().forward(x, context, mask=mask, cache=cache, positions=positions)
        selection, self._selection = self._selection, None
        assert selection is not None
        return out, selection


class HYV4SharedAttention(SinkGatedLatent, MultiHeadLatentAttention):
    """A ``shared`` layer's attention: latent attention with :class:`SinkGatedLatent`'s sinks and
    output gate over the keys the last ``full`` layer selected (``selected``), no indexer of its own.
    Arguments as :class:`~attnzoo.nn.mla.MultiHeadLatentAttention` (``rope=True``).

    Shapes: ``forward(x [B, N, C], *, selected [B, 1, N, M], cache, positions) -> (out [B, N, C], selected)``."""

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions) -> None:
        super().__init__(dim, num_heads, kv_lora_rank=sizes.kv_lora_rank, qk_nope_head_dim=sizes.qk_nope_head_dim,
                         qk_rope_head_dim=sizes.qk_rope_head_dim, v_head_dim=sizes.v_head_dim,
                         q_lora_rank=sizes.q_lora_rank, bias=bias, rope=True, options=options)
        self._sink_gate(dim)

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,  # type: ignore[override]
                cache: Any = None, positions: Tensor | None = None, selected: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        if selected is None:
            raise ValueError("HYV4SharedAttention: a shared layer needs the selection of a full layer before it")
        out = super().forward(x, context, mask=selected, cache=cache, positions=positions)
        self._selection = None
        return out, selected  # type: ignore[return-value]


# --------------------------------------------------------------------------- layers and model
class HYV4Block(HyperBlock):
    """One HY-V4 layer on the residual streams (GLM-5-Next's :class:`~attnzoo.models.families.glm5_next.HyperBlock`
    parts, its own forward): ``attn_hc`` -> ``attn_norm`` -> ``attn`` (:class:`HYV4IndexedAttention` or
    :class:`HYV4SharedAttention`), then ``ffn_hc`` -> ``ffn_norm`` -> ``ffn``; each result merged into
    the streams by its :class:`IndependentHyperConnection`.

    Shapes: ``x [B, N, S, C] -> ([B, N, S, C], the key selection [B, 1, N, M])``.
    """

    def forward(self, x: Tensor, *, key_padding: Tensor | None, cache: Any = None,  # type: ignore[override]
                selected: Tensor | None = None, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``key_padding [B, past + N]`` (True = real; ``None``: all real)."""
        post, h = self.attn_hc(x)
        mask = None if key_padding is None else key_padding[:, None, None, :]
        h, selected = self.attn(self.attn_norm(h), mask=mask, cache=cache, positions=positions, selected=selected)
        x = self.attn_hc.merge(x, h, post)
        post, h = self.ffn_hc(x)
        return self.ffn_hc.merge(x, self.ffn(self.ffn_norm(h)), post), selected


class HYV4LM(DeepseekV4LM):
    """DeepSeek-V4's stream model (:class:`~attnzoo.models.families.deepseek_v4.DeepseekV4LM`: the
    embedding copied onto every stream, its ``HyperHead`` before the final norm) over :class:`HYV4Block`
    layers, each handing its key selection to the next. Rotary positions as :class:`~attnzoo.DecoderLM`'s
    (counted over real tokens with ``attention_mask``); ``cu_seqlens`` runs each packed sequence alone."""

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The streams ``[B, N, S, C]`` through the blocks, collapsed by the hyper-head: ``[B, N, C]``."""
        pos = self.rotary_positions(positions, key_padding, past, x.shape[1], x.device)
        h = x.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()  # [B, N, S, C]
        selected = None
        for i, block in enumerate(self.blocks):
            h, selected = block(h, key_padding=key_padding, cache=None if cache is None else cache[i],
                                selected=selected, positions=pos)
        return self.hc_head(h)


# --------------------------------------------------------------------------- config
def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as ``HYV4Config`` reads it (:data:`DEFAULTS` for absent keys, not for ``None`` ones; the
    per-layer kinds filled in); refuses what has no equivalent (module docstring)."""
    data = {**(VL_DEFAULTS if hf.data.get("model_type") == "hy_v4_vl_text" else DEFAULTS), **hf.data}
    hf = HFConfig(data, hf.source, hf.arch)
    depth = hf.req("num_hidden_layers")
    parts.layer_types(hf, depth, ("indexed_attention",))
    data["mlp_layer_types"] = parts.layer_types(hf, depth, ("dense", "sparse"), key="mlp_layer_types",
                                                default=["dense"] * min(1, depth) + ["sparse"] * max(depth - 1, 0))
    data["indexer_types"] = parts.layer_types(
        hf, depth, ("full", "shared"), key="indexer_types",
        default=["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(depth)])
    hf = HFConfig(data, hf.source, hf.arch)
    parts.unsupported_keys(hf, {
        "pretraining_tp": lambda v: v in (None, 1), "q_lora_rank": lambda v: v is not None,
        "swiglu_limit": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
        "index_head_dim": lambda v: v >= hf.req("qk_rope_head_dim"),
        "indexer_types": lambda v: v[0] == "full"})
    mla_rope(hf)
    if "sparse" in data["mlp_layer_types"]:
        E, k = hf.req("n_routed_experts"), hf.req("num_experts_per_tok")
        G, g = hf.get("n_group", 1), hf.get("topk_group", 1)
        if not (1 <= g <= G and E % G == 0 and (G == 1 or E // G >= 2) and k <= g * (E // G)):
            raise hf.unsupported(f"n_group={G} with topk_group={g} (groups of >= 2 of the n_routed_experts={E} "
                                 f"experts holding num_experts_per_tok={k})")
    return hf


# --------------------------------------------------------------------------- build
def _latent_eps(hf: HFConfig) -> float:
    """The epsilon of the query / key-value latent RMSNorms: ``rms_norm_eps`` in HY-V4-VL's text model,
    the norm's default 1e-6 in HY-V4's (module docstring)."""
    return hf.req("rms_norm_eps", float) if hf.data.get("model_type") == "hy_v4_vl_text" else 1e-6


def _attention(hf: HFConfig, i: int, kw: dict[str, Any]) -> nn.Module:
    """Layer ``i``'s attention (:class:`HYV4IndexedAttention` or :class:`HYV4SharedAttention`)."""
    C, H, eps = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("rms_norm_eps", float)
    sizes = MLASizes(kv_lora_rank=hf.req("kv_lora_rank"), qk_nope_head_dim=hf.req("qk_nope_head_dim"),
                     qk_rope_head_dim=hf.req("qk_rope_head_dim"), v_head_dim=hf.req("v_head_dim"),
                     q_lora_rank=hf.req("q_lora_rank"))
    base, scaling = mla_rope(hf)
    options = MLAOptions(rope_base=base, rope_interleave=True, rope_scaling=scaling, norm_eps=_latent_eps(hf),
                         max_position_embeddings=parts.max_positions(hf), form="materialised",
                         dropout=hf.get("attention_dropout", 0.0, float))
    bias = hf.get("attention_bias", False, bool)
    device, dtype = kw["device"], kw["dtype"]
    with contextlib.nullcontext() if device is None else torch.device(device):
        module: nn.Module
        if hf.req("indexer_types", list)[i] == "shared":
            module = HYV4SharedAttention(C, H, sizes, bias=bias, options=options)
        else:
            indexer = LightningTopK(C, hf.req("q_lora_rank"), heads=hf.req("index_n_heads"),
                                    head_dim=hf.req("index_head_dim"), topk=hf.req("index_topk"), interleaved=True)
            indexer.k_norm.eps = eps
            module = HYV4IndexedAttention(C, H, sizes, bias=bias, options=options, indexer=indexer)
    placed(module, dtype, keep=(module.rope,))
    module.sinks.data = module.sinks.data.float()  # float32 whatever dtype, as transformers keeps them
    return module


def _layer(hf: HFConfig, i: int, kw: dict[str, Any]) -> HYV4Block:
    C, eps = hf.req("hidden_size"), hf.req("rms_norm_eps", float)
    act = hf.activation("hidden_act", parts.GATED, "silu")
    if hf.req("mlp_layer_types", list)[i] == "sparse":
        F_, n_shared = hf.req("moe_intermediate_size"), hf.get("n_shared_experts", 0)
        routing = Routing("sigmoid_topk", norm_topk_prob=hf.get("norm_topk_prob", True, bool),
                          scaling=hf.get("routed_scaling_factor", 1.0, float), groups=hf.get("n_group", 1),
                          topk_groups=hf.get("topk_group", 1))
        shared = FeedForward(C, F_ * n_shared, act, bias=False, **kw) if n_shared else None
        ffn: nn.Module = ClampedMoE(C, F_, hf.req("n_routed_experts"), hf.req("num_experts_per_tok"), routing=routing,
                                    limit=hf.req("swiglu_limit", float), shared_expert=shared, keep_router_float32=True,
                                    **kw)
    else:
        ffn = FeedForward(C, hf.req("intermediate_size"), act, bias=False, **kw)
    hc = functools.partial(IndependentHyperConnection, C, hf.req("hc_mult"), eps=hf.req("hc_eps", float),
                           magnitude=hf.req("hc_magnitude", float), norm_eps=eps, device=kw["device"])
    return HYV4Block(_attention(hf, i, kw), ffn, parts.rms_norm(C, eps, **kw), hc)


def build_hy_v4(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> HYV4LM:
    """The decoder of an ``HYV4Config`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    V, C, depth, eps = (hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers"),
                        hf.req("rms_norm_eps", float))
    cfg = DecoderConfig(V, C, depth, hf.req("num_attention_heads"), pos="none", norm="rms", norm_eps=eps,
                        tie_embeddings=hf.get("tie_word_embeddings", False, bool), max_seq_len=parts.max_positions(hf))
    blocks = [_layer(hf, i, kw) for i in range(depth)]
    head = HyperHead(C, hf.req("hc_mult"), eps=hf.req("hc_eps", float), norm_eps=eps, device=device)
    return HYV4LM(head=head, config=cfg, parts=DecoderParts(blocks=blocks, norm=parts.rms_norm(C, eps, **kw)(),
                                                            head=head_for(C, V, head_size, **kw)), **kw)


# --------------------------------------------------------------------------- convert
def _rope_first(head_dim: int, rope_dim: int) -> Any:
    """Rows of each ``head_dim`` group reordered so that the last ``rope_dim`` come first (the
    indexer's rotated channels, where :class:`~attnzoo.models.families.deepseek.LightningTopK` rotates)."""
    order = torch.cat([torch.arange(head_dim - rope_dim, head_dim), torch.arange(head_dim - rope_dim)])

    def permute(w: Tensor) -> Tensor:
        return w.reshape(-1, head_dim, *w.shape[1:])[:, order].reshape(w.shape).contiguous()

    return permute


def _put_layer(plan: Plan, hf: HFConfig, i: int) -> None:
    o, h = f"blocks.{i}.", f"layers.{i}."
    a = f"{h}self_attn."
    put_mla(plan, f"{o}attn.", a, hf)
    plan.put(f"{o}attn.sinks", f"{a}sinks")
    plan.put(f"{o}attn.gate_proj.weight", f"{a}gate_proj.weight")
    if hf.req("indexer_types", list)[i] == "full":
        permute = _rope_first(hf.req("index_head_dim"), hf.req("qk_rope_head_dim"))
        for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias"):
            plan.put(f"{o}attn.indexer.{n}", f"{a}indexer.{n}", permute)
        plan.put(f"{o}attn.indexer.weights_proj.weight", f"{a}indexer.weights_proj.weight")
    shared = bool(hf.get("n_shared_experts", 0))
    if hf.req("mlp_layer_types", list)[i] != "sparse":
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
    elif shared:  # the stacked experts, the router with its correction bias, the shared experts
        put_moe(plan, f"{o}ffn.", f"{h}mlp.", "deepseek")
    else:
        put_moe(plan, f"{o}ffn.", f"{h}mlp.", "stacked")
        plan.put(f"{o}ffn.score_bias", f"{h}mlp.gate.e_score_correction_bias")
    plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    put_hyper_connections(plan, o, h)


def convert_hy_v4(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> HYV4LM:
    """Build an HY-V4 decoder and copy the weights (``HYV4Model``: no head; ``HYV4ForCausalLM``:
    ``lm_head``; saved-folder names too; multi-token-prediction layers dropped)."""
    hf = canonical(hf)
    sd = saved_names(sd, _SAVED)
    depth, prefix = hf.req("num_hidden_layers"), parts.head_size_of(hf, sd)[0]
    sd = {k: v for k, v in sd.items() if not extra_layer(k, prefix, depth) and not re.match(r"(model\.)?mtp_layers\.", k)}
    model, plan, head_size = parts.start(hf, sd, build_hy_v4, device=device, dtype=dtype)
    for i in range(depth):
        _put_layer(plan, hf, i)
    for n in ("hc_fn", "hc_base", "hc_scale"):
        plan.put(f"hc_head.{n}", f"hc_head.{n}")
    unused = [] if hf.get("n_shared_experts", 0) else [r"(model\.)?layers\.\d+\.mlp\.shared_experts\..*"]
    parts.finish(plan, model, head_size, ignore=unused)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"hy_v4": parts.Dispatch("HY-V4", convert_hy_v4, ("HYV4ForCausalLM", "HYV4Model")),
            "hy_v4_vl_text": parts.Dispatch("HY-V4-VL text", convert_hy_v4, ("HYV4VLTextModel",))}
