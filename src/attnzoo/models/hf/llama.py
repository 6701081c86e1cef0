"""LLaMA and Mistral (``LlamaForCausalLM``, ``MistralForCausalLM``) -> :class:`~attnzoo.DecoderLM`.

Checkpoints in Hugging Face layout already use split-half RoPE (the conversion script permuted
Meta's interleaved q/k rows), so q/k weights are copied as they are into attention with
``RotaryEmbedding(interleaved=False)``. Mistral's ``sliding_window=W`` (a query sees itself and
``W - 1`` keys before it) is ``SlidingWindowAttention(window=W - 1)``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype, load_qkv_into

__all__ = ["convert_llama", "llama_config", "rope_settings"]

GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}


def rope_settings(hf: HFConfig) -> dict[str, Any]:
    """``rope_base``, ``rope_scaling``, ``rope_scaling_factor`` of a LLaMA-family config: the
    ``default`` and ``linear`` (position interpolation) rope types, full rotary width."""
    params = dict(hf.get("rope_scaling", {}, dict))
    params.update(hf.get("rope_parameters", {}, dict))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    partial = params.get("partial_rotary_factor", hf.raw("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise hf.unsupported(f"partial_rotary_factor={partial}")
    base = float(params.get("rope_theta", hf.get("rope_theta", 10000.0, float)))
    if rope_type == "default":
        return {"rope_base": base}
    if rope_type == "linear":
        if not isinstance(params.get("factor"), (int, float)):
            raise hf.unsupported(f"rope_type='linear' without a numeric factor (got {params.get('factor')!r})")
        return {"rope_base": base, "rope_scaling": "linear", "rope_scaling_factor": float(params["factor"])}
    raise hf.unsupported(f"rope_type={rope_type!r} (supported: 'default', 'linear')")


def llama_config(hf: HFConfig, *, sliding: bool) -> DecoderConfig:
    """The :class:`DecoderConfig` of a LLaMA (``sliding=False``) or Mistral config."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    D = hf.get("head_dim", C // H)
    if hf.get("pretraining_tp", 1) != 1:
        raise hf.unsupported(f"pretraining_tp={hf.raw('pretraining_tp')}")
    window = hf.get("sliding_window", None) if sliding else None
    layer_types = hf.get("layer_types", None, list)
    if window is not None and layer_types and any(t != "sliding_attention" for t in layer_types):
        raise hf.unsupported("mixed full/sliding layer_types")
    akw: dict[str, Any] = {"bias": hf.get("attention_bias", False, bool)}
    if window is not None:
        akw["window"] = window - 1  # HF: q - k < W  ->  W - 1 keys before the query
    return DecoderConfig(
        hf.req("vocab_size"), C, hf.req("num_hidden_layers"), H, attention="sliding" if window is not None else "mha",
        attention_kwargs=akw, num_kv_heads=hf.get("num_key_value_heads", H),
        max_seq_len=hf.get("max_position_embeddings", 2048), pos="rope", norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-6, float), ffn=hf.activation("hidden_act", GATED_ACTIVATIONS, "silu"),
        ffn_hidden=hf.req("intermediate_size"), tie_embeddings=hf.get("tie_word_embeddings", False, bool),
        bias=hf.get("mlp_bias", False, bool), head_dim=D if D != C // H or C % H else None, **rope_settings(hf))


def convert_llama(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any, sliding: bool) -> DecoderLM:
    """Build the decoder and copy the weights (``model.`` prefix of the causal-LM class)."""
    cfg = llama_config(hf, sliding=sliding)
    model = DecoderLM.from_config(cfg, device=device, dtype=dtype or float_dtype(sd))
    attn_bias, mlp_bias = bool(cfg.attention_kwargs and cfg.attention_kwargs["bias"]), cfg.bias
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    plan = Plan(Source(sd, prefix), hf.arch)
    plan.put("tok_emb.weight", "embed_tokens.weight")
    for i in range(cfg.depth):
        h, o = f"layers.{i}.", f"blocks.{i}."
        load_qkv_into(plan, o + "attn", tuple(f"{h}self_attn.{n}_proj.weight" for n in "qkv"),
                      tuple(f"{h}self_attn.{n}_proj.bias" for n in "qkv") if attn_bias else None, attn_bias)
        plan.put_pairs(o, h, [("attn.out_proj", "self_attn.o_proj")], bias=attn_bias)
        plan.put_pairs(o, h, [(f"ffn.{n}", f"mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj")], bias=mlp_bias)
        plan.put_pairs(o, h, [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")], bias=False)
    plan.put("norm.weight", "norm.weight")
    ignore = [r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"(model\.)?rotary_emb\.inv_freq"]
    plan.head(cfg.tie_embeddings, ignore)
    plan.apply(model, ignore=ignore)
    return model
