"""Cohere Compass text (``cohere_compass_text``) -> :class:`~attnzoo.DecoderLM`: the language model of
``CohereCompassForConditionalGeneration`` (North) as ``CohereCompassForCausalLM`` and
``CohereCompassTextModel``. Line numbers: transformers 5.25's ``models/cohere_compass/modeling_cohere_compass.py``.

Cohere2's parallel layer ``x + attn(ln(x)) + mlp(ln(x))`` with one bias-free LayerNorm (165-178,
323-372; dense's :class:`~attnzoo.models.families.dense.ParallelBlock`), a bias-free final
LayerNorm, the logits times ``logit_scale`` (``None``: 1; 546, 590), with:

* ``layer_types`` (default: every layer full; configuration 122-123): a causal window of
  ``sliding_window - 1`` keys on the sliding layers (264).
* RoPE per layer kind, ``rope_parameters[layer_type]`` (``None``: that kind has no positions,
  502-508), on split halves of every head (``rotate_half``); transformers' rotary is the vision
  model's 3-D one (``mrope_section``, 121-147), which for text — the same position on its three
  axes — is the plain 1-D rotation. ``head_dim`` is always ``hidden_size / num_attention_heads``
  (configuration 125).
* q/k/v/o biases by ``attention_bias``; a SwiGLU MLP without biases.

Refused by name: a ``hidden_act`` without a gated attnzoo MLP, a layer kind without its entry in
``rope_parameters`` (transformers cannot build that model either), rope types attnzoo's rotary does
not know, ``layer_types`` entries other than ``"full_attention"`` / ``"sliding_attention"``. The
vision tower and DeepStack inputs are not part of the text model.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import BlockLayers
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.dense import ParallelBlock, parallel_decoder
from attnzoo.models.hf._state import HFConfig

__all__ = ["DEFAULTS", "DISPATCH", "build_cohere_compass_text", "canonical", "convert_cohere_compass_text"]

TYPES = ("full_attention", "sliding_attention")
#: ``CohereCompassTextConfig``'s defaults of the keys read here (configuration 96-121) that a
#: ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "max_position_embeddings": 8192, "layer_norm_eps": 1e-5, "tie_word_embeddings": True,
    "attention_bias": False, "attention_dropout": 0.0, "sliding_window": 4096}


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS`, ``logit_scale`` 1 when unset, every layer
    full without ``layer_types``, as many key/value heads as query heads without
    ``num_key_value_heads``, ``head_dim`` from the width), the options attnzoo cannot reproduce
    refused by name."""
    out = hf.with_defaults(DEFAULTS)
    C, H, depth = out.req("hidden_size"), out.req("num_attention_heads"), out.req("num_hidden_layers")
    out.data.setdefault("logit_scale", 1.0)
    out.data.setdefault("layer_types", [TYPES[0]] * depth)
    out.data.setdefault("num_key_value_heads", H)
    out.data["head_dim"] = C // H
    kinds = parts.layer_types(out, depth, TYPES)
    ropes = out.get("rope_parameters", {}, dict)
    for kind in sorted(set(kinds)):
        if kind not in ropes or (ropes[kind] is not None and not isinstance(ropes[kind], Mapping)):
            raise hf.unsupported(f"rope_parameters without an entry for {kind!r} layers (a dict or None)")
    out.activation("hidden_act", parts.GATED, "silu")
    return out


def _rope(hf: HFConfig, kind: str) -> nn.Module | None:
    """The rotary embedding of a layer kind, ``None`` where its ``rope_parameters`` entry is ``None``."""
    params = hf.req("rope_parameters", dict)[kind]
    return None if params is None else parts.rotary(hf, parts.rope_params(hf, kind), hf.req("head_dim"))


def build_cohere_compass_text(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                              dtype: Any = None) -> DecoderLM:
    """The decoder of a ``CohereCompassTextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, _, depth, _ = parts.dims(hf)
    eps, kw = hf.req("layer_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    ropes = {k: _rope(hf, k) for k in sorted(set(kinds))}
    norm = functools.partial(nn.LayerNorm, C, eps=eps, bias=False, **kw)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    blocks: list[nn.Module] = [
        ParallelBlock(C, BlockLayers(attention=parts.attention_factory(hf, window=w, rope=ropes[k], **kw),
                                     feed_forward=ffn, norm=norm))
        for k, w in zip(kinds, parts.sliding_windows(hf, kinds), strict=True)]
    return parallel_decoder(hf, blocks, norm, eps, head_size, kw)


def convert_cohere_compass_text(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    return parts.convert_layers(canonical(hf), sd, build_cohere_compass_text, device=device, dtype=dtype,
                                norms=[("attn_norm", "input_layernorm")])


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"cohere_compass_text": parts.Dispatch("Cohere Compass text", convert_cohere_compass_text,
                                                  ("CohereCompassForCausalLM", "CohereCompassTextModel"))}
