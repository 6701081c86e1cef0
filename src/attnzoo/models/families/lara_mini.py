"""Lara-mini (``lara_mini``) -> :class:`~attnzoo.DecoderLM`: ``LaraMiniForCausalLM`` and ``LaraMiniModel``
(Translated's Lara-4-Mini).

Line numbers below are transformers 5.25's ``models/lara_mini/modeling_lara_mini.py`` /
``configuration_lara_mini.py``. A pre-norm hybrid (modeling 907-961) whose layers are, by
``layer_types`` (absent: the released period-5 pattern ``linear, sliding, linear, full,
sliding``, config 118-129):

* ``linear_attention``: Qwen3.5's gated DeltaNet (modeling 623-811), here
  :class:`~attnzoo.models.families.qwen3_next.QwenGatedDeltaNet` (grouped value heads: key head
  ``j // (Hv / Hk)`` serves value head ``j``; conv1d without bias, SiLU; L2-normalised q, k;
  ``beta = sigmoid(b)``; ``log a = -exp(A_log) * softplus(a + dt_bias)``; per-head RMSNorm of
  epsilon ``rms_norm_eps`` times ``silu(z)``). The module keeps ``in_proj_qkv`` / ``in_proj_z`` /
  ``in_proj_b`` / ``in_proj_a`` and ``norm``; checkpoints on disk fuse them into one ``in_proj``
  (rows ``[q; k; v; z; b; a]``) and name the norm ``out_norm`` (transformers' conversion_mapping
  ``"lara_mini"``): both load.
* ``sliding_attention``: Qwen3 attention (modeling 213-284: GQA, per-head QK RMSNorm with a plain
  ``weight``, ``attention_bias`` on q/k/v/o, no output gate), full-width RoPE, a causal window of
  ``sliding_window - 1`` keys (transformers' ``q - k < sliding_window``).
* ``full_attention``: the same attention without any positional encoding (NoPE: modeling 1062-1063
  passes the rotary embedding to the sliding layers only), no window.

Every layer's feed-forward is the sparse MoE (modeling 814-904): softmax over the ``E`` router
logits, computed in float32 from the float32-cast input and weight (modeling 864-866, unlike
Qwen3-Next: :class:`Float32Router`), top ``num_experts_per_tok``, renormalised when
``norm_topk_prob``; SwiGLU experts in the stacked layout; plus a shared SwiGLU expert of width
``shared_expert_intermediate_size`` added in full, *without* Qwen3-Next's sigmoid gate (modeling
901-903; width 0: none). The RMSNorms scale by ``weight`` (not Qwen3-Next's ``1 + weight``).

Config keys a ``config.json`` leaves out take ``LaraMiniConfig``'s defaults (:data:`DEFAULTS`,
config 84-116). Accepted and without effect on the outputs: ``output_router_logits`` /
``router_aux_loss_coef`` (the training-only load-balancing loss, not computed here). Refused:
``hidden_act`` other than SiLU (the convolution's and the experts' activation), a
``partial_rotary_factor`` other than 1 (transformers' Lara attention rotates the whole head: the
default rope ignores the factor, the scaled ones fail on it).

Half precision: the RMSNorms scale by their weight in float32 and round once, as
``LaraMiniRMSNorm`` (modeling 53-66: :class:`~attnzoo.models.families._common.Float32ScaleRMSNorm`);
the DeltaNet's convolution and gated norm round as transformers' (see Qwen3-Next).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import FeedForward
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import put_moe
from attnzoo.models.families.qwen3_5 import put_split_deltanet
from attnzoo.models.families.qwen3_next import QwenGatedDeltaNet, put_deltanet_rest
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.moe import MixtureOfExperts, Routing

__all__ = ["DEFAULTS", "DISPATCH", "LAYER_PATTERN", "Float32Router", "build_lara_mini", "canonical",
           "convert_lara_mini", "lara_moe", "put_lara_deltanet"]

#: the released layer pattern, repeated over the depth when ``layer_types`` is absent (config 118-129)
LAYER_PATTERN = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")

#: ``LaraMiniConfig``'s defaults of the keys read here (config 84-116), for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 34, "num_attention_heads": 16,
    "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 8, "linear_num_value_heads": 16, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 4, "num_experts": 128, "norm_topk_prob": True,
    "sliding_window": 512,
}

#: the shared expert's projections (transformers' and attnzoo's names agree)
_SHARED = ("gate_proj", "up_proj", "down_proj")


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: :data:`DEFAULTS` where a key is absent, ``layer_types``
    the released :data:`LAYER_PATTERN` over the depth when absent; refuses what attnzoo cannot
    reproduce (see the module docstring)."""
    out = hf.with_defaults(DEFAULTS)
    if not out.has("layer_types"):
        depth = out.req("num_hidden_layers")
        out.data["layer_types"] = [LAYER_PATTERN[i % len(LAYER_PATTERN)] for i in range(depth)]
    parts.unsupported_keys(out, {"hidden_act": lambda v: v in ("silu", "swish")})
    partial = parts.rope_params(out).get("partial_rotary_factor", out.raw("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise out.unsupported(f"partial_rotary_factor={partial!r} (Lara-mini's attention rotates the whole head)")
    return out


class Float32Router(nn.Linear):
    """Lara-mini's router (``LaraMiniTopKRouter``, modeling 862-866): the logits ``x W^T`` computed
    in float32 (or float64) from the input and the weight cast up, whatever their dtype.
    Shapes: ``x [T, C] -> [T, E]`` (float32 for half-precision inputs)."""

    def forward(self, x: Tensor) -> Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        return F.linear(x.to(wide), self.weight.to(wide), None if self.bias is None else self.bias.to(wide))


def lara_moe(hf: HFConfig, *, device: Any = None, dtype: Any = None) -> MixtureOfExperts:
    """The feed-forward of every Lara-mini layer: softmax-then-top-k routing from float32 logits
    (:class:`Float32Router`), ``norm_topk_prob``, SwiGLU experts, an ungated shared SwiGLU expert
    (none when ``shared_expert_intermediate_size`` is 0)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    C, E = hf.req("hidden_size"), hf.req("num_experts")
    shared_hidden = hf.get("shared_expert_intermediate_size", 0)
    shared = FeedForward(C, shared_hidden, "swiglu", bias=False, **kw) if shared_hidden else None
    moe = MixtureOfExperts(C, hf.req("moe_intermediate_size"), E, hf.req("num_experts_per_tok"),
                           routing=Routing("softmax_topk", norm_topk_prob=hf.req("norm_topk_prob", bool)),
                           shared_expert=shared, **kw)
    moe.router = Float32Router(C, E, bias=False, **kw)
    return moe


def build_lara_mini(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                    dtype: Any = None) -> DecoderLM:
    """The decoder of a ``LaraMiniConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, depth = hf.req("hidden_size"), hf.req("num_hidden_layers")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, ("linear_attention", "sliding_attention", "full_attention"))
    rope = parts.rotary(hf, parts.rope_params(hf), hf.req("head_dim"))
    linear = functools.partial(QwenGatedDeltaNet, C, hf.req("linear_num_key_heads"), hf.req("linear_num_value_heads"),
                               hf.req("linear_key_head_dim"), hf.req("linear_value_head_dim"),
                               hf.req("linear_conv_kernel_dim"), norm_eps=eps, **kw)
    mixers = [linear if kind == "linear_attention" else
              parts.attention_factory(hf, window=window, rope=rope if kind == "sliding_attention" else None,
                                      qk_norm="head", **kw)
              for kind, window in zip(kinds, parts.sliding_windows(hf, kinds), strict=True)]
    moe = functools.partial(lara_moe, hf, **kw)
    blocks = [parts.block(C, mixer, moe, parts.rms_norm(C, eps, **kw)) for mixer in mixers]
    return parts.float32_scale_norms(parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw))


def put_lara_deltanet(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """A :class:`QwenGatedDeltaNet` at ``ours`` from Lara-mini's linear layer at ``theirs``: the
    module's separate projections and ``norm``, or the checkpoint's fused ``in_proj`` (rows
    ``[q; k; v; z; b; a]``: ``in_proj_qkvz`` the first ``2 Hk Dk + 2 Hv Dv``, ``in_proj_ba`` the
    last ``2 Hv``) and ``out_norm``."""
    if not plan.src.has(f"{theirs}in_proj.weight"):
        put_split_deltanet(plan, ours, theirs, hf)
        return
    qkvz = 2 * hf.req("linear_num_key_heads") * hf.req("linear_key_head_dim") + \
        2 * hf.req("linear_num_value_heads") * hf.req("linear_value_head_dim")
    plan.put(f"{ours}in_proj_qkvz.weight", f"{theirs}in_proj.weight", lambda w: w[:qkvz].contiguous())
    plan.put(f"{ours}in_proj_ba.weight", f"{theirs}in_proj.weight", lambda w: w[qkvz:].contiguous())
    put_deltanet_rest(plan, ours, theirs, norm="out_norm")


def convert_lara_mini(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> nn.Module:
    """Build a Lara-mini decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_lara_mini, device=device, dtype=dtype)
    kinds, shared = hf.req("layer_types", list), hf.get("shared_expert_intermediate_size", 0) > 0
    for i, kind in enumerate(kinds):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if kind == "linear_attention":
            put_lara_deltanet(plan, f"{o}attn.", f"{h}linear_attn.", hf)
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.req("attention_bias", bool), qk_norm=True)
        put_moe(plan, f"{o}ffn.", f"{h}mlp.", "stacked", shared=shared)
        if not shared:  # width 0: transformers keeps empty [0, C] / [C, 0] projections, adding nothing
            for name in _SHARED:
                plan.src.opt(f"{h}mlp.shared_expert.{name}.weight")
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"lara_mini": parts.Dispatch("Lara-mini", convert_lara_mini, ("LaraMiniForCausalLM", "LaraMiniModel"))}
