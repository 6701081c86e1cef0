"""Meta's Muse Glimmer text (``muse_glimmer_text``) -> :class:`~attnzoo.DecoderLM`: the language model of
``MuseGlimmerForConditionalGeneration`` (its vision tower and projector are out of scope; the wrapper row
``muse_glimmer`` of :mod:`attnzoo.models.hf.wrappers`) and ``MuseGlimmerTextModel``. Line numbers:
transformers 5.25's ``models/muse_glimmer/modeling_muse_glimmer.py`` (``configuration_muse_glimmer.py``
where it says so).

* The token embedding is normalised by a weightless RMSNorm (``MuseGlimmerTextNormedEmbedding``, 415-425;
  :class:`~attnzoo.models.families.minimax.NormedEmbedding` around
  :class:`~attnzoo.models.families.dense.WeightlessRMSNorm`).
* Every layer (350-395) has four norms, Gemma's ``(1 + w)`` applied in float32
  (``MuseGlimmerTextCenteredRMSNorm``, 109-126; loaded as ``w + 1``): before and after the attention
  and the MLP, the two after it with their own ``post_norm_eps`` (default 1e-8).
* Attention (262-347): GQA, biases by ``attention_bias``; weightless per-head RMSNorms on queries and
  keys *before* RoPE, the queries then times ``qk_scale_factor`` (the query norm's fixed weight), the
  scores times ``1 / sqrt(head_dim)``; a causal window of ``sliding_window - 1`` keys on the
  ``sliding_attention`` layers of ``layer_types`` (default: full on every 4th layer counted back from
  the last, sliding on the others; configuration 156-163); an element-wise sigmoid gate
  (``gate_proj``, ``H * D`` outputs) on the attention output before ``o_proj``
  (:class:`~attnzoo.nn.parts.OutputGate` ``"element"``).
* RoPE (``rope_parameters``, split halves) on the layers whose ``layer_rope_theta`` is not 0; the others
  have no positions (NoPE, 498-501; default: the full layers, configuration 167-172). transformers
  rotates every other layer with the one global theta whatever its entry says, where the config's
  docstring says the entry overrides it: an entry other than 0 and the global theta is refused.
* The SwiGLU MLP (``hidden_activation``), the final RMSNorm with a plain weight (in float32), and the
  wrapper's head: the logits times ``output_multiplier``, then capped ``T * tanh(x / T)`` with
  ``T = final_logit_softcapping`` (1161-1166); the multiplier is folded into the final norm's weight
  when the model has a head.

Saved folders: transformers writes the wrapper in its in-memory layout (``model.language_model.*``,
``lm_head``). A ``config.json`` that leaves out keys reads them as :data:`DEFAULTS`
(``MuseGlimmerTextConfig``'s).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.dense import WeightlessRMSNorm, weightless_qk_norms
from attnzoo.models.families.minimax import NormedEmbedding
from attnzoo.models.hf._state import HFConfig

__all__ = ["DEFAULTS", "DISPATCH", "build_muse_glimmer", "canonical", "convert_muse_glimmer", "rope_layers"]

TYPES = ("full_attention", "sliding_attention")
#: ``MuseGlimmerTextConfig``'s defaults of the keys read here (configuration 115-142)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048, "hidden_size": 6656, "intermediate_size": 19968, "num_hidden_layers": 52,
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "hidden_activation": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "attention_bias": False, "attention_dropout": 0.0, "sliding_window": 2048, "final_logit_softcapping": 20.0,
    "qk_scale_factor": 3.87, "output_multiplier": 0.19611613513818404, "post_norm_eps": 1e-8,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _every_fourth_from_last(depth: int) -> list[bool]:
    """The layers ``i`` with ``(depth - 1 - i) % 4 == 0``: full attention and NoPE by default."""
    return [(depth - 1 - i) % 4 == 0 for i in range(depth)]


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as ``MuseGlimmerTextConfig.__post_init__`` reads it (:data:`DEFAULTS` where absent; the
    default ``layer_types``), the options attnzoo cannot reproduce refused."""
    out = hf.with_defaults(DEFAULTS)
    depth = out.req("num_hidden_layers")
    if out.raw("layer_types") is None:
        out.data["layer_types"] = [TYPES[0] if full else TYPES[1] for full in _every_fourth_from_last(depth)]
    parts.layer_types(out, depth, TYPES)
    parts.unsupported_keys(out, {"pretraining_tp": lambda v: v in (None, 1)})
    return out


def rope_layers(hf: HFConfig) -> list[bool]:
    """Per layer: whether it rotates (its ``layer_rope_theta`` entry is not 0; default: all but every 4th
    layer counted back from the last). An entry other than 0 and the global ``rope_theta`` is refused
    (transformers rotates with the global theta there, its config's docstring says the entry's)."""
    depth = hf.req("num_hidden_layers")
    given = hf.get("layer_rope_theta", None, list)
    if given is None:
        return [not nope for nope in _every_fourth_from_last(depth)]
    theta = float(parts.rope_params(hf)["rope_theta"])
    if len(given) != depth or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t not in (0, theta)
                                  for t in given):
        raise hf.unsupported(f"layer_rope_theta={given!r} (supported: {depth} entries, each 0 (no RoPE) or the "
                             f"global rope_theta {theta:g}: transformers rotates every other layer with that one)")
    return [t != 0 for t in given]


def _attention(hf: HFConfig, kind: str, rotates: bool, kw: dict[str, Any]) -> functools.partial[nn.Module]:
    """A layer's attention: weightless QK norms (the queries' times ``qk_scale_factor``), the window of a
    sliding layer, RoPE (or none), the element-wise sigmoid gate."""
    D = parts.dims(hf)[3]
    rope = parts.rotary(hf, parts.rope_params(hf), D) if rotates else None
    make = parts.attention_factory(hf, window=parts.sliding_windows(hf, [kind])[0], rope=rope, qk_norm="head",
                                   output_gate="element", **kw)
    return functools.partial(weightless_qk_norms, make, hf.req("qk_scale_factor", float))


def _block(hf: HFConfig, kind: str, rotates: bool, kw: dict[str, Any]) -> nn.Module:
    """A layer: the four norms (the two after the sub-layers with ``post_norm_eps``), attention, MLP."""
    C, eps = hf.req("hidden_size"), hf.req("rms_norm_eps", float)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_activation", parts.GATED, "silu"),
                          **kw)
    block = parts.block(C, _attention(hf, kind, rotates, kw), ffn, parts.rms_norm(C, eps, **kw), sublayer_norm="both")
    block.attn_out_norm.eps = block.ffn_out_norm.eps = hf.req("post_norm_eps", float)
    return block


def build_muse_glimmer(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                       dtype: Any = None) -> DecoderLM:
    """The decoder of a ``MuseGlimmerTextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, V, eps = hf.req("hidden_size"), hf.req("vocab_size"), hf.req("rms_norm_eps", float)
    kw = {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, hf.req("num_hidden_layers"), TYPES)
    blocks = [_block(hf, kind, rotates, kw) for kind, rotates in zip(kinds, rope_layers(hf), strict=True)]
    model = parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps,
                          logit_softcap=hf.get("final_logit_softcapping", None, float),
                          embedding=NormedEmbedding(V, C, norm=WeightlessRMSNorm(C, eps), **kw), **kw)
    return parts.float32_scale_norms(model, keep_float32=True)


def convert_muse_glimmer(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; ``output_multiplier`` folded
    into the final norm of a model with an LM head)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_muse_glimmer, device=device, dtype=dtype)
    bias = hf.req("attention_bias", bool)
    for i in range(model.depth):
        ours, theirs = f"blocks.{i}.", f"layers.{i}."
        parts.put_attention(plan, f"{ours}attn", f"{theirs}self_attn.", bias=bias)
        plan.put(f"{ours}attn.frontier.gate_proj.weight", f"{theirs}self_attn.gate_proj.weight")
        parts.put_mlp(plan, f"{ours}ffn.", f"{theirs}mlp.")
        for o, t in parts.GEMMA_NORMS:
            plan.put(f"{ours}{o}.weight", f"{theirs}{t}.weight", parts.plus_one)
    multiplier = hf.req("output_multiplier", float) if head_size is None else 1.0
    return parts.finish(plan, model, head_size, norm_transform=lambda w: w.float() * multiplier)


DISPATCH = {"muse_glimmer_text": parts.Dispatch("Muse Glimmer", convert_muse_glimmer, ("MuseGlimmerTextModel",))}
