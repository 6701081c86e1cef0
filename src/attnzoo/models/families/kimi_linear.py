"""Kimi Linear -> :class:`~attnzoo.DecoderLM`: ``KimiLinearForCausalLM`` and ``KimiLinearModel``.

``layer_types``: ``linear_attention`` (KDA) or ``full_attention`` (MLA); ``mlp_layer_types``:
``dense`` or ``sparse`` (MoE).

* Linear layers: :class:`~attnzoo.nn.kda.KimiDeltaAttention` (``linear_num_heads`` heads of
  ``linear_head_dim``, short convolutions of ``linear_conv_kernel_dim``, the per-channel decay
  from the low-rank forget gate, the low-rank sigmoid-gated RMSNorm). transformers' fused
  ``conv1d`` is split by rows into ``q_conv``, ``k_conv``, ``v_conv``; ``forget_gate.*`` holds
  the decay's ``f_a_proj``, ``f_b_proj``, ``A_log`` and ``dt_bias``; q and k are L2-normalised
  as ``x / sqrt(|x|^2 + 1e-6)`` (``qk_norm_eps``), as transformers and fla do.
* Full layers: :class:`~attnzoo.nn.mla.MultiHeadLatentAttention` without any rotary embedding
  (``rope=False``: Kimi Linear's MLA is NoPE; the ``qk_rope_head_dim`` channels of the key are
  still one slice of the latent projection, shared by the heads), softmax scale
  ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.
* Feed-forward: DeepSeek-V3's MoE (``"deepseek"`` layout of :mod:`._moe`: sigmoid scores, the
  ``e_score_correction_bias`` choosing the experts, ``routed_scaling_factor``, ungated shared
  experts) on the ``sparse`` layers, a dense SwiGLU on the ``dense`` ones.

Group-limited routing (``n_group``, ``topk_group``) as transformers routes. Refused by name: ``attention_bias``, an activation
other than SiLU, ``pretraining_tp != 1``.

In half precision (``from_hf(dtype=)``, later ``.to()`` / ``.half()`` / ``.bfloat16()``) the MoE
routers' weight and the KDA's ``dt_bias`` stay float32, as transformers keeps them
(``_keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight", "dt_bias"]``, modeling
944; ``A_log`` and the convolutions are not in it); ``score_bias`` is float32 always.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import moe_from_config, put_moe
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.kda import KimiDeltaAttention
from attnzoo.variants import build_attention

__all__ = ["DISPATCH", "KDA_FLOAT32", "TYPES", "build_kimi_linear", "convert_kimi_linear",
           "mlp_types", "put_kda", "put_mla", "saved_names"]

TYPES = ("linear_attention", "full_attention")
#: the KDA parameters transformers keeps in float32 in Kimi Linear (modeling 944)
KDA_FLOAT32 = ("dt_bias",)


def _kda(make: Callable[[], KimiDeltaAttention], groups: tuple[str, ...]) -> Callable[[], KimiDeltaAttention]:
    """The factory ``make`` with the KDA's ``groups`` kept in float32 (:meth:`KimiDeltaAttention.keep_in_float32`)."""
    return lambda: make().keep_in_float32(*groups)


def mlp_types(hf: HFConfig, depth: int) -> list[str]:
    """``mlp_layer_types`` (``dense``/``sparse`` per layer); absent: dense layers then sparse
    from ``first_k_dense_replace`` (1 by default, as transformers)."""
    types = hf.get("mlp_layer_types", None, list)
    if types is None:
        first = hf.get("first_k_dense_replace", 1)
        return ["dense" if i < first else "sparse" for i in range(depth)]
    if len(types) != depth or any(t not in ("dense", "sparse") for t in types):
        raise hf.unsupported(f"mlp_layer_types={types!r} (one of 'dense'/'sparse' per layer)")
    return list(types)


def build_kimi_linear(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                      dtype: Any = None) -> DecoderLM:
    """The decoder of a ``KimiLinearConfig`` (random weights; see the module docstring)."""
    parts.unsupported_keys(hf, {"hidden_act": lambda v: v in (None, "silu", "swish"),
                                "attention_bias": lambda v: not v, "pretraining_tp": lambda v: v in (None, 1)})
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    kinds, mlps = parts.layer_types(hf, depth, TYPES), mlp_types(hf, depth)
    linear = _kda(functools.partial(KimiDeltaAttention, C, hf.req("linear_num_heads"), head_dim=hf.req("linear_head_dim"),
                                    conv_size=hf.get("linear_conv_kernel_dim", 4), norm_eps=eps, qk_norm_eps=1e-6, **kw),
                  KDA_FLOAT32)
    full = functools.partial(build_attention, "mla", C, H, kv_lora_rank=hf.req("kv_lora_rank"),
                             qk_nope_head_dim=hf.req("qk_nope_head_dim"), qk_rope_head_dim=hf.req("qk_rope_head_dim"),
                             v_head_dim=hf.req("v_head_dim"), q_lora_rank=hf.get("q_lora_rank", None),
                             rope=False, dropout=hf.get("attention_dropout", 0.0, float), **kw)
    moe = functools.partial(moe_from_config, hf, "deepseek", keep_router_float32=True, **kw)
    dense, norm = parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", **kw), parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, linear if kinds[i] == "linear_attention" else full, moe if mlps[i] == "sparse" else dense,
                          norm) for i in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def put_kda(plan: Plan, ours: str, theirs: str, *, forget: Sequence[str] = ("f_a_proj", "f_b_proj"),
            output_gate: Sequence[str] = ("g_a_proj", "g_b_proj")) -> None:
    """A :class:`KimiDeltaAttention` from transformers' ``KimiLinearDeltaAttention`` (the
    projections ``forget`` under ``forget_gate.`` and ``output_gate`` keep their names; Ling's
    hybrids have full-rank ``f_proj`` / ``g_proj`` instead of the low-rank pairs)."""
    plan.put_pairs(ours, theirs, [(n, n) for n in ("q_proj", "k_proj", "v_proj", "b_proj", *output_gate,
                                                   "o_norm")] + [("out_proj", "o_proj")], bias=False)
    conv = f"{theirs}conv1d.weight"
    for j, n in enumerate("qkv"):
        plan.put(f"{ours}{n}_conv.weight", conv, lambda w, j=j: w.chunk(3, dim=0)[j].contiguous())
    gate = f"{theirs}forget_gate."
    plan.put_pairs(ours, gate, [(n, n) for n in forget], bias=False)
    plan.put(f"{ours}A_log", f"{gate}A_log", lambda w: w.reshape(-1))
    plan.put(f"{ours}dt_bias", f"{gate}dt_bias")


def put_mla(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """A :class:`MultiHeadLatentAttention` from transformers' ``KimiLinearAttention`` (with
    ``attention_bias``, DeepSeek's biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``)."""
    biased = [("kv_a_proj", "kv_a_proj_with_mqa"), ("out_proj", "o_proj")]
    pairs = [("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj")]
    if hf.get("q_lora_rank", None) is None:
        pairs.append(("q_proj", "q_proj"))
    else:
        biased.append(("q_a_proj", "q_a_proj"))
        pairs += [("q_a_norm", "q_a_layernorm"), ("q_b_proj", "q_b_proj")]
    plan.put_pairs(ours, theirs, pairs, bias=False)
    plan.put_pairs(ours, theirs, biased, bias=hf.get("attention_bias", False, bool))


_SAVED = ((re.compile(r"\.block_sparse_moe\."), ".mlp."), (re.compile(r"(\.experts\.\d+\.)w1\."), r"\1gate_proj."),
          (re.compile(r"(\.experts\.\d+\.)w3\."), r"\1up_proj."), (re.compile(r"(\.experts\.\d+\.)w2\."), r"\1down_proj."),
          (re.compile(r"\.self_attn\.(A_log|dt_bias|f_a_proj\.weight|f_b_proj\.weight)$"), r".self_attn.forget_gate.\1"))


def saved_names(sd: dict[str, Tensor], table: Sequence[tuple[re.Pattern[str], str]] = _SAVED) -> dict[str, Tensor]:
    """A saved folder's names -> the transformers module's: each ``(pattern, replacement)`` of
    ``table`` applied in order (Moonshot's by default: ``block_sparse_moe``, experts ``w1/w3/w2``,
    the forget gate's weights on the layer), then ``{q,k,v}_conv1d`` fused into ``conv1d``."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        for pattern, repl in table:
            key = pattern.sub(repl, key)
        out[key] = t
    return parts.fuse_qkv_convs(out, "self_attn")


def convert_kimi_linear(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; saved-folder names too)."""
    sd = saved_names(sd)
    model, plan, head_size = parts.start(hf, sd, build_kimi_linear, device=device, dtype=dtype)
    kinds, mlps = parts.layer_types(hf, model.depth, TYPES), mlp_types(hf, model.depth)
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if kinds[i] == "linear_attention":
            put_kda(plan, f"{o}attn.", f"{h}self_attn.")
        else:
            put_mla(plan, f"{o}attn.", f"{h}self_attn.", hf)
        if mlps[i] == "sparse":
            put_moe(plan, f"{o}ffn.", f"{h}mlp.", "deepseek")
        else:
            parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put_pairs(o, h, [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")], bias=False)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "kimi_linear": parts.Dispatch("Kimi Linear", convert_kimi_linear, ("KimiLinearForCausalLM", "KimiLinearModel")),
}
