"""The LLaMA family of decoders -> :class:`~attnzoo.DecoderLM`: LLaMA, Mistral, Qwen2, Qwen3,
Gemma, Gemma2, Phi3 and OLMo2, as ``*ForCausalLM``, ``*Model`` (no head) or
``*ForSequenceClassification`` (the ``score`` head, one row per label).

They share the layout ``[model.]layers.{i}.self_attn.{q,k,v,o}_proj`` / ``mlp.{gate,up,down}_proj``
with RMSNorm, RoPE and a gated MLP; a :class:`Family` records what each changes:

* Qwen2: q/k/v biases (no output bias); sliding layers from ``layer_types`` /
  ``use_sliding_window`` + ``max_window_layers``.
* Qwen3: per-head QK RMSNorm (``qk_norm="head"``). OLMo2: QK RMSNorm over all heads flattened
  (``qk_norm="all"``) and norms on the sub-layer outputs instead of their inputs.
* Gemma: embeddings times ``sqrt(hidden)``, RMSNorm ``(1 + weight)`` (loaded as ``weight + 1``),
  tanh-GeGLU. Gemma2: plus norms on both sides of each sub-layer, attention and final-logit
  softcaps, alternating sliding/global layers, scale ``query_pre_attn_scalar ** -0.5``.
* Phi3: fused ``qkv_proj`` (rows ``[q; k; v]``, as attnzoo's) and ``gate_up_proj`` (``[gate; up]``).
* The text decoders of Qwen2-VL / Qwen2.5-VL (``qwen2_vl_text``, ``qwen2_5_vl_text``: Qwen2's) and
  Qwen3-VL (``qwen3_vl_text``: Qwen3's). Their multimodal RoPE (``mrope_section``, interleaved or not)
  picks, per frequency, one of three position streams (time, height, width); on text the three are
  the same position, so the rotation is the 1-D RoPE (Qwen2-VL's and Qwen2.5-VL's released
  ``rope_type="mrope"`` reads as ``"default"``, as transformers reads it; other families refuse it).
  Qwen3-VL's deepstack features enter only with images; its attention has no window (a
  ``sliding_window`` in its config is not read). The multimodal wrappers (``qwen2_vl``,
  ``qwen2_5_vl``, ``qwen3_vl``) convert to these (:mod:`attnzoo.models.hf.wrappers`).

Checkpoints in Hugging Face layout already use split-half RoPE, so q/k weights are copied as
they are. ``sliding_window=W`` (a query sees itself and ``W - 1`` keys before it) is a window of
``W - 1``. RoPE scaling (``linear``, ``dynamic``, ``yarn``, ``llama3``, ``longrope``) is carried as
``rope_parameters`` (see :class:`~attnzoo.nn.positional.ScaledRotaryEmbedding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnzoo.blocks import BlockConfig
from attnzoo.models.config import DecoderConfig, Rope
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._common import float32_scale_norms, plus_one
from attnzoo.models.hf._state import (
    HFConfig,
    Plan,
    Source,
    float_dtype,
    load_gate_up_into,
    load_qkv_into,
)
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.parts import DecoderParts, ScaledEmbedding, head_for
from attnzoo.nn.rope_scaling import ROPE_SCALINGS, rope_inv_freq

__all__ = ["FAMILIES", "Family", "build_llama", "convert_llama", "llama_config", "rope_settings"]

GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh",
                     "gelu_new": "geglu_tanh"}


@dataclass(frozen=True)
class Family:
    """What a LLaMA-like family changes (see the module docstring)."""

    arch: str
    qkv_bias: bool = False  # q/k/v biases whatever attention_bias says (Qwen2)
    qk_norm: str | None = None
    gemma: int = 0  # 1: Gemma (scaled embeddings, 1 + weight norms, tanh GeGLU); 2: Gemma2 on top
    fused: bool = False  # Phi3's qkv_proj and gate_up_proj
    sublayer_norm: str = "input"
    windowed: bool = True  # False: the family's attention ignores ``sliding_window`` (Qwen3-VL's text model)


FAMILIES = {
    "llama": Family("LLaMA"), "mistral": Family("Mistral"), "qwen2": Family("Qwen2", qkv_bias=True),
    "qwen3": Family("Qwen3", qk_norm="head"), "gemma": Family("Gemma", gemma=1),
    "gemma2": Family("Gemma2", gemma=2, sublayer_norm="both"), "phi3": Family("Phi3", fused=True),
    "olmo2": Family("OLMo2", qk_norm="all", sublayer_norm="output"),
    # the text decoders of Qwen2-VL / Qwen2.5-VL (Qwen2's) and Qwen3-VL (Qwen3's): their multimodal RoPE
    # rotates every frequency by the same position on text (three equal position streams), the 1-D RoPE
    "qwen2_vl_text": Family("Qwen2-VL text", qkv_bias=True), "qwen2_5_vl_text": Family("Qwen2.5-VL text", qkv_bias=True),
    "qwen3_vl_text": Family("Qwen3-VL text", qk_norm="head", windowed=False),
}


#: the text models whose released configs name their multimodal RoPE ``"mrope"`` (1-D on text)
_MROPE = ("qwen2_vl_text", "qwen2_5_vl_text")


def rope_settings(hf: HFConfig) -> Rope:
    """The :class:`~attnzoo.models.config.Rope` of a config: the base and, for a scaled rope
    type, ``scaling="linear"`` + factor (``linear``) or the ``rope_parameters`` dict (``dynamic``,
    ``yarn``, ``llama3``, ``longrope``), checked by computing the frequencies once. Full rotary
    width only."""
    params = dict(hf.get("rope_scaling", {}, dict))
    params.update(hf.get("rope_parameters", {}, dict))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "mrope" and hf.raw("model_type") in _MROPE:  # Qwen2-VL's released configs: "default" to transformers
        rope_type = "default"
    partial = params.get("partial_rotary_factor", hf.raw("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise hf.unsupported(f"partial_rotary_factor={partial}")
    base = float(params.get("rope_theta", hf.get("rope_theta", 10000.0, float)))
    if rope_type == "default":
        return Rope(base=base)
    if rope_type not in ROPE_SCALINGS:
        raise hf.unsupported(f"rope_type={rope_type!r} (supported: {', '.join(map(repr, ROPE_SCALINGS))})")
    if rope_type == "linear":
        if not isinstance(params.get("factor"), (int, float)):
            raise hf.unsupported(f"rope_type='linear' without a numeric factor (got {params.get('factor')!r})")
        return Rope(base=base, scaling="linear", factor=float(params["factor"]))
    if params.get("original_max_position_embeddings") is None and hf.has("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = hf.req("original_max_position_embeddings")
    params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    params["rope_theta"] = base
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    try:
        rope_inv_freq(params, hf.get("head_dim", C // H), max_position_embeddings=hf.get("max_position_embeddings",
                                                                                          2048))
    except ValueError as exc:
        raise CheckpointFormatError(f"{hf.source}: rope parameters: {exc}") from exc
    return Rope(base=base, parameters=params)


def _windows(hf: HFConfig, depth: int) -> list[int | None]:
    """Per-layer left windows (``sliding_window - 1``) or ``None`` for full layers."""
    window = hf.get("sliding_window", None)
    if window is None or hf.get("use_sliding_window", True, bool) is False:
        return [None] * depth
    types = hf.get("layer_types", None, list)
    if types is None and hf.has("max_window_layers") and hf.has("use_sliding_window"):
        types = ["sliding_attention" if i >= hf.req("max_window_layers") else "full" for i in range(depth)]
    if types is None and hf.raw("model_type") == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full" for i in range(depth)]
    if types is not None and len(types) != depth:
        raise CheckpointFormatError(f"{hf.source}: layer_types has {len(types)} entries for {depth} layers")
    return [window - 1 if types is None or types[i] == "sliding_attention" else None for i in range(depth)]


def _layer_options(hf: HFConfig, fam: Family, head_dim: int) -> dict[str, Any]:
    """What every layer's attention of ``fam`` adds to the registry defaults: QK RMSNorm
    (Qwen3, OLMo2), Gemma 2's score scale and attention softcap."""
    out: dict[str, Any] = {}
    if fam.qk_norm is not None:
        out.update(qk_norm=fam.qk_norm, qk_norm_eps=hf.get("rms_norm_eps", 1e-6, float))
    if fam.gemma == 2:
        out["scale"] = float(hf.get("query_pre_attn_scalar", head_dim, float)) ** -0.5
        softcap = hf.get("attn_logit_softcapping", None, float)
        if softcap is not None:
            out["softcap"] = softcap
    return out


def llama_config(hf: HFConfig, *, sliding: bool = True, family: str = "llama") -> DecoderConfig:
    """The :class:`DecoderConfig` of the stack of a config of the family ``family`` (a
    ``model_type`` of :data:`FAMILIES`): what every layer shares. One window for every layer is
    ``attention="sliding"``; per-layer windows are set on the blocks (:func:`build_llama`).
    ``sliding=False`` ignores ``sliding_window``."""
    fam = FAMILIES[family]
    sliding = sliding and fam.windowed
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    D, depth = hf.get("head_dim", C // H), hf.req("num_hidden_layers")
    if hf.get("pretraining_tp", 1) != 1:
        raise hf.unsupported(f"pretraining_tp={hf.raw('pretraining_tp')}")
    if hf.get("use_bidirectional_attention", False, bool):
        raise hf.unsupported("use_bidirectional_attention=True")
    act_key = "hidden_activation" if hf.has("hidden_activation") else "hidden_act"
    ffn = hf.activation(act_key, GATED_ACTIVATIONS, "gelu_pytorch_tanh" if fam.gemma else "silu")
    if fam.gemma == 1 and act_key == "hidden_act" and hf.raw(act_key) == "gelu":
        ffn = GATED_ACTIVATIONS["gelu_pytorch_tanh"]  # the first releases' legacy value means tanh GELU (transformers)
    akw: dict[str, Any] = {"bias": fam.qkv_bias or hf.get("attention_bias", False, bool)}
    windows = _windows(hf, depth) if sliding else [None] * depth
    attention = "mha"
    if len(set(windows)) == 1 and windows[0] is not None:
        attention, akw["window"] = "sliding", windows[0]
    return DecoderConfig(
        hf.req("vocab_size"), C, depth, H, attention=attention, attention_kwargs=akw,
        num_kv_heads=hf.get("num_key_value_heads", H), max_seq_len=hf.get("max_position_embeddings", 2048),
        pos="rope", norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6, float), ffn=ffn,
        ffn_hidden=hf.req("intermediate_size"), tie_embeddings=hf.get("tie_word_embeddings", fam.gemma > 0, bool),
        bias=hf.get("mlp_bias", False, bool), head_dim=D if D != C // H or C % H else None, rope=rope_settings(hf))


def build_llama(hf: HFConfig, *, family: str = "llama", sliding: bool = True, head_size: int | None = None,
                device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a config of ``family`` (random weights): the blocks of :func:`llama_config`'s
    stack with the family's attention options (:func:`_layer_options`), per-layer windows and
    sub-layer norms; Gemma's embeddings times ``sqrt(hidden)``; Gemma 2's final-logit softcap on
    the LM head; the head of ``head_size`` (:func:`~attnzoo.models.parts.head_for`)."""
    fam = FAMILIES[family]
    sliding = sliding and fam.windowed
    stack = llama_config(hf, sliding=sliding, family=family)
    windows = _windows(hf, stack.depth) if sliding and stack.attention == "mha" else [None] * stack.depth
    options = _layer_options(hf, fam, stack.resolved_head_dim)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}

    def layer(block: BlockConfig, i: int) -> BlockConfig:
        window = {} if windows[i] is None else {"window": windows[i]}
        return block.replace(attention_kwargs={**(block.attention_kwargs or {}), **options, **window},
                             sublayer_norm=fam.sublayer_norm)

    V, C = stack.vocab_size, stack.dim
    softcap = hf.get("final_logit_softcapping", None, float) if fam.gemma == 2 else None
    parts = DecoderParts(embedding=ScaledEmbedding(V, C, scale=C ** 0.5, **kw) if fam.gemma else None,
                         head=head_for(C, V, head_size, softcap=softcap, **kw))
    if not options and fam.sublayer_norm == "input" and all(w is None for w in windows):
        model = DecoderLM(config=stack, parts=parts, **kw)  # the config's own blocks: model.config rebuilds it
    else:
        model = DecoderLM.with_blocks(stack, layer, parts=parts, **kw)
    # Gemma's norms scale by 1 + w in float32 and round once (transformers' GemmaRMSNorm)
    return float32_scale_norms(model, keep_float32=True) if fam.gemma else model


def _norm_pairs(fam: Family) -> list[tuple[str, str]]:
    if fam.gemma == 2:
        return [("attn_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
                ("ffn_norm", "pre_feedforward_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm")]
    if fam.sublayer_norm == "output":
        return [("attn_out_norm", "post_attention_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm")]
    return [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]


def _layer(plan: Plan, i: int, fam: Family, cfg: DecoderConfig) -> None:
    h, o = f"layers.{i}.", f"blocks.{i}."
    attn_bias, mlp_bias = bool(cfg.attention_kwargs and cfg.attention_kwargs["bias"]), cfg.bias
    if fam.fused:
        plan.put(f"{o}attn.qkv_proj.weight", f"{h}self_attn.qkv_proj.weight")
        load_gate_up_into(plan, f"{o}ffn.", f"{h}mlp.gate_up_proj.weight")
        plan.put_pairs(o, h, [("ffn.down_proj", "mlp.down_proj")], bias=False)
    else:
        load_qkv_into(plan, o + "attn", tuple(f"{h}self_attn.{n}_proj.weight" for n in "qkv"),
                      tuple(f"{h}self_attn.{n}_proj.bias" for n in "qkv") if attn_bias else None, attn_bias)
        plan.put_pairs(o, h, [(f"ffn.{n}", f"mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj")], bias=mlp_bias)
    plan.put(f"{o}attn.out_proj.weight", f"{h}self_attn.o_proj.weight")
    if attn_bias:
        if fam.qkv_bias and not plan.src.has(f"{h}self_attn.o_proj.bias"):
            plan.put_tensor(f"{o}attn.out_proj.bias", torch.zeros(cfg.dim), "zeros (no o_proj bias)")
        else:
            plan.put(f"{o}attn.out_proj.bias", f"{h}self_attn.o_proj.bias")
    if fam.qk_norm is not None:
        for n in ("q_norm", "k_norm"):
            plan.put(f"{o}attn.frontier.{n}_weight", f"{h}self_attn.{n}.weight")
    for ours, theirs in _norm_pairs(fam):
        plan.put(f"{o}{ours}.weight", f"{h}{theirs}.weight", plus_one if fam.gemma else None)


def convert_llama(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any, sliding: bool = True,
                  family: str = "llama") -> DecoderLM:
    """Build the decoder of ``family`` and copy the weights. The head follows the weights:
    ``score.weight`` -> a classification head, ``lm_head.weight`` or a ``model.`` prefix -> the
    LM head (tied or not), neither -> no head (``*Model``)."""
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    head_size: int | None = None
    if "score.weight" in sd:
        head_size = int(sd["score.weight"].shape[0])
    elif not prefix and "lm_head.weight" not in sd and not any(
            str(a).endswith("ForCausalLM") for a in hf.get("architectures", [], list)):
        head_size = 0
    model = build_llama(hf, family=family, sliding=sliding, head_size=head_size, device=device,
                        dtype=dtype or float_dtype(sd))
    stack = llama_config(hf, sliding=sliding, family=family)
    fam = FAMILIES[family]
    plan = Plan(Source(sd, prefix), hf.arch)
    plan.put("tok_emb.weight", "embed_tokens.weight")
    for i in range(stack.depth):
        _layer(plan, i, fam, stack)
    plan.put("norm.weight", "norm.weight", plus_one if fam.gemma else None)
    ignore = [r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"(model\.)?rotary_emb\.\w+"]
    plan.src.prefix = ""
    if head_size is None:
        plan.head(model.tie_embeddings, ignore)
    elif head_size > 0:
        plan.put("lm_head.weight", "score.weight")
    if head_size is not None:
        ignore.append(r"lm_head\.weight")
    plan.apply(model, ignore=ignore)
    return model
