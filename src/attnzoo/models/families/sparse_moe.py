"""The sparse-MoE decoders of the LLaMA line -> :class:`~attnzoo.DecoderLM`: Mixtral
(``MixtralForCausalLM`` / ``MixtralModel``), Qwen2-MoE, Qwen3-MoE and OLMoE. Line numbers are
transformers 5.25's ``models/<family>/modeling_<family>.py``.

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

Refused by name: ``router_jitter_noise`` > 0 (Mixtral multiplies the MoE input by noise while
training, l. 124: not reproduced), OLMoE's ``clip_qkv`` (a clamp of q, k and v that attnzoo's
attention does not have), ``hidden_act`` other than SiLU in the experts.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import moe_from_config, put_moe
from attnzoo.models.families.kimi_linear import saved_names
from attnzoo.models.hf._state import HFConfig, Plan, load_qkv_into

__all__ = ["FAMILY_OPTIONS", "build_sparse_moe", "convert_sparse_moe", "sparse_layers", "window_of_layers"]

#: ``model_type`` -> (QK norm, q/k/v-only biases, a shared expert, the experts' width key, always renormalised)
FAMILY_OPTIONS: dict[str, tuple[str | None, bool, bool, str, bool]] = {
    "mixtral": (None, False, False, "intermediate_size", True),
    "qwen2_moe": (None, True, True, "moe_intermediate_size", False),
    "qwen3_moe": ("head", False, False, "moe_intermediate_size", False),
    "olmoe": ("all", False, False, "intermediate_size", False),
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
}
#: Mistral's saved names of Mixtral's MoE (``block_sparse_moe``, experts ``w1/w3/w2``)
_SAVED = tuple((re.compile(p), r) for p, r in (
    (r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+\.)w1\.", r"\1gate_proj."),
    (r"(\.experts\.\d+\.)w3\.", r"\1up_proj."), (r"(\.experts\.\d+\.)w2\.", r"\1down_proj.")))


def sparse_layers(hf: HFConfig, depth: int) -> list[bool]:
    """Which layers have the MoE: all of them (Mixtral, OLMoE), or Qwen-MoE's rule (not in
    ``mlp_only_layers``, ``(i + 1) % decoder_sparse_step == 0``, ``num_experts > 0``)."""
    step = hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers", None, list) or [])
    if step < 1:
        raise hf.unsupported(f"decoder_sparse_step={step} (expected an int >= 1)")
    experts = hf.first(("num_experts", "num_local_experts"), 0) or 0
    return [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(depth)]


def window_of_layers(hf: HFConfig, model_type: str, depth: int) -> list[int | None]:
    """Each layer's left window (``sliding_window - 1``) or ``None``, as each family's config
    post-processing decides it (see the module docstring)."""
    window = hf.get("sliding_window", None)
    if model_type == "olmoe" or not window:
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
    if model_type not in FAMILY_OPTIONS:
        raise ValueError(f"sparse_moe: model_type must be one of {list(FAMILY_OPTIONS)}, got {model_type!r}")
    defaults = dict(DEFAULTS[model_type])  # the expert count under either name (Qwen3-MoE saves num_local_experts)
    defaults["num_experts"] = hf.first(("num_experts", "num_local_experts"), defaults["num_experts"])
    hf = hf.with_defaults(defaults)
    parts.unsupported_keys(hf, {"router_jitter_noise": lambda v: not v, "clip_qkv": lambda v: v is None,
                                "pretraining_tp": lambda v: v in (None, 1)})
    return hf, model_type


def build_sparse_moe(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None) -> DecoderLM:
    """The decoder of a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE config (random weights; the family
    is the config's ``model_type``; see the module docstring)."""
    hf, model_type = _read(hf)
    qk_norm, qkv_bias, shared, width_key, renorm = FAMILY_OPTIONS[model_type]
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    view = hf.with_defaults({"moe_intermediate_size": hf.req(width_key), "norm_topk_prob": renorm,
                             "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0)
                             if shared else 0})
    attn_cfg = hf.with_defaults({"attention_bias": _qkv_bias(hf)}) if qkv_bias else hf
    rope = parts.rotary(hf, parts.rope_params(hf), hf.get("head_dim", C // H))
    moe = functools.partial(moe_from_config, view, "stacked", **kw)
    act = hf.activation("hidden_act", parts.GATED, "silu")
    dense = parts.gated_mlp(C, hf.req("intermediate_size"), act, **kw)
    blocks = [parts.block(C, parts.attention_factory(attn_cfg, window=w, rope=rope, qk_norm=qk_norm, **kw),
                          moe if sparse else dense, parts.rms_norm(C, eps, **kw))
              for w, sparse in zip(window_of_layers(hf, model_type, depth), sparse_layers(hf, depth), strict=True)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _qkv_bias(hf: HFConfig) -> bool:
    """Qwen2-MoE's ``qkv_bias`` (default True): biases on q, k and v, none on ``o_proj``."""
    return hf.get("qkv_bias", True, bool)


def _put_qkv_biased(plan: Plan, ours: str, theirs: str, dim: int) -> None:
    """Qwen2-MoE's attention: q/k/v with biases, ``o_proj`` without (the module's output bias is 0)."""
    load_qkv_into(plan, ours, tuple(f"{theirs}{n}_proj.weight" for n in "qkv"),
                  tuple(f"{theirs}{n}_proj.bias" for n in "qkv"), True)
    plan.put(f"{ours}.out_proj.weight", f"{theirs}o_proj.weight")
    plan.put_tensor(f"{ours}.out_proj.bias", torch.zeros(dim), "zeros (Qwen2-MoE's o_proj has no bias)")


def convert_sparse_moe(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; Mistral's saved MoE names
    too)."""
    hf, model_type = _read(hf)
    qk_norm, qkv_bias, shared, _, _ = FAMILY_OPTIONS[model_type]
    sd = saved_names(sd, _SAVED)
    model, plan, head_size = parts.start(hf, sd, build_sparse_moe, device=device, dtype=dtype)
    for i, sparse in enumerate(sparse_layers(hf, model.depth)):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if qkv_bias and _qkv_bias(hf):
            _put_qkv_biased(plan, f"{o}attn", f"{h}self_attn.", hf.req("hidden_size"))
        else:
            parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.get("attention_bias", False, bool),
                                qk_norm=qk_norm is not None)
        if sparse:
            put_moe(plan, f"{o}ffn.", f"{h}mlp.", "stacked", shared=shared, shared_gate=shared)
        else:
            parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    return parts.finish(plan, model, head_size)
