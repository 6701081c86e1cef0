"""The sparse-MoE decoders of the LLaMA line -> :class:`~attnzoo.DecoderLM`: Mixtral
(``MixtralForCausalLM`` / ``MixtralModel``), Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5 (``glm4_moe``) and
MiniMax-M2. Line numbers are transformers 5.25's ``models/<family>/modeling_<family>.py``.

Every layer is LLaMA's pre-norm layer (RMSNorm, GQA with RoPE on the whole head, no residual
scaling) whose feed-forward is, on the *sparse* layers, a
:class:`~attnzoo.nn.moe.MixtureOfExperts` in transformers' stacked layout (router ``gate.weight [E,
C]``, experts ``gate_up_proj [E, 2F, C]`` with rows ``[gate; up]``, ``down_proj [E, C, F]``): a
softmax over every expert in float32, the top ``num_experts_per_tok``, renormalised to sum 1 when
``norm_topk_prob``, SwiGLU experts weighted by them. What each family adds:

* **Mixtral** (``mixtral``; modeling 47-130, 150-250): the top-k always renormalised (l. 94); the
  experts' hidden width is ``intermediate_size``; a causal window of ``sliding_window - 1`` keys on
  every layer when ``sliding_window`` is set (l. 322, 444). Saved folders in Mistral's names
  (``block_sparse_moe``, experts ``w1``/``w3``/``w2``) load too.
* **Qwen2-MoE** (``qwen2_moe``; modeling 209-360): q/k/v biases (``qkv_bias``, ``o_proj`` has none);
  a shared SwiGLU expert of ``shared_expert_intermediate_size`` gated by ``sigmoid(shared_expert_gate
  (x))`` added to every sparse layer (l. 331-350); the layer is sparse iff it is not in
  ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (l. 358-361), else a dense SwiGLU MLP
  of ``intermediate_size``; ``layer_types`` by default alternate sliding (even ``i`` below
  ``max_window_layers``) and full when ``use_sliding_window`` (configuration 107-116).
* **Qwen3-MoE** (``qwen3_moe``; modeling 122-320): Qwen3's per-head QK RMSNorm (l. 147-148), the
  experts of ``moe_intermediate_size``, the same sparse-layer rule, one window on every layer when
  ``use_sliding_window`` (configuration 106-107).
* **OLMoE** (``olmoe``; modeling 197-345): OLMo 2's QK RMSNorm over all the heads of a token
  (l. 222-240), experts of ``intermediate_size`` on every layer.
* **GLM-4.5 / 4.6 / 4.7** (``glm4_moe``; modeling 46-130, 180-410): q/k/v biases
  (``attention_bias``; ``o_proj`` none), per-head QK RMSNorm when ``use_qk_norm``, rotary on the first
  ``partial_rotary_factor`` (default 0.5) of each head (split-half pairs), dense SwiGLU layers below
  ``first_k_dense_replace``, then DeepSeek-V3's MoE (:func:`~attnzoo.models.families._moe.deepseek_moe`:
  sigmoid scores in float32, group-limited top-k of ``scores + e_score_correction_bias``,
  ``norm_topk_prob``, ``routed_scaling_factor``, ``n_shared_experts`` ungated shared experts). The
  checkpoints' multi-token-prediction layers (``layers.{j >= num_hidden_layers}``) are not part of
  the causal LM: dropped.
* **MiniMax-M2** (``minimax_m2``; modeling 46-127, 276-340): QK RMSNorm over all heads, rotary on the
  first ``rotary_dim`` channels (the released checkpoints' key; ``partial_rotary_factor`` otherwise),
  theta 5e6 by default; every layer a MoE of ``intermediate_size`` experts routed by the top-k of
  ``sigmoid(logits) + e_score_correction_bias`` (the buffer on the MoE block), weighted by the
  sigmoids renormalised to sum 1 (no epsilon, no scaling, no shared expert).

Refused by name: ``router_jitter_noise`` > 0 (Mixtral multiplies the MoE input by noise while
training, l. 124: not reproduced), OLMoE's ``clip_qkv`` (a clamp of q, k and v that attnzoo's
attention does not have), ``hidden_act`` other than SiLU in the experts.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import deepseek_moe, moe_from_config, put_moe
from attnzoo.models.families.kimi_linear import saved_names
from attnzoo.models.hf._state import HFConfig, Plan, load_qkv_into
from attnzoo.nn.moe import MixtureOfExperts, Routing

__all__ = ["VARIANTS", "Variant", "build_sparse_moe", "convert_sparse_moe", "sparse_layers", "window_of_layers"]


@dataclass(frozen=True)
class Variant:
    """What a family changes in the shared layer (see the module docstring)."""

    qk_norm: str | None = None  # "head" / "all", or None; "head_if_flag": per head when use_qk_norm
    qkv_bias: str | None = None  # the key whose value puts biases on q/k/v but none on o_proj
    routing: str = "softmax"  # "softmax" (stacked top-k), "deepseek" (GLM-4.5), "sigmoid" (MiniMax-M2)
    width: str = "moe_intermediate_size"  # the experts' hidden width key
    shared: bool = False  # Qwen2-MoE's sigmoid-gated shared expert
    renorm: bool = False  # the top-k always renormalised (Mixtral)


VARIANTS: dict[str, Variant] = {
    "mixtral": Variant(width="intermediate_size", renorm=True),
    "qwen2_moe": Variant(qkv_bias="qkv_bias", shared=True),
    "qwen3_moe": Variant(qk_norm="head"),
    "olmoe": Variant(qk_norm="all", width="intermediate_size"),
    "glm4_moe": Variant(qk_norm="head_if_flag", qkv_bias="attention_bias", routing="deepseek"),
    "minimax_m2": Variant(qk_norm="all", routing="sigmoid", width="intermediate_size"),
}
#: transformers' defaults of the keys read here, per family (a ``config.json`` may leave them out;
#: ``num_experts`` stands for ``num_local_experts`` too)
DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                "rope_theta": 1e6, "hidden_act": "silu"},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "num_key_value_heads": 16, "rms_norm_eps": 1e-6,
                  "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "qkv_bias": True,
                  "hidden_act": "silu"},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "use_sliding_window": False, "hidden_act": "silu"},
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8, "rms_norm_eps": 1e-5, "hidden_act": "silu"},
    "glm4_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                 "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "attention_bias": False, "use_qk_norm": False,
                 "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.0, "norm_topk_prob": True, "hidden_act": "silu"},
    "minimax_m2": {"num_experts": 256, "num_experts_per_tok": 8, "num_key_value_heads": 8, "head_dim": 128,
                   "rms_norm_eps": 1e-6, "rope_theta": 5e6, "hidden_act": "silu"},
}
#: a layer's key and its index (``model.layers.{i}.`` / ``layers.{i}.``)
_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")
#: Mistral's saved names of Mixtral's MoE (``block_sparse_moe``, experts ``w1/w3/w2``)
_SAVED = tuple((re.compile(p), r) for p, r in (
    (r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+\.)w1\.", r"\1gate_proj."),
    (r"(\.experts\.\d+\.)w3\.", r"\1up_proj."), (r"(\.experts\.\d+\.)w2\.", r"\1down_proj.")))


def sparse_layers(hf: HFConfig, depth: int) -> list[bool]:
    """Which layers have the MoE: all of them (Mixtral, OLMoE, MiniMax-M2), those from
    ``first_k_dense_replace`` on (GLM-4.5), or Qwen-MoE's rule (not in ``mlp_only_layers``,
    ``(i + 1) % decoder_sparse_step == 0``, ``num_experts > 0``)."""
    first = hf.get("first_k_dense_replace", 0)
    step = hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers", None, list) or [])
    if step < 1:
        raise hf.unsupported(f"decoder_sparse_step={step} (expected an int >= 1)")
    experts = hf.first(("num_experts", "num_local_experts"), 0) or 0
    return [experts > 0 and i >= first and i not in dense and (i + 1) % step == 0 for i in range(depth)]


def window_of_layers(hf: HFConfig, model_type: str, depth: int) -> list[int | None]:
    """Each layer's left window (``sliding_window - 1``) or ``None``, as each family's config
    post-processing decides it (see the module docstring)."""
    window = hf.get("sliding_window", None)
    if model_type in ("olmoe", "glm4_moe", "minimax_m2") or not window:
        return [None] * depth
    if model_type == "mixtral":
        return [window - 1] * depth
    if not hf.get("use_sliding_window", False, bool):
        return [None] * depth
    if model_type == "qwen3_moe":
        return [window - 1] * depth
    first = hf.get("max_window_layers", 28)
    kinds = hf.get("layer_types", None, list) or [
        "sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(depth)]
    kinds = parts.layer_types(hf.with_defaults({"layer_types": kinds}), depth,
                              ("sliding_attention", "full_attention"))
    return parts.sliding_windows(hf, kinds)


def _read(hf: HFConfig) -> tuple[HFConfig, str]:
    """``(hf with its family's defaults, model_type)``, the options it cannot reproduce refused."""
    model_type = str(hf.raw("model_type"))
    if model_type not in VARIANTS:
        raise ValueError(f"sparse_moe: model_type must be one of {list(VARIANTS)}, got {model_type!r}")
    defaults = dict(DEFAULTS[model_type])  # the expert count under either name (Qwen3-MoE saves num_local_experts)
    defaults["num_experts"] = hf.first(("num_experts", "num_local_experts", "n_routed_experts"),
                                       defaults["num_experts"])
    hf = hf.with_defaults(defaults)
    parts.unsupported_keys(hf, {"router_jitter_noise": lambda v: not v, "clip_qkv": lambda v: v is None,
                                "pretraining_tp": lambda v: v in (None, 1)})
    return hf, model_type


def _rotary(hf: HFConfig, head_dim: int) -> Any:
    """The rotary embedding, on the first ``rotary_dim`` channels of a head (MiniMax-M2's key) or
    ``partial_rotary_factor`` of them (GLM-4.5: 0.5 by default)."""
    params = parts.rope_params(hf)
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5 if hf.raw("model_type") ==
                                                         "glm4_moe" else 1.0, float))
    rot = hf.get("rotary_dim", int(head_dim * factor))
    return parts.rotary(hf, params, head_dim, rotary_dim=rot if rot != head_dim else None)


def _moe(hf: HFConfig, variant: Variant, kw: dict[str, Any]) -> Any:
    """The factory of a sparse layer's :class:`~attnzoo.nn.moe.MixtureOfExperts`."""
    if variant.routing == "deepseek":
        return functools.partial(deepseek_moe, hf, **kw)
    if variant.routing == "sigmoid":
        routing = Routing("sigmoid_topk", norm_topk_prob=True, norm_eps=0.0)
        return functools.partial(MixtureOfExperts, hf.req("hidden_size"), hf.req(variant.width), hf.req("num_experts"),
                                 hf.req("num_experts_per_tok"), routing=routing, **kw)
    view = hf.with_defaults({"moe_intermediate_size": hf.req(variant.width), "norm_topk_prob": variant.renorm,
                             "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0)
                             if variant.shared else 0})
    return functools.partial(moe_from_config, view, "stacked", **kw)


def _qk_norm(hf: HFConfig, variant: Variant) -> str | None:
    if variant.qk_norm == "head_if_flag":
        return "head" if hf.get("use_qk_norm", False, bool) else None
    return variant.qk_norm


def build_sparse_moe(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """The decoder of a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / GLM-4.5 / MiniMax-M2 config
    (random weights; the family is the config's ``model_type``; see the module docstring)."""
    hf, model_type = _read(hf)
    variant = VARIANTS[model_type]
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    attn_cfg = hf.with_defaults({"attention_bias": _qkv_bias(hf, variant)}) if variant.qkv_bias else hf
    rope = _rotary(hf, hf.get("head_dim", C // H))
    moe = _moe(hf, variant, kw)
    act = hf.activation("hidden_act", parts.GATED, "silu")
    dense = parts.gated_mlp(C, hf.req("intermediate_size"), act, **kw)
    attention = functools.partial(parts.attention_factory, attn_cfg, rope=rope, qk_norm=_qk_norm(hf, variant), **kw)
    blocks = [parts.block(C, attention(window=w), moe if sparse else dense, parts.rms_norm(C, eps, **kw))
              for w, sparse in zip(window_of_layers(hf, model_type, depth), sparse_layers(hf, depth), strict=True)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _qkv_bias(hf: HFConfig, variant: Variant) -> bool:
    """Qwen2-MoE's ``qkv_bias`` (default True), GLM-4.5's ``attention_bias``: biases on q, k and v,
    none on ``o_proj``."""
    return variant.qkv_bias is not None and hf.get(variant.qkv_bias, True, bool)


def _put_qkv_biased(plan: Plan, ours: str, theirs: str, dim: int) -> None:
    """Qwen2-MoE's / GLM-4.5's attention: q/k/v with biases, ``o_proj`` without (the module's output
    bias is 0)."""
    load_qkv_into(plan, ours, tuple(f"{theirs}{n}_proj.weight" for n in "qkv"),
                  tuple(f"{theirs}{n}_proj.bias" for n in "qkv"), True)
    plan.put(f"{ours}.out_proj.weight", f"{theirs}o_proj.weight")
    plan.put_tensor(f"{ours}.out_proj.bias", torch.zeros(dim), "zeros (the o_proj has no bias)")


def _put_ffn(plan: Plan, ours: str, theirs: str, variant: Variant, sparse: bool) -> None:
    if not sparse:
        parts.put_mlp(plan, ours, theirs)
    elif variant.routing == "deepseek":
        put_moe(plan, ours, theirs, "deepseek")
    else:
        put_moe(plan, ours, theirs, "stacked", shared=variant.shared, shared_gate=variant.shared)
        if variant.routing == "sigmoid":
            plan.put(f"{ours}score_bias", f"{theirs}e_score_correction_bias")


def convert_sparse_moe(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; Mistral's saved MoE names
    too; GLM-4.5's multi-token-prediction layers dropped)."""
    hf, model_type = _read(hf)
    variant = VARIANTS[model_type]
    sd = saved_names(sd, _SAVED)
    model, plan, head_size = parts.start(hf, sd, build_sparse_moe, device=device, dtype=dtype)
    qk_norm = _qk_norm(hf, variant) is not None
    for i, sparse in enumerate(sparse_layers(hf, model.depth)):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if _qkv_bias(hf, variant):
            _put_qkv_biased(plan, f"{o}attn", f"{h}self_attn.", hf.req("hidden_size"))
            if qk_norm:
                for n in ("q_norm", "k_norm"):
                    plan.put(f"{o}attn.frontier.{n}_weight", f"{h}self_attn.{n}.weight")
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.get("attention_bias", False, bool),
                                qk_norm=qk_norm)
        _put_ffn(plan, f"{o}ffn.", f"{h}mlp.", variant, sparse)
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    extra = {int(m.group(1)) for k in sd if (m := _LAYER.match(k)) and int(m.group(1)) >= model.depth}
    return parts.finish(plan, model, head_size, ignore=[rf"(model\.)?layers\.{j}\..*" for j in sorted(extra)])
