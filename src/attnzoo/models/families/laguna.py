"""Poolside Laguna (``laguna``) -> :class:`~attnzoo.DecoderLM`: ``LagunaForCausalLM`` and
``LagunaModel``. Line numbers: transformers 5.25's ``models/laguna/modular_laguna.py``.

LLaMA's pre-norm layer (RMSNorm; 372-382) with:

* AFMoE's attention (327-370): per-head QK RMSNorm before RoPE (349-350), biases on q/k/v/o by
  ``attention_bias`` (335-336 and AFMoE's), scores scaled by ``head_dim ** -0.5``; a causal window
  of ``sliding_window - 1`` keys on the ``sliding_attention`` layers of ``layer_types`` (default:
  every layer full; 126-127); each layer's own head count ``num_attention_heads_per_layer[i]``
  (130-131, 374); and a *softplus* output gate before ``o_proj``, ``out * softplus(g_proj(x))``
  computed in float32, one per head (``gating`` ``True`` / ``"per-head"``) or per channel
  (any other value: ``"per-element"``, and ``False`` too; 337-340, 360-368: :class:`SoftplusGate`).
* RoPE per layer kind, ``rope_parameters["full_attention"]`` / ``["sliding_attention"]`` (thetas
  5e5 / 1e4, ``partial_rotary_factor`` 0.5 / 1.0 by default; 133-139), on the first
  ``int(head_dim * partial_rotary_factor)`` channels in split-half pairs (182-206), every layer.
* The feed-forward by ``mlp_layer_types`` (default: the first dense, the rest sparse; 128-129): a
  SwiGLU MLP of ``intermediate_size``, or a MoE (276-310) of ``num_experts`` SwiGLU experts of
  ``moe_intermediate_size`` routed by the top ``num_experts_per_tok`` of ``sigmoid(logits) +
  e_score_correction_bias`` (float32), weighted by the sigmoids renormalised to sum 1 (no epsilon)
  times ``moe_routed_scaling_factor``, plus an always-on SwiGLU shared expert of
  ``shared_expert_intermediate_size`` (no gate). Saved folders (one tensor per expert,
  ``experts.e_score_correction_bias``, ``shared_expert``) load too.

Refused by name: ``moe_router_logit_softcapping`` > 0 (a tanh cap of the router logits, 249-250),
``moe_apply_router_weight_on_input`` (transformers refuses it too), ``gating`` values other than
``True`` / ``False`` / ``"per-head"`` / ``"per-element"``, a ``partial_rotary_factor`` giving an odd rotated width, ``hidden_act`` other
than SiLU. In half precision transformers computes the router logits in the model's dtype,
attnzoo in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import FeedForward
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import put_per_expert, put_stacked_experts
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.parts import OutputGate

__all__ = ["DEFAULTS", "DISPATCH", "SoftplusGate", "build_laguna", "convert_laguna", "rope_of_kind"]

TYPES = ("full_attention", "sliding_attention")
#: ``LagunaConfig``'s defaults of the keys read here (configuration 93-117, 133-136; the rest from
#: ``Qwen2MoeConfig``) that a ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "sliding_window": 512, "head_dim": 128, "attention_bias": False,
    "gating": True, "moe_routed_scaling_factor": 1.0, "moe_apply_router_weight_on_input": False,
    "moe_router_logit_softcapping": 0.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 1.0}}}
#: ``gating`` -> the gate's granularity
GATING = {True: "head", "per-head": "head", "per-element": "element", False: "element"}


class SoftplusGate(OutputGate):
    """Laguna's output gate: ``out * softplus(g_proj(x))``, the softplus in (at least) float32
    (modular 360-368); one gate per head (``mode="head"``) or per channel (``"element"``).

    Shapes: ``out [B, H, N, D]``, ``x [B, N, C]`` -> ``[B, H, N, D]``."""

    def gate(self, out: Tensor, x: Tensor) -> Tensor:
        B, H, N, D = out.shape
        if self.num_heads != H or (self.mode != "head" and self.head_dim != D):
            raise ValueError(f"SoftplusGate: out must be [B, {self.num_heads}, N, {self.head_dim}], got {tuple(out.shape)}")
        g = self(x)  # [B, N, H] or [B, N, H*D]
        g = F.softplus(g.to(torch.promote_types(g.dtype, torch.float32))).to(out.dtype)
        return out * g.view(B, N, H, 1 if self.mode == "head" else D).transpose(1, 2)


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS`, the default ``layer_types`` /
    ``mlp_layer_types`` / ``num_attention_heads_per_layer``; configuration 125-131), the options
    attnzoo cannot reproduce refused by name."""
    out = hf.with_defaults(DEFAULTS)
    depth, H = out.req("num_hidden_layers"), out.req("num_attention_heads")
    for key, value in (("layer_types", [TYPES[0]] * depth), ("mlp_layer_types", ["dense"] + ["sparse"] * (depth - 1)),
                       ("num_attention_heads_per_layer", [H] * depth)):
        if out.raw(key) is None:
            out.data[key] = value
        elif not isinstance(out.raw(key), list) or len(out.raw(key)) != depth:
            raise hf.unsupported(f"{key}={out.raw(key)!r} (supported: a list of {depth} entries)")
    parts.unsupported_keys(out, {
        "hidden_act": lambda v: v in ("silu", "swish"), "moe_router_logit_softcapping": lambda v: not v,
        "moe_apply_router_weight_on_input": lambda v: not v, "pretraining_tp": lambda v: v in (None, 1),
        "gating": lambda v: any(v == g and type(v) is type(g) for g in GATING)})
    if any(t not in ("dense", "sparse") for t in out.raw("mlp_layer_types")):
        raise hf.unsupported(f"mlp_layer_types={out.raw('mlp_layer_types')!r} (supported entries: 'dense', 'sparse')")
    return out


def rope_of_kind(hf: HFConfig, kind: str) -> nn.Module:
    """The rotary embedding of one layer kind (its ``rope_parameters[kind]``), partial by its factor
    (the first ``int(head_dim * partial_rotary_factor)`` channels, even, at least 2)."""
    params = parts.rope_params(hf, kind)
    D = hf.req("head_dim")
    factor = params.get("partial_rotary_factor", 1.0)
    rotary = int(D * factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else -1
    if rotary < 2 or rotary % 2 or rotary > D:
        raise hf.unsupported(f"partial_rotary_factor={factor!r} for {kind}: {rotary} rotated channels of {D} "
                             f"(supported: an even number from 2 to head_dim)")
    return parts.rotary(hf, params, D, rotary_dim=rotary if rotary != D else None)


def _make_attention(make: Callable[[], nn.Module], dim: int, heads: int, head_dim: int, mode: str) -> nn.Module:
    """``make()`` with its output gate replaced by a :class:`SoftplusGate` of the same shape."""
    module = make()
    gate = module.frontier.gate_proj
    module.frontier.gate_proj = SoftplusGate(dim, heads, head_dim, mode).to(device=gate.weight.device,
                                                                           dtype=gate.weight.dtype)
    return module


def _attention(hf: HFConfig, i: int, kind: str, rope: nn.Module, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """Layer ``i``'s attention: its own head count, QK norm, a window on a sliding layer, the gate."""
    H = hf.req("num_attention_heads_per_layer", list)[i]
    view = HFConfig({**hf.data, "num_attention_heads": H}, hf.source, hf.arch)
    window = hf.req("sliding_window") - 1 if kind == "sliding_attention" else None
    mode = GATING[hf.raw("gating")]
    make = parts.attention_factory(view, window=window, rope=rope, qk_norm="head", output_gate=mode, **kw)
    return functools.partial(_make_attention, make, hf.req("hidden_size"), H, hf.req("head_dim"), mode)


def _moe(hf: HFConfig, *, device: Any = None, dtype: Any = None) -> MixtureOfExperts:
    """A sparse layer's :class:`MixtureOfExperts` (module docstring)."""
    C, kw = hf.req("hidden_size"), {"device": device, "dtype": dtype}
    routing = Routing("sigmoid_topk", norm_topk_prob=True, norm_eps=0.0,
                      scaling=hf.req("moe_routed_scaling_factor", float))
    shared = FeedForward(C, hf.req("shared_expert_intermediate_size"), "swiglu", bias=False, **kw)
    return MixtureOfExperts(C, hf.req("moe_intermediate_size"), hf.req("num_experts"), hf.req("num_experts_per_tok"),
                            routing=routing, shared_expert=shared, **kw)


def build_laguna(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``LagunaConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, depth = hf.req("hidden_size"), hf.req("num_hidden_layers")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    ropes = {k: rope_of_kind(hf, k) for k in set(kinds)}
    ffns = {"dense": parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", **kw),
            "sparse": functools.partial(_moe, hf, **kw)}
    blocks = [parts.block(C, _attention(hf, i, k, ropes[k], kw), ffns[t], parts.rms_norm(C, eps, **kw))
              for i, (k, t) in enumerate(zip(kinds, hf.req("mlp_layer_types", list), strict=True))]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


# --------------------------------------------------------------------------- weights
def _first(plan: Plan, names: tuple[str, ...]) -> str:
    return next((n for n in names if plan.src.has(n)), names[0])


def _put_moe(plan: Plan, ours: str, theirs: str) -> None:
    """A sparse layer's router, choice bias, experts (stacked, or one tensor per expert) and shared expert."""
    plan.put(f"{ours}router.weight", f"{theirs}gate.weight")
    plan.put(f"{ours}score_bias", _first(plan, (f"{theirs}gate.e_score_correction_bias",
                                                f"{theirs}experts.e_score_correction_bias")))
    if plan.src.has(f"{theirs}experts.0.gate_proj.weight"):
        put_per_expert(plan, ours, theirs)
    else:
        put_stacked_experts(plan, ours, theirs)
    shared = "shared_experts" if plan.src.has(f"{theirs}shared_experts.down_proj.weight") else "shared_expert"
    parts.put_mlp(plan, f"{ours}shared_expert.", f"{theirs}{shared}.")


def convert_laguna(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_laguna, device=device, dtype=dtype)
    bias = hf.get("attention_bias", False, bool)
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias, qk_norm=True)
        plan.put(f"{o}attn.frontier.gate_proj.weight", f"{h}self_attn.g_proj.weight")
        if isinstance(block.ffn, MixtureOfExperts):
            _put_moe(plan, f"{o}ffn.", f"{h}mlp.")
        else:
            parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"laguna": parts.Dispatch("Laguna", convert_laguna, ("LagunaForCausalLM", "LagunaModel"))}
