"""DeepSeek-V3 with all-dense layers (``DeepseekV3ForCausalLM``) -> :class:`~attnzoo.DecoderLM`
with multi-head latent attention (``attention="mla"``).

Only models whose every layer has a dense MLP convert (``first_k_dense_replace >=
num_hidden_layers``): attnzoo has no mixture-of-experts layer. The attention weights keep
transformers' names except ``kv_a_proj_with_mqa -> kv_a_proj``, ``q_a_layernorm -> q_a_norm``,
``kv_a_layernorm -> kv_a_norm`` and ``o_proj -> out_proj``; ``rope_interleave`` (adjacent channel
pairs) is served by the module's interleaved RoPE, so no row is permuted. The latent RMSNorms use
transformers' fixed epsilon 1e-6 (not ``rms_norm_eps``). YaRN and the other fixed-frequency rope
types pass through as ``rope_scaling`` (with DeepSeek's ``mscale_all_dim`` softmax scale).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.hf.llama import GATED_ACTIVATIONS

__all__ = ["convert_deepseek", "deepseek_config", "extra_layer", "mla_rope"]


def mla_rope(hf: HFConfig) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling dict or None)`` from ``rope_parameters`` / ``rope_scaling``."""
    params = dict(hf.get("rope_scaling", {}, dict))
    params.update(hf.get("rope_parameters", {}, dict))
    base = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0, float)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("dynamic", "longrope"):
        raise hf.unsupported(f"rope_type={rope_type!r} with multi-head latent attention")
    if params.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise hf.unsupported(f"partial_rotary_factor={params['partial_rotary_factor']}")
    return base, None if rope_type == "default" else params


def deepseek_config(hf: HFConfig) -> DecoderConfig:
    """The :class:`DecoderConfig` of an all-dense DeepSeek-V3 config."""
    layers = hf.req("num_hidden_layers")
    dense = hf.get("first_k_dense_replace", 3)
    if dense < layers:
        raise hf.unsupported(f"mixture-of-experts layers (first_k_dense_replace={dense} < num_hidden_layers="
                             f"{layers}; only all-dense models convert)")
    if hf.get("pretraining_tp", 1) != 1:
        raise hf.unsupported(f"pretraining_tp={hf.raw('pretraining_tp')}")
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    base, scaling = mla_rope(hf)
    max_pos = hf.get("max_position_embeddings", 4096)
    akw: dict[str, Any] = {
        "kv_lora_rank": hf.req("kv_lora_rank"), "q_lora_rank": hf.get("q_lora_rank", None),
        "qk_nope_head_dim": hf.req("qk_nope_head_dim"), "qk_rope_head_dim": hf.req("qk_rope_head_dim"),
        "v_head_dim": hf.req("v_head_dim"), "bias": hf.get("attention_bias", False, bool),
        "rope_interleave": hf.get("rope_interleave", True, bool),
        "dropout": hf.get("attention_dropout", 0.0, float)}
    if scaling is not None:
        akw.update(rope_scaling=scaling, max_position_embeddings=max_pos)
    qk = akw["qk_nope_head_dim"] + akw["qk_rope_head_dim"]
    return DecoderConfig(
        hf.req("vocab_size"), C, layers, H, attention="mla", attention_kwargs=akw, max_seq_len=max_pos, pos="rope",
        norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6, float),
        ffn=hf.activation("hidden_act", GATED_ACTIVATIONS, "silu"), ffn_hidden=hf.req("intermediate_size"),
        tie_embeddings=hf.get("tie_word_embeddings", False, bool), bias=False, rope=base,
        head_dim=None if C % H == 0 else qk)


def extra_layer(key: str, prefix: str, depth: int) -> bool:
    """A multi-token-prediction layer's key (``layers.{j}`` with ``j >= num_hidden_layers``): unused."""
    head = prefix + "layers."
    index = key[len(head):].split(".", 1)[0] if key.startswith(head) else ""
    return index.isdigit() and int(index) >= depth


def convert_deepseek(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (``model.`` prefix of the causal-LM class)."""
    cfg = deepseek_config(hf)
    model = DecoderLM.from_config(cfg, device=device, dtype=dtype or float_dtype(sd))
    akw = cfg.attention_kwargs or {}
    bias = bool(akw["bias"])
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    sd = {k: v for k, v in sd.items() if not extra_layer(k, prefix, cfg.depth)}
    plan = Plan(Source(sd, prefix), hf.arch)
    plan.put("tok_emb.weight", "embed_tokens.weight")
    for i in range(cfg.depth):
        h, o = f"layers.{i}.self_attn.", f"blocks.{i}.attn."
        q_pairs = [("q_proj", "q_proj")] if akw["q_lora_rank"] is None else [("q_b_proj", "q_b_proj")]
        plan.put_pairs(o, h, [*q_pairs, ("kv_b_proj", "kv_b_proj")], bias=False)
        biased = [("kv_a_proj", "kv_a_proj_with_mqa"), ("out_proj", "o_proj")]
        if akw["q_lora_rank"] is not None:
            biased.append(("q_a_proj", "q_a_proj"))
            plan.put_pairs(o, h, [("q_a_norm", "q_a_layernorm")], bias=False)
        plan.put_pairs(o, h, [*biased], bias=bias)
        plan.put_pairs(o, h, [("kv_a_norm", "kv_a_layernorm")], bias=False)
        b, L = f"blocks.{i}.", f"layers.{i}."
        plan.put_pairs(b, L, [(f"ffn.{n}", f"mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj")], bias=False)
        plan.put_pairs(b, L, [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")], bias=False)
    plan.put("norm.weight", "norm.weight")
    ignore = [r"(model\.)?rotary_emb\.inv_freq"]
    plan.head(cfg.tie_embeddings, ignore)
    plan.apply(model, ignore=ignore)
    return model
