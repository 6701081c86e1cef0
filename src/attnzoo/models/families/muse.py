"""Meta's Muse Glimmer and Muse Spark text models -> :class:`~attnzoo.DecoderLM`.

Muse Glimmer (``muse_glimmer_text``): the
language model of ``MuseGlimmerForConditionalGeneration`` (its vision tower, adapter and projection
are out of scope; the wrapper row ``muse_glimmer`` of :mod:`attnzoo.models.hf.wrappers`) and
``MuseGlimmerTextModel``. Line numbers: transformers 5.25's
``models/muse_glimmer/modeling_muse_glimmer.py``.

* Embedding (``MuseGlimmerTextNormedEmbedding``, 415-424): the token rows through a weight-less
  RMSNorm (eps ``rms_norm_eps``): a :class:`~attnzoo.models.families.minimax.NormedEmbedding`
  around :class:`~attnzoo.models.families.dense.WeightlessRMSNorm` (no parameter).
* Attention (``MuseGlimmerTextAttention``, 262-347): GQA; q and k per head through a weight-less
  RMSNorm (eps ``rms_norm_eps``), q times ``qk_scale_factor`` (the q norm's constant weight, as
  transformers multiplies after the norm); RoPE on the layers whose
  ``layer_rope_theta`` is not 0 (NoPE where it is 0); a causal window of ``sliding_window - 1``
  keys on the ``sliding_attention`` layers; an element-wise sigmoid output gate ``gate_proj``
  before ``o_proj`` (``output_gate="element"``).
* Norms on both sides of both sub-layers (``MuseGlimmerTextCenteredRMSNorm``, 109-126: ``1 + w``
  in float32, loaded as ``w + 1``); the two after the sub-layers use ``post_norm_eps``.
* The final norm (``MuseGlimmerRMSNorm``, 88-106) multiplies by ``w`` (not ``1 + w``).
* Logits (1163-1166): ``T * tanh(output_multiplier * logits / T)`` with ``T =
  final_logit_softcapping``: ``output_multiplier`` folded into the head's weight, the soft cap on
  the :class:`~attnzoo.models.parts.LMHead`.

Refused by name: ``tie_word_embeddings`` (the multiplier is folded into the head, which a tied
embedding would share), a ``layer_rope_theta`` entry other than 0 and the global ``rope_theta``
(transformers reads only whether it is 0 and rotates every RoPE layer by the global theta, so
another value is ambiguous), layer kinds other than ``full_attention`` / ``sliding_attention``,
a ``final_logit_softcapping`` that is not a positive number (transformers divides by it),
``hidden_activation`` other than SiLU.

Muse Spark (``muse_spark_text``: the language model of ``MuseSparkForConditionalGeneration``, whose
vision and audio towers are dropped; ``MuseSparkTextModel``; ``models/muse_spark/modeling_muse_spark.py``)
is Muse Glimmer's layer with:

* the attention output RMS-normalised per head without a weight (``o_norm``, 408) before the gate
  (:class:`NormedOutputGate`);
* ``post_attention_layernorm`` weight-less (eps ``post_norm_eps``), ``post_feedforward_layernorm``
  input-scaled, ``rmsnorm(x * (1 + w))`` (:class:`InputScaledRMSNorm`, 127-143);
* residual gates instead of additions (414-425, :class:`ClampedResidualGate` in a
  :class:`~attnzoo.models.families.beam.MixedResidualBlock`): ``b y + sqrt(max(sigmoid(-w) (1 + b),
  1e-3)) x``, ``b = sigmoid(w)``, ``w = gate / residual_gate_temperature`` (loaded so), float32;
* by ``mlp_layer_types`` (default: all ``sparse``) a SiLU MLP or the pooled MoE (:class:`PooledMoE`,
  162-251): routed on the layer's input by a float32 router whose logits are times
  ``output_multiplier`` (folded into its weight), ``sigmoid`` + ``e_score_correction_bias`` picking
  the top ``num_experts_per_tok`` of ``num_local_experts``, the picked sigmoids renormalised
  (``+ 1e-15``) times ``routed_scaling_factor``; the experts run at ``moe_hidden_size`` on
  ``pre_expert_norm(pre_expert_proj(x))`` (a ``1 + w`` norm), each expert's output through the shared
  input-scaled ``post_expert_norm`` before its weight, the sum through ``post_expert_proj``.

Refused for Muse Spark too: ``hidden_act`` other than SiLU, ``mlp_layer_types`` entries other than
``dense`` / ``sparse``; and Muse Glimmer's refusals.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import BlockLayers, RMSNorm
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import put_stacked_experts
from attnzoo.models.families.beam import MixedResidualBlock, ResidualGate
from attnzoo.models.families.dense import WeightlessRMSNorm
from attnzoo.models.families.minimax import NormedEmbedding
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.moe import Experts, MixtureOfExperts, Routing
from attnzoo.nn.parts import AttentionParts, OutputGate, Scores, qk_rmsnorm

__all__ = ["DISPATCH", "ClampedResidualGate", "InputScaledRMSNorm", "NormedOutputGate", "PooledMoE",
           "build_muse_glimmer", "build_muse_spark", "convert_muse_glimmer", "convert_muse_spark", "glimmer_config",
           "spark_config"]

TYPES = ("full_attention", "sliding_attention")
NORMS = parts.GEMMA_NORMS
#: ``MuseGlimmerTextConfig``'s defaults of the keys read here (configuration 118-142)
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5, "post_norm_eps": 1e-8, "qk_scale_factor": 3.87, "output_multiplier": 0.19611613513818404,
    "final_logit_softcapping": 20.0, "sliding_window": 2048, "hidden_activation": "silu", "head_dim": 128,
    "tie_word_embeddings": False, "attention_bias": False}


def glimmer_config(hf: HFConfig, defaults: dict[str, Any] = DEFAULTS) -> HFConfig:
    """``hf`` with ``defaults`` where absent, ``layer_types`` and ``layer_rope_theta`` as
    ``MuseGlimmerTextConfig.__post_init__`` fills them (every 4th layer counted back from the last:
    full attention, NoPE), the options attnzoo cannot reproduce refused by name."""
    cap = hf.data.get("final_logit_softcapping", defaults["final_logit_softcapping"])
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise hf.unsupported(f"final_logit_softcapping={cap!r} (supported: a positive number; transformers divides "
                             f"the logits by it)")
    out = hf.with_defaults(defaults)
    n = out.req("num_hidden_layers")
    if out.raw("layer_types") is None:
        out.data["layer_types"] = [TYPES[(n - 1 - i) % 4 != 0] for i in range(n)]
    theta = parts.rope_params(out).get("rope_theta", 10000.0)
    thetas = out.raw("layer_rope_theta")
    if thetas is None:
        thetas = [0 if (n - 1 - i) % 4 == 0 else theta for i in range(n)]
    if not isinstance(thetas, list) or len(thetas) != n or any(
            isinstance(t, bool) or not isinstance(t, (int, float)) or t not in (0, theta) for t in thetas):
        raise out.unsupported(f"layer_rope_theta={thetas!r} (supported: {n} entries, each 0 (NoPE) or the "
                              f"global rope_theta {theta}: transformers rotates every RoPE layer by the global one)")
    out.data["layer_rope_theta"] = thetas
    parts.unsupported_keys(out, {"tie_word_embeddings": lambda v: not v,
                                 "pretraining_tp": lambda v: v in (None, 1)})
    return out


def build_muse_glimmer(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                       dtype: Any = None) -> DecoderLM:
    """The decoder of a ``MuseGlimmerTextConfig`` (random weights; see the module docstring)."""
    hf = glimmer_config(hf)
    C, depth = hf.req("hidden_size"), hf.req("num_hidden_layers")
    D, eps, post_eps = hf.req("head_dim"), hf.req("rms_norm_eps", float), hf.req("post_norm_eps", float)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_activation", {"silu": "swiglu"}, "silu"),
                          **kw)
    blocks = []
    for w, theta in zip(parts.sliding_windows(hf, kinds), hf.req("layer_rope_theta", list), strict=True):
        attention = parts.attention_factory(hf, window=w, rope=rope if theta else None, qk_norm="head",
                                            output_gate="element", **kw)
        block = parts.block(C, attention, ffn, parts.rms_norm(C, eps, **kw), sublayer_norm="both")
        for name in ("attn_out_norm", "ffn_out_norm"):
            getattr(block, name).eps = post_eps
        blocks.append(block)
    embedding = NormedEmbedding(hf.req("vocab_size"), C, norm=WeightlessRMSNorm(C, eps), **kw)
    model = parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embedding=embedding,
                          logit_softcap=hf.req("final_logit_softcapping", float), **kw)
    return parts.float32_scale_norms(model, keep_float32=True)  # (1 + w) in float32, as transformers


def _ones(plan: Plan, name: str, width: int, what: str, value: float = 1.0) -> None:
    """A weight-less norm's weight: the constant ``value`` (``what``: transformers' module)."""
    plan.put_tensor(name, torch.full((width,), value), f"{what} (no weight: {value:g})")


def _put_glimmer_attention(plan: Plan, o: str, h: str, hf: HFConfig) -> None:
    """A layer's attention: q/k/v/o, the weight-less QK norms (ones), the output gate."""
    parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.req("attention_bias", bool))
    for n, value in (("q_norm", hf.req("qk_scale_factor", float)), ("k_norm", 1.0)):  # q times qk_scale_factor
        _ones(plan, f"{o}attn.frontier.{n}_weight", hf.req("head_dim"), f"{h}self_attn.qk_norm", value)
    plan.put(f"{o}attn.frontier.gate_proj.weight", f"{h}self_attn.gate_proj.weight")


def _finish(plan: Plan, model: DecoderLM, hf: HFConfig, head_size: int | None) -> DecoderLM:
    """The final norm (``w``, not ``1 + w``), the head times ``output_multiplier``, then the copy."""
    plan.put("norm.weight", "norm.weight")
    if head_size is None:
        plan.src.prefix = ""
        plan.put("lm_head.weight", "lm_head.weight",
                 functools.partial(torch.mul, other=hf.req("output_multiplier", float)))
    plan.apply(model, ignore=[r"(model\.)?rotary_emb\w*\.\w+", r"lm_head\.weight"])
    return model


def convert_muse_glimmer(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head times ``output_multiplier``)."""
    hf = glimmer_config(hf)
    model, plan, head_size = parts.start(hf, sd, build_muse_glimmer, device=device, dtype=dtype)
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        _put_glimmer_attention(plan, o, h, hf)
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        for ours, theirs in NORMS:
            plan.put(f"{o}{ours}.weight", f"{h}{theirs}.weight", parts.plus_one)
    return _finish(plan, model, hf, head_size)


# --------------------------------------------------------------------------- Muse Spark
#: ``MuseSparkTextConfig``'s defaults of the keys read here (configuration 114-156)
SPARK_DEFAULTS: dict[str, Any] = {
    **DEFAULTS, "qk_scale_factor": 5.4730064863875, "output_multiplier": 0.1767766952966369, "head_dim": 64,
    "hidden_act": "silu", "num_local_experts": 256, "num_experts_per_tok": 8, "routed_scaling_factor": 1.0,
    "residual_gate_temperature": 0.3, "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}}


class InputScaledRMSNorm(nn.Module):
    """Muse Spark's ``MuseSparkTextInputScaledRMSNorm`` (127-143): the weight first, then the norm,
    ``rmsnorm(x * weight)`` in float32 (the product rounded to ``x``'s dtype before the norm, as
    transformers rounds it). Weight: ``weight [C]`` (transformers' ``1 + w``, loaded so).
    Shapes: ``[..., C] -> [..., C]``."""

    def __init__(self, dim: int, eps: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim, self.eps = int(dim), float(eps)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        scaled = (x.to(wide) * self.weight.to(wide)).to(x.dtype).to(wide)
        return F.rms_norm(scaled, (self.dim,), eps=self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class NormedOutputGate(OutputGate):
    """An :class:`~attnzoo.nn.parts.OutputGate` whose attention output ``out [B, H, N, D]`` is first
    RMS-normalised per head over ``D`` without a weight (Muse Spark's ``o_norm``, 395), in float32.
    Weight: the gate's ``[H * D, C]`` (``mode="element"``) or ``[H, C]``."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mode: str = "element", *, eps: float) -> None:
        super().__init__(dim, num_heads, head_dim, mode)
        self.eps = float(eps)

    def gate(self, out: Tensor, x: Tensor) -> Tensor:
        wide = torch.promote_types(out.dtype, torch.float32)
        normed = F.rms_norm(out.to(wide), (out.shape[-1],), eps=self.eps).to(out.dtype)
        return super().gate(normed, x)


class ClampedResidualGate(ResidualGate):
    """Muse Spark's ``MuseSparkResidualGate`` (414-425): Ergo's mix ``b y + a x`` (``b = sigmoid(w)``)
    with ``a = sqrt(max(sigmoid(-w) (1 + b), min_keep))``; ``w`` is transformers' ``gate`` divided by
    ``residual_gate_temperature`` (loaded so), float32. Shapes: ``y, x [..., C] -> [..., C]``."""

    def __init__(self, dim: int, *, min_keep: float = 1e-3, device: torch.device | str | None = None) -> None:
        super().__init__(dim, device=device)
        self.min_keep = float(min_keep)

    def forward(self, y: Tensor, x: Tensor) -> Tensor:
        w = self.weight.to(torch.promote_types(y.dtype, torch.float32))
        branch = torch.sigmoid(w)
        keep = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + branch), min=self.min_keep))
        return (branch * y + keep * x).to(x.dtype)


class PooledMoE(MixtureOfExperts):
    """Muse Spark's MoE (``MuseSparkMoE``, 162-251): routed on ``x [T, C]`` (float32 sigmoid of the
    router's logits, ``e_score_correction_bias`` picks, the picked sigmoids renormalised with ``+ 1e-15``,
    times ``routed_scaling_factor``; the router's ``output_multiplier`` folded into its weight), the
    experts run at ``P = moe_hidden_size`` on ``pre_norm(pre_proj(x))``, each expert's output through the
    shared :class:`InputScaledRMSNorm` ``expert_norm`` before its routing weight, the sum back through
    ``post_proj``.

    Weights: ``router [E, C]`` (float32), ``pre_proj [P, C]``, ``pre_norm [P]``, the experts ``[E, F, P]``
    / ``[E, P, F]``, ``expert_norm [P]``, ``post_proj [C, P]``. Shapes: ``x [..., C] -> [..., C]``."""

    def __init__(self, dim: int, pooled: int, hidden: int, num_experts: int, top_k: int, *, routing: Routing,
                 eps: float, expert_eps: float, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(pooled, hidden, num_experts, top_k, routing=routing, experts=Experts(), **kw)
        self.model_dim = int(dim)
        self.router = nn.Linear(dim, num_experts, bias=False, **kw)
        self.keep_router_in_float32()
        self.pre_proj = nn.Linear(dim, pooled, bias=False, **kw)
        self.pre_norm = RMSNorm(pooled, eps, **kw)
        self.expert_norm = InputScaledRMSNorm(pooled, expert_eps, **kw)
        self.post_proj = nn.Linear(pooled, dim, bias=False, **kw)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.model_dim)  # [T, C]
        weights, experts, _ = self.route(flat)  # [T, k]
        pooled = self.pre_norm(self.pre_proj(flat))  # [T, P]
        out = torch.zeros_like(pooled)
        for e in torch.unique(experts).tolist():
            token, slot = torch.nonzero(experts == e, as_tuple=True)
            y = self.expert_norm(self.expert(e, pooled[token])) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return self.post_proj(out).view(shape)


def spark_config(hf: HFConfig) -> HFConfig:
    """``hf`` as ``MuseSparkTextConfig.__post_init__`` reads it (:func:`glimmer_config` with
    :data:`SPARK_DEFAULTS`; ``mlp_layer_types`` by default every layer sparse), refusals by name."""
    out = glimmer_config(hf, SPARK_DEFAULTS)
    n = out.req("num_hidden_layers")
    if out.raw("mlp_layer_types") is None:
        out.data["mlp_layer_types"] = ["sparse"] * n
    parts.layer_types(out, n, ("dense", "sparse"), key="mlp_layer_types")
    parts.unsupported_keys(out, {"hidden_act": lambda v: v in ("silu", "swish")})
    return out


def _spark_attention(hf: HFConfig, window: int | None, rope: nn.Module | None,
                     kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """A Muse Spark attention: Muse Glimmer's with the weight-less ``o_norm`` before the gate."""
    C, H, D = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("head_dim")
    Hkv, eps = hf.get("num_key_value_heads", H), hf.req("rms_norm_eps", float)

    def make() -> nn.Module:
        q_norm, k_norm = qk_rmsnorm("head", H, Hkv, D, eps)
        settings = AttentionParts(q_norm=q_norm, k_norm=k_norm, output_gate=NormedOutputGate(C, H, D, eps=eps),
                                  scores=Scores())
        return build_softmax(MultiHeadAttention, C, H, num_kv_heads=Hkv, head_dim=D, causal=True, window=window,
                             rope=rope, bias=hf.req("attention_bias", bool),
                             dropout=hf.get("attention_dropout", 0.0, float), parts=settings, **kw)
    return make


def _spark_ffn(hf: HFConfig, sparse: bool, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    C = hf.req("hidden_size")
    if not sparse:
        return parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", **kw)
    routing = Routing("sigmoid_topk", norm_topk_prob=True, norm_eps=1e-15, scaling=hf.req("routed_scaling_factor", float))
    return functools.partial(PooledMoE, C, hf.req("moe_hidden_size"), hf.req("moe_intermediate_size"),
                             hf.req("num_local_experts"), hf.req("num_experts_per_tok"), routing=routing,
                             eps=hf.req("rms_norm_eps", float), expert_eps=hf.req("post_norm_eps", float), **kw)


def build_muse_spark(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """The decoder of a ``MuseSparkTextConfig`` (random weights; see the module docstring)."""
    hf = spark_config(hf)
    C, depth = hf.req("hidden_size"), hf.req("num_hidden_layers")
    eps, post_eps = hf.req("rms_norm_eps", float), hf.req("post_norm_eps", float)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    rope = parts.rotary(hf, parts.rope_params(hf), hf.req("head_dim"))
    blocks = []
    for w, theta, mlp in zip(parts.sliding_windows(hf, kinds), hf.req("layer_rope_theta", list),
                             hf.req("mlp_layer_types", list), strict=True):
        layers = BlockLayers(attention=_spark_attention(hf, w, rope if theta else None, kw),
                             feed_forward=_spark_ffn(hf, mlp == "sparse", kw), norm=parts.rms_norm(C, eps, **kw),
                             sublayer_norm="both")
        block = MixedResidualBlock(C, layers, attn_residual=ClampedResidualGate(C, device=device),
                                   ffn_residual=ClampedResidualGate(C, device=device))
        block.attn_out_norm.eps = post_eps
        block.ffn_out_norm = InputScaledRMSNorm(C, post_eps, **kw)
        blocks.append(block)
    embedding = NormedEmbedding(hf.req("vocab_size"), C, norm=WeightlessRMSNorm(C, eps), **kw)
    model = parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embedding=embedding,
                          logit_softcap=hf.req("final_logit_softcapping", float), **kw)
    return parts.float32_scale_norms(model, keep_float32=True)


def _put_spark_layer(plan: Plan, o: str, h: str, hf: HFConfig, sparse: bool) -> None:
    C, T = hf.req("hidden_size"), hf.req("residual_gate_temperature", float)
    _put_glimmer_attention(plan, o, h, hf)
    plan.put(f"{o}attn_norm.weight", f"{h}input_layernorm.weight", parts.plus_one)
    _ones(plan, f"{o}attn_out_norm.weight", C, f"{h}post_attention_layernorm")
    plan.put(f"{o}ffn_norm.weight", f"{h}pre_feedforward_layernorm.weight", parts.plus_one)
    plan.put(f"{o}ffn_out_norm.weight", f"{h}post_feedforward_layernorm.weight", parts.plus_one)
    for ours, theirs in (("attn_residual", "post_attention"), ("ffn_residual", "post_feedforward")):
        plan.put(f"{o}{ours}.weight", f"{h}{theirs}_residual_gate.gate", functools.partial(torch.div, other=T))
    m = f"{h}mlp."
    if not sparse:
        parts.put_mlp(plan, f"{o}ffn.", m)
        return
    plan.put(f"{o}ffn.router.weight", f"{m}gate.weight",
             functools.partial(torch.mul, other=hf.req("output_multiplier", float)))
    plan.put(f"{o}ffn.score_bias", f"{m}gate.e_score_correction_bias")
    plan.put(f"{o}ffn.pre_proj.weight", f"{m}pre_expert_proj.weight")
    plan.put(f"{o}ffn.pre_norm.weight", f"{m}pre_expert_norm.weight", parts.plus_one)
    put_stacked_experts(plan, f"{o}ffn.", m)
    plan.put(f"{o}ffn.expert_norm.weight", f"{m}experts.post_expert_norm.weight", parts.plus_one)
    plan.put(f"{o}ffn.post_proj.weight", f"{m}post_expert_proj.weight")


def convert_muse_spark(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head times ``output_multiplier``)."""
    hf = spark_config(hf)
    model, plan, head_size = parts.start(hf, sd, build_muse_spark, device=device, dtype=dtype)
    for i, mlp in enumerate(hf.req("mlp_layer_types", list)):
        _put_spark_layer(plan, f"blocks.{i}.", f"layers.{i}.", hf, mlp == "sparse")
    return _finish(plan, model, hf, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"muse_glimmer_text": parts.Dispatch("Muse Glimmer", convert_muse_glimmer, ("MuseGlimmerTextModel",)),
            "muse_spark_text": parts.Dispatch("Muse Spark", convert_muse_spark, ("MuseSparkTextModel",))}
