"""OLMo 3 -> :class:`~attnzoo.DecoderLM`: ``Olmo3ForCausalLM`` and ``Olmo3Model``.

OLMo 2's layer (QK RMSNorm over all heads of a token, applied to the projections before RoPE;
RMSNorms on the sub-layer *outputs*, none on their inputs) with ``layer_types``: by default three
``sliding_attention`` layers (``sliding_window - 1`` keys back) per ``full_attention`` layer,
each kind with its own rotary embedding (``rope_parameters[layer_type]``).
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

__all__ = ["build_olmo3", "convert_olmo3"]


def build_olmo3(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of an ``Olmo3Config`` (random weights; see the module docstring)."""
    unsupported_keys(hf, {"pretraining_tp": lambda v: v in (None, 1)})
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    kinds = layer_types(hf, depth, ("sliding_attention", "full_attention"))
    ropes = {t: rotary(hf, rope_params(hf, t), hf.get("head_dim", C // H)) for t in set(kinds)}
    ffn = gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", GATED, "silu"), **kw)
    blocks = [block(C, attention_factory(hf, window=w, rope=ropes[k], qk_norm="all", **kw), ffn,
                    rms_norm(C, eps, **kw), sublayer_norm="output")
              for k, w in zip(kinds, sliding_windows(hf, kinds), strict=True)]
    return decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def convert_olmo3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    prefix, head_size = head_size_of(hf, sd)
    model = build_olmo3(hf, head_size=head_size, device=device, dtype=dtype or float_dtype(sd))
    plan = plan_for(sd, prefix, hf.arch)
    plan.put("tok_emb.weight", "embed_tokens.weight")
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=hf.get("attention_bias", False, bool), qk_norm=True)
        put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put_pairs(o, h, [("attn_out_norm", "post_attention_layernorm"),
                              ("ffn_out_norm", "post_feedforward_layernorm")], bias=False)
    plan.put("norm.weight", "norm.weight")
    ignore = [r"(model\.)?rotary_emb\.\w+"]
    put_head(plan, head_size, model.tie_embeddings, ignore)
    plan.apply(model, ignore=ignore)
    return model
