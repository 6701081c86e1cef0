"""GraniteMoe-SWA (``granitemoe_swa``) -> :class:`~attnzoo.DecoderLM`: ``GraniteMoeSWAForCausalLM``
and ``GraniteMoeSWAModel``.

IBM Granite's mixture-of-experts decoder with sliding-window layers. Each layer is pre-norm::

    h   = x + residual_multiplier * self_attn(input_layernorm(x))
    out = h + residual_multiplier * (block_sparse_moe(n) + shared_mlp(n)),  n = post_attention_layernorm(h)

* The attention is causal GQA whose scores are scaled by ``attention_multiplier`` (not
  ``head_dim ** -0.5``), with one learnable sink logit per query head (``sinks``: transformers'
  ``sigmoid(logsumexp(scores) - sink)`` rescaling of the output is the extra softmax
  denominator term ``exp(sink)`` of gpt-oss's sinks) on every layer. ``layer_types`` gives each
  layer ``"full_attention"`` or ``"sliding_attention"`` (``sliding_window`` keys including its
  own: a left window of ``sliding_window - 1``); absent, every fourth layer (``i % 4 == 0``) is
  full, the others sliding, as transformers defaults.
* Positions are per layer: ``layer_rope_theta[i]`` is the layer's RoPE base (the config's
  ``rope_parameters`` with that ``rope_theta``, on the whole head), ``0`` a NoPE layer; absent,
  every layer takes ``rope_parameters["rope_theta"]``. Sliding and full layers rotate alike.
* The feed-forward is Granite 4.0-H's (:mod:`attnzoo.models.families.granitemoehybrid`): a
  :class:`~attnzoo.nn.moe.MixtureOfExperts` (router ``router.weight``, the top ``k`` logits then
  a softmax over those ``k``, no renormalisation; SwiGLU experts ``gate_up_proj [E, 2F, C]``,
  rows ``[gate; up]``, ``down_proj [E, C, F]``) plus, when ``shared_intermediate_size > 0``, the
  always-on ``shared_mlp`` as its shared expert (``0``, the default: none).
* The token embeddings are multiplied by ``embedding_multiplier``; the logits are divided by
  ``logits_scaling``. ``residual_multiplier`` and ``1 / logits_scaling`` are folded into weights
  exactly as for Granite 4.0-H (:func:`~attnzoo.models.families.granitemoehybrid.finish_folded`:
  ``o_proj`` with its bias, the experts' and the shared MLP's down projections; the final norm
  of a ``*ForCausalLM``), so the converted model is the plain pre-norm block stack.

Refused by name: ``hidden_act`` other than SiLU, a non-positive ``attention_multiplier`` or
``embedding_multiplier``, a zero ``logits_scaling``, a ``partial_rotary_factor`` other than 1,
a negative ``layer_rope_theta`` entry, ``num_local_experts <= 0`` (transformers' layer always
routes), layer types other than the two, sliding layers without a ``sliding_window``. The
router's auxiliary loss (``output_router_logits``, ``router_aux_loss_coef``) is training-only and
not computed.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.granitemoehybrid import (
    CHECKS,
    embed_scale,
    experts_factory,
    finish_folded,
    multiplier,
    put_feed_forward,
    refuse_partial_rotary,
)
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.errors import CheckpointFormatError

__all__ = ["DEFAULTS", "DISPATCH", "build_granitemoe_swa", "convert_granitemoe_swa", "layer_thetas"]

#: transformers' ``GraniteMoeSWAConfig`` defaults of the keys read here that a ``config.json``
#: may leave out (``layer_types`` and ``layer_rope_theta`` are defaulted per layer, see the module
#: docstring; ``sliding_window`` only when the key is absent, not when it is ``null``)
DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "num_local_experts": 8, "num_experts_per_tok": 2,
                            "shared_intermediate_size": 0}

#: transformers' default ``sliding_window``
SLIDING_WINDOW = 128

KINDS = ("sliding_attention", "full_attention")


def _with_defaults(hf: HFConfig) -> HFConfig:
    """``hf`` with transformers' defaults where a ``config.json`` leaves a key out. Apply it once
    (the builder does): it drops a ``null`` ``sliding_window``, which a second pass would default."""
    depth = hf.req("num_hidden_layers")
    defaults = {**DEFAULTS, "layer_types": [("full_attention" if i % 4 == 0 else "sliding_attention") for i in range(depth)]}
    if "sliding_window" not in hf.data:
        defaults["sliding_window"] = SLIDING_WINDOW
    return hf.with_defaults(defaults)


def layer_thetas(hf: HFConfig, depth: int) -> list[float]:
    """Each layer's RoPE base (``0``: NoPE): ``layer_rope_theta``, else the config's ``rope_theta``."""
    thetas = hf.get("layer_rope_theta", None, list)
    if thetas is None:
        return [float(parts.rope_params(hf)["rope_theta"])] * depth
    if len(thetas) != depth:
        raise CheckpointFormatError(f"{hf.source}: layer_rope_theta has {len(thetas)} entries for {depth} layers")
    for theta in thetas:
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta < 0:
            raise hf.unsupported(f"layer_rope_theta entry {theta!r} (a RoPE base > 0, or 0 for NoPE)")
    return [float(t) for t in thetas]


def _refuse(hf: HFConfig) -> None:
    """The options attnzoo cannot reproduce, by name."""
    parts.unsupported_keys(hf, CHECKS)
    refuse_partial_rotary(hf)
    if hf.req("num_local_experts") <= 0:
        raise hf.unsupported(f"num_local_experts={hf.req('num_local_experts')} (the layer always routes to experts)")


def build_granitemoe_swa(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                         dtype: Any = None) -> DecoderLM:
    """The decoder of a ``GraniteMoeSWAConfig`` (random weights; see the module docstring; the
    multipliers folded at conversion are absorbed in whatever weights it is given)."""
    hf = _with_defaults(hf)
    _refuse(hf)
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds, thetas = parts.layer_types(hf, depth, KINDS), layer_thetas(hf, depth)
    params = parts.rope_params(hf)
    ropes = {t: parts.rotary(hf, {**params, "rope_theta": t}, hf.get("head_dim", C // H)) for t in set(thetas) if t}
    shared = hf.req("shared_intermediate_size")
    ffn = experts_factory(hf, parts.gated_mlp(C, shared, "swiglu", **kw) if shared > 0 else None, **kw)
    scale = multiplier(hf, "attention_multiplier")
    blocks = [parts.block(C, parts.attention_factory(hf, window=w, rope=ropes.get(t), sinks=True, scale=scale, **kw),
                          ffn, parts.rms_norm(C, eps, **kw))
              for w, t in zip(parts.sliding_windows(hf, kinds), thetas, strict=True)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=embed_scale(hf), **kw)


def convert_granitemoe_swa(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a GraniteMoeSWA decoder and copy the weights (the head follows them), folding
    ``residual_multiplier`` and ``logits_scaling`` in (see the module docstring)."""
    model, plan, head_size = parts.start(hf, sd, build_granitemoe_swa, device=device, dtype=dtype)
    bias = hf.get("attention_bias", False, bool)
    writes: list[str] = []  # the weights that write into the residual stream
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"layers.{i}."
        parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias, sinks=True)
        writes += [f"{o}attn.out_proj.weight", *([f"{o}attn.out_proj.bias"] if bias else [])]
        writes += put_feed_forward(plan, f"{o}ffn.", h, block.ffn)
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    return finish_folded(plan, model, hf, head_size, writes)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "granitemoe_swa": parts.Dispatch("GraniteMoe-SWA", convert_granitemoe_swa, ("GraniteMoeSWAForCausalLM", "GraniteMoeSWAModel")),
}
