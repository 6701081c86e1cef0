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
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._common import (
    GATED,
    attention_factory,
    block,
    decoder,
    gated_mlp,
    head_size_of,
    layer_types,
    plan_for,
    plus_one,
    put_attention,
    put_head,
    put_mlp,
    rms_norm,
    rope_params,
    rotary,
    sliding_windows,
    unsupported_keys,
)
from attnzoo.models.hf._state import HFConfig, float_dtype

__all__ = ["build_gemma3", "convert_gemma3"]

TYPES = ("sliding_attention", "full_attention")
NORMS = [("attn_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
         ("ffn_norm", "pre_feedforward_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm")]


def build_gemma3(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Gemma3TextConfig`` (random weights; see the module docstring)."""
    unsupported_keys(hf, {"use_bidirectional_attention": lambda v: not v, "pretraining_tp": lambda v: v in (None, 1)})
    if hf.has("attn_logit_softcapping"):  # transformers' Gemma3 attention never applies it
        raise hf.unsupported(f"attn_logit_softcapping={hf.raw('attn_logit_softcapping')} (transformers' Gemma3 "
                             f"does not apply it, so no conversion can equal it)")
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    D, eps = hf.get("head_dim", C // H), hf.get("rms_norm_eps", 1e-6, float)
    kinds = layer_types(hf, depth, TYPES)
    ropes = {t: rotary(hf, rope_params(hf, t), D) for t in set(kinds)}
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    ffn = gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_activation", GATED, "gelu_pytorch_tanh"),
                    **kw)
    scale = hf.get("query_pre_attn_scalar", D, float) ** -0.5
    blocks = [block(C, attention_factory(hf, window=w, rope=ropes[k], qk_norm="head", scale=scale, **kw), ffn,
                    rms_norm(C, eps, **kw), sublayer_norm="both")
              for k, w in zip(kinds, sliding_windows(hf, kinds), strict=True)]
    return decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=C ** 0.5,
                   logit_softcap=hf.get("final_logit_softcapping", None, float), **kw)


def convert_gemma3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them, as for LLaMA)."""
    prefix, head_size = head_size_of(hf, sd)
    model = build_gemma3(hf, head_size=head_size, device=device, dtype=dtype or float_dtype(sd))
    plan = plan_for(sd, prefix, hf.arch)
    plan.put("tok_emb.weight", "embed_tokens.weight")
    bias = hf.get("attention_bias", False, bool)
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias, qk_norm=True, norm_transform=plus_one)
        put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        for ours, theirs in NORMS:
            plan.put(f"{o}{ours}.weight", f"{h}{theirs}.weight", plus_one)
    plan.put("norm.weight", "norm.weight", plus_one)
    ignore = [r"(model\.)?rotary_emb\w*\.\w+", r"(model\.)?embed_tokens\.embed_scale"]
    put_head(plan, head_size, model.tie_embeddings, ignore)
    plan.apply(model, ignore=ignore)
    return model
