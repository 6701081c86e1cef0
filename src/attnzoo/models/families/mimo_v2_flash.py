"""Xiaomi MiMo-V2-Flash (``mimo_v2_flash``) -> :class:`~attnzoo.DecoderLM`: ``MiMoV2FlashForCausalLM``
and ``MiMoV2FlashModel``. Line numbers: transformers 5.25's
``models/mimo_v2_flash/modular_mimo_v2_flash.py`` (``modeling_mimo_v2_flash.py`` where it says so).

LLaMA's pre-norm layer (RMSNorm; ``modeling`` 415-448) with two attention kinds by ``layer_types``
(default: full on layer 0 and every 6th, sliding elsewhere; 104-108):

* The attention (Qwen2's, 236-300): q/k of ``head_dim`` (default 192), values of ``v_head_dim``
  (default 128), the values times ``attention_value_scale`` (0.707; 284), scores scaled by
  ``head_dim ** -0.5``, q/k/v biases by ``attention_bias`` and none on ``o_proj`` (252-255). The
  sliding layers have twice ``num_key_value_heads`` (241-242), a causal window of
  ``sliding_window - 1`` keys (``sliding_window``: 129, or ``sliding_window_size + 1``; 120-121) and
  learnable per-head sinks (a logit joining each softmax, 212-224, 256).
* RoPE per layer kind (``rope_parameters["full_attention"]`` / ``["sliding_attention"]``, thetas
  5e6 / 1e4 by default; 110-114), on the first ``int(head_dim * partial_rotary_factor)`` channels
  (0.334 by default; 153-162) in split-half pairs.
* The feed-forward by ``mlp_layer_types`` (default: the first dense, the rest sparse; 109-110): a
  SwiGLU MLP of ``intermediate_size``, or DeepSeek-V3's MoE without shared experts (177-194:
  :func:`~attnzoo.models.families._moe.deepseek_moe`, sigmoid scores in float32 with the
  ``e_score_correction_bias`` choosing, group-limited top-k, ``norm_topk_prob``,
  ``routed_scaling_factor``; the router weight kept in float32, 315).

attnzoo's :class:`~attnzoo.MultiHeadAttention` has one head width for q, k and v, so the heads are
``D = max(head_dim, v_head_dim)`` wide: the narrower projections get zero rows (the zero value
channels give zero outputs, met by zero columns of ``out_proj``; zero q/k channels add nothing to
the scores, whose scale stays ``head_dim ** -0.5``) -- exact, at the cost of the padding (the
zero weights also get zero gradients). ``attention_value_scale`` is folded into the value rows
at load. Saved folders name the sinks ``attention_sink_bias`` (transformers renames them on load
and back on save): both load. The checkpoints' multi-token-prediction layers (``model.mtp.*``) are dropped.

Refused by name: a ``partial_rotary_factor`` giving an odd rotated width, ``hidden_act`` other
than SiLU, ``mlp_layer_types`` / ``layer_types`` entries of other kinds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import deepseek_moe, put_moe
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.moe import MixtureOfExperts

__all__ = ["DEFAULTS", "DISPATCH", "build_mimo_v2_flash", "convert_mimo_v2_flash"]

TYPES = ("full_attention", "sliding_attention")
#: ``MiMoV2FlashConfig``'s defaults of the keys read here (``configuration_mimo_v2_flash.py``; the
#: rest from ``Glm4MoeConfig``) that a ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "head_dim": 192, "v_head_dim": 128, "sliding_window": 129, "attention_value_scale": 0.707,
    "num_key_value_heads": 4, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-5,
    "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.334}}}


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: :data:`DEFAULTS` where absent (or ``None``), ``sliding_window``
    from ``sliding_window_size + 1``, the default ``layer_types`` / ``mlp_layer_types``, no shared
    experts (modular 104-121)."""
    data = dict(hf.data)
    if data.get("sliding_window_size") is not None:
        data["sliding_window"] = data["sliding_window_size"] + 1
    if data.get("routed_scaling_factor") is None:
        data["routed_scaling_factor"] = 1.0
    out = HFConfig(data, hf.source, hf.arch).with_defaults(DEFAULTS)
    depth = out.req("num_hidden_layers")
    if out.raw("layer_types") is None:
        out.data["layer_types"] = [TYPES[not (i == 0 or (i + 1) % 6 == 0)] for i in range(depth)]
    if out.raw("mlp_layer_types") is None:
        out.data["mlp_layer_types"] = ["dense"] + ["sparse"] * (depth - 1)
    out.data["n_shared_experts"] = 0  # MiMoV2FlashMoE deletes DeepSeek-V3's shared experts (172-179)
    parts.unsupported_keys(out, {"hidden_act": lambda v: v in ("silu", "swish"),
                                 "pretraining_tp": lambda v: v in (None, 1)})
    return out


def _widths(hf: HFConfig) -> tuple[int, int, int]:
    """``(head_dim, v_head_dim, D)``: the heads are ``D = max`` of the two wide."""
    qk, v = hf.req("head_dim"), hf.req("v_head_dim")
    return qk, v, max(qk, v)


def _rope(hf: HFConfig, kind: str) -> nn.Module:
    """The rotary embedding of one layer kind: its own ``rope_parameters[kind]``, on the first
    ``int(head_dim * partial_rotary_factor)`` channels of the ``D``-wide heads."""
    params = parts.rope_params(hf, kind)
    qk, _, D = _widths(hf)
    factor = params.get("partial_rotary_factor", 0.334)
    rotary = int(qk * factor)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or rotary < 2 or rotary % 2:
        raise hf.unsupported(f"partial_rotary_factor={factor!r} for {kind}: {rotary} rotated channels of {qk} "
                             f"(supported: an even number >= 2)")
    return parts.rotary(hf, params, D, rotary_dim=rotary if rotary != D else None)


def _attention(hf: HFConfig, kind: str, rope: nn.Module, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """One layer's attention: GQA of ``D``-wide heads, twice the key/value heads, a window and sinks
    on the sliding layers; scores scaled by ``head_dim ** -0.5``."""
    qk, _, D = _widths(hf)
    sliding = kind == "sliding_attention"
    view = HFConfig({**hf.data, "head_dim": D, "num_key_value_heads": hf.req("num_key_value_heads") * (1 + sliding)},
                    hf.source, hf.arch)
    window = hf.req("sliding_window") - 1 if sliding else None
    return parts.attention_factory(view, window=window, rope=rope, sinks=sliding, scale=qk ** -0.5, **kw)


def build_mimo_v2_flash(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                        dtype: Any = None) -> DecoderLM:
    """The decoder of a ``MiMoV2FlashConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, depth = hf.req("hidden_size"), hf.req("num_hidden_layers")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    ropes = {k: _rope(hf, k) for k in set(kinds)}
    dense = parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", **kw)
    sparse = functools.partial(deepseek_moe, hf, keep_router_float32=True, **kw)
    ffns = []
    for t in hf.req("mlp_layer_types", list):
        if t not in ("dense", "sparse"):
            raise hf.unsupported(f"mlp_layer_types entry {t!r} (supported: 'dense', 'sparse')")
        ffns.append(sparse if t == "sparse" else dense)
    if len(ffns) != depth:
        raise hf.unsupported(f"mlp_layer_types of {len(ffns)} entries for {depth} layers")
    blocks = [parts.block(C, _attention(hf, k, ropes[k], kw), f, parts.rms_norm(C, eps, **kw))
              for k, f in zip(kinds, ffns, strict=True)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


# --------------------------------------------------------------------------- weights
def _pad_heads(t: Tensor, heads: int, width: int, D: int, scale: float = 1.0) -> Tensor:
    """``t [heads * width, ...]`` -> ``[heads * D, ...]``, each head's rows times ``scale`` then
    zero-padded to ``D``."""
    rows = t.reshape(heads, width, *t.shape[1:]) * scale
    pad = rows.new_zeros(heads, D - width, *t.shape[1:])
    return torch.cat((rows, pad), dim=1).reshape(heads * D, *t.shape[1:])


def _qkv(t: Tensor, *, H: int, Hkv: int, qk: int, v: int, D: int, scale: float) -> Tensor:
    """The concatenated ``[q; k; v]`` rows (or biases) of transformers' projections -> attnzoo's
    ``qkv_proj`` rows of ``D``-wide heads, the value rows times ``scale``."""
    q, k, val = t.split((H * qk, Hkv * qk, Hkv * v))
    return torch.cat((_pad_heads(q, H, qk, D), _pad_heads(k, Hkv, qk, D), _pad_heads(val, Hkv, v, D, scale)))


def _out(w: Tensor, *, H: int, v: int, D: int) -> Tensor:
    """``o_proj.weight [C, H * v]`` -> ``[C, H * D]`` (zero columns for the padded channels)."""
    return _pad_heads(w.t(), H, v, D).t().contiguous()


def _put_attention(plan: Plan, hf: HFConfig, ours: str, theirs: str, attn: nn.Module) -> None:
    """One layer's attention at ``ours`` (``"blocks.3.attn."``) from ``theirs`` (``"layers.3.self_attn."``)."""
    qk, v, D = _widths(hf)
    H, Hkv = attn.num_heads, attn.num_kv_heads
    qkv = functools.partial(_qkv, H=H, Hkv=Hkv, qk=qk, v=v, D=D, scale=hf.req("attention_value_scale", float))
    plan.put_cat(f"{ours}qkv_proj.weight", [f"{theirs}{n}_proj.weight" for n in "qkv"], qkv)
    if attn.qkv_proj.bias is not None:
        plan.put_cat(f"{ours}qkv_proj.bias", [f"{theirs}{n}_proj.bias" for n in "qkv"], qkv)
    plan.put(f"{ours}out_proj.weight", f"{theirs}o_proj.weight", functools.partial(_out, H=H, v=v, D=D))
    if attn.out_proj.bias is not None:  # o_proj has none (modular 255)
        plan.put_tensor(f"{ours}out_proj.bias", torch.zeros(attn.out_proj.out_features), "zeros (no o_proj bias)")
    if attn.window is not None:  # a saved folder names them attention_sink_bias (the released checkpoints' name)
        name = "sinks" if plan.src.has(f"{theirs}sinks") else "attention_sink_bias"
        plan.put(f"{ours}frontier.sinks", f"{theirs}{name}")


def convert_mimo_v2_flash(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; the ``mtp`` layers dropped)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_mimo_v2_flash, device=device, dtype=dtype)
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        _put_attention(plan, hf, f"{o}attn.", f"{h}self_attn.", block.attn)
        if isinstance(block.ffn, MixtureOfExperts):
            put_moe(plan, f"{o}ffn.", f"{h}mlp.", "stacked")
            plan.put(f"{o}ffn.score_bias", f"{h}mlp.gate.e_score_correction_bias")
        else:
            parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    return parts.finish(plan, model, head_size, ignore=[r"(model\.)?mtp\..*"])


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "mimo_v2_flash": parts.Dispatch("MiMo-V2-Flash", convert_mimo_v2_flash,
                                    ("MiMoV2FlashForCausalLM", "MiMoV2FlashModel")),
}
