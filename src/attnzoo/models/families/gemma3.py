"""Gemma 3 (text) -> :class:`~attnzoo.DecoderLM`: ``Gemma3ForCausalLM`` and ``Gemma3TextModel``
(``model_type="gemma3_text"``).

Per layer (``layer_types``, by default 5 ``sliding_attention`` : 1 ``full_attention``): a
:class:`~attnzoo.MultiHeadAttention` with per-head QK RMSNorm, scale
``query_pre_attn_scalar ** -0.5``, a causal window of
``sliding_window - 1`` keys on sliding layers, and its own rotary embedding: the sliding
layers' ``rope_parameters["sliding_attention"]`` (base ``rope_local_base_freq``, 10k), the full
layers' ``rope_parameters["full_attention"]`` (1M, possibly scaled). Norms on both sides of
both sub-layers, Gemma's ``1 + weight`` RMSNorms (loaded as ``weight + 1``), embeddings times
``sqrt(hidden_size)``, tanh-GeGLU, the optional final-logit softcap. ``attn_logit_softcapping`` is refused: transformers'
Gemma3 attention does not apply it (5.24), so no conversion could equal it.
Half precision: the ``1 + weight`` norms scale in float32, their weight kept in float32
(``modeling_gemma3.py`` 128-133, :class:`~attnzoo.models.families._common.Float32ScaleRMSNorm`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig

__all__ = ["DISPATCH", "build_gemma3", "convert_gemma3"]

TYPES = ("sliding_attention", "full_attention")
NORMS = parts.GEMMA_NORMS


def build_gemma3(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Gemma3TextConfig`` (random weights; see the module docstring)."""
    parts.unsupported_keys(hf, {"use_bidirectional_attention": lambda v: not v, "pretraining_tp": lambda v: v in (None, 1)})
    if hf.has("attn_logit_softcapping"):  # transformers' Gemma3 attention never applies it
        raise hf.unsupported(f"attn_logit_softcapping={hf.raw('attn_logit_softcapping')} (transformers' Gemma3 "
                             f"does not apply it, so no conversion can equal it)")
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    D, eps = hf.get("head_dim", C // H), hf.get("rms_norm_eps", 1e-6, float)
    kinds = parts.layer_types(hf, depth, TYPES)
    ropes = {t: parts.rotary(hf, parts.rope_params(hf, t), D) for t in set(kinds)}
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_activation", parts.GATED, "gelu_pytorch_tanh"),
                    **kw)
    scale = hf.get("query_pre_attn_scalar", D, float) ** -0.5
    blocks = [parts.block(C, parts.attention_factory(hf, window=w, rope=ropes[k], qk_norm="head", scale=scale, **kw), ffn,
                    parts.rms_norm(C, eps, **kw), sublayer_norm="both")
              for k, w in zip(kinds, parts.sliding_windows(hf, kinds), strict=True)]
    return parts.float32_scale_norms(parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=C ** 0.5,
                   logit_softcap=hf.get("final_logit_softcapping", None, float), **kw), keep_float32=True)


def convert_gemma3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them, as for LLaMA)."""
    model, plan, head_size = parts.start(hf, sd, build_gemma3, device=device, dtype=dtype)
    bias = hf.get("attention_bias", False, bool)
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias, qk_norm=True, norm_transform=parts.plus_one)
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        for ours, theirs in NORMS:
            plan.put(f"{o}{ours}.weight", f"{h}{theirs}.weight", parts.plus_one)
    return parts.finish(plan, model, head_size, norm_transform=parts.plus_one,
                        ignore=[r"(model\.)?embed_tokens\.embed_scale"])


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"gemma3_text": parts.Dispatch("Gemma3", convert_gemma3, ("Gemma3ForCausalLM", "Gemma3TextModel"))}
