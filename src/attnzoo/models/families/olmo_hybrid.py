"""OLMo-hybrid -> :class:`~attnzoo.DecoderLM`: ``OlmoHybridForCausalLM`` and ``OlmoHybridModel``.

``layer_types``: by default three ``linear_attention`` layers per ``full_attention`` layer.

* Linear layers (pre-norm: ``input_layernorm``, ``post_attention_layernorm``): the gated DeltaNet
  of :class:`~attnzoo.models.families.qwen3_next.QwenGatedDeltaNet` with separate ``q/k/v/a/b/g``
  projections, grouped value heads, ``beta = 2 sigmoid(b)`` when ``linear_allow_neg_eigval``, and
  a gated output RMSNorm of fixed epsilon ``1e-5``.
* Full layers (OLMo's norms on the sub-layer outputs): QK RMSNorm over all heads, RoPE unless
  the config has no ``rope_theta`` (the released checkpoints: NoPE), causal attention.
* Dense SwiGLU feed-forwards; plain RMSNorms.

Half precision: the RMSNorms scale in float32 and round once (``modeling_olmo_hybrid.py`` 70-84,
:class:`~attnzoo.models.families._common.Float32ScaleRMSNorm`).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.qwen3_next import QwenGatedDeltaNet, put_deltanet_rest
from attnzoo.models.hf._state import HFConfig, Plan

__all__ = ["DISPATCH", "build_olmo_hybrid", "convert_olmo_hybrid"]

TYPES = ("linear_attention", "full_attention")


def build_olmo_hybrid(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                      dtype: Any = None) -> DecoderLM:
    """The decoder of an ``OlmoHybridConfig`` (random weights; see the module docstring)."""
    parts.unsupported_keys(hf, {"hidden_act": lambda v: v in (None, "silu", "swish")})
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    raw_rope = hf.raw("rope_parameters")
    rope = None if not isinstance(raw_rope, dict) or raw_rope.get("rope_theta") is None else parts.rotary(
        hf, parts.rope_params(hf), hf.get("head_dim", C // H))
    full = parts.attention_factory(hf, window=None, rope=rope, qk_norm="all", **kw)
    linear = functools.partial(QwenGatedDeltaNet, C, hf.req("linear_num_key_heads"), hf.req("linear_num_value_heads"),
                               hf.req("linear_key_head_dim"), hf.req("linear_value_head_dim"),
                               hf.get("linear_conv_kernel_dim", 4), norm_eps=1e-5,
                               allow_neg_eigval=hf.get("linear_allow_neg_eigval", False, bool), **kw)
    ffn, norm = parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", **kw), parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, linear, ffn, norm) if k == "linear_attention" else parts.block(C, full, ffn, norm,
                                                                                sublayer_norm="output")
              for k in kinds]
    return parts.float32_scale_norms(parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw))


def _put_linear(plan: Plan, ours: str, theirs: str) -> None:
    plan.put_cat(f"{ours}in_proj_qkvz.weight", [f"{theirs}{n}_proj.weight" for n in "qkvg"])
    plan.put_cat(f"{ours}in_proj_ba.weight", [f"{theirs}{n}_proj.weight" for n in "ba"])
    put_deltanet_rest(plan, ours, theirs, norm="o_norm", out="o_proj")


def _saved_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """A saved folder's names -> the model's: ``attention_layer_norm`` -> ``input_layernorm``,
    ``feedforward_layer_norm`` -> ``post_attention_layernorm``, ``{q,k,v}_conv1d`` -> one ``conv1d``."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        key = key.replace(".attention_layer_norm.", ".input_layernorm.")
        out[key.replace(".feedforward_layer_norm.", ".post_attention_layernorm.")] = t
    return parts.fuse_qkv_convs(out, "linear_attn")


def convert_olmo_hybrid(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; saved-folder names too)."""
    sd = _saved_names(sd)
    model, plan, head_size = parts.start(hf, sd, build_olmo_hybrid, device=device, dtype=dtype)
    kinds = parts.layer_types(hf, model.depth, TYPES)
    for i, kind in enumerate(kinds):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if kind == "linear_attention":
            _put_linear(plan, f"{o}attn.", f"{h}linear_attn.")
            norms = [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.get("attention_bias", False, bool), qk_norm=True)
            norms = [("attn_out_norm", "post_attention_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm")]
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put_pairs(o, h, norms, bias=False)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"olmo_hybrid": parts.Dispatch("OLMo-hybrid", convert_olmo_hybrid, ("OlmoHybridForCausalLM",))}
