"""T5, mT5 and UMT5 encoder-decoders (``t5``, ``mt5``, ``umt5``: T5 v1.0, T5 v1.1, Flan-T5, mT5,
UMT5) -> :class:`~attnzoo.EncoderDecoder`, as ``T5ForConditionalGeneration`` / ``T5Model``,
``MT5ForConditionalGeneration`` / ``MT5Model``, ``UMT5ForConditionalGeneration`` / ``UMT5Model``.
This module dispatches the three model types: an encoder-only checkpoint (``T5EncoderModel``,
``MT5EncoderModel``, ``UMT5EncoderModel``: no ``decoder.*`` weight) goes to
:func:`~attnzoo.models.families.t5_encoder.convert_t5_encoder`, unchanged. Line numbers:
transformers 5.25's ``models/t5/modeling_t5.py`` and ``configuration_t5.py`` (mT5's files are the
same code; UMT5's ``models/umt5/modeling_umt5.py`` where it differs).

The encoder is ``families/t5_encoder.py``'s (:func:`~attnzoo.models.families.t5_encoder.build_t5_encoder`).
The decoder (T5Stack with ``is_decoder=True``, 644-752; ``num_decoder_layers`` blocks, default
``num_layers``, 921-924) is a :class:`~attnzoo.DecoderLM` of
:class:`~attnzoo.models.families.t5_encoder.ClampedBlock` s with cross-attention:

* the token embedding is ``shared`` (914), one attnzoo parameter for the encoder, the decoder and a
  tied LM head (``_tied_weights_keys``, 904-908): no scale, no absolute positions.
* per layer, pre-norm RMS sub-layers (T5LayerNorm) without biases (T5Block, 439-514): causal
  self-attention with a relative bias over **causal** buckets (``bidirectional=not is_decoder``, 274:
  all ``relative_attention_num_buckets`` for keys at or before the query, none for later keys), then
  cross-attention to the encoder's output (``EncDecAttention``, 407-436) with **no** position bias
  (``has_relative_attention_bias=False``: a zero bias, 339-344), then the feed-forward; all three
  attention-free of the ``1/sqrt(d)`` scale (198) with ``d_kv``-wide heads. T5 and mT5 compute the
  self-attention bias in the first layer and share it with every layer (652, 740-743); UMT5 gives
  every layer its own (UMT5LayerSelfAttention, 379). With a cache the queries sit at
  ``cache.length + i`` (``past_seen_tokens``, 299, 348-350), as
  :class:`~attnzoo.models.families.t5_encoder.RelativeBiasAttention` counts them.
* in float16 the hidden states are clamped after each of the three sub-layers, the cross-attention
  included (472-512): :func:`~attnzoo.models.families.t5_encoder.clamp_overflow`.
* ``final_layer_norm`` (654, 745), then the LM head ``lm_head`` (926; ``T5Model``: none, the
  decoder's last hidden state is the output, 883-884). The hidden states are multiplied by
  ``d_model ** -0.5`` before the head when ``scale_decoder_outputs`` (1047-1048): T5Config and
  UMT5Config set it from the checkpoint's ``tie_word_embeddings`` (``is not False``: T5 v1.0 scales,
  T5 v1.1 / Flan-T5 / UMT5, saved with ``tie_word_embeddings=false``, do not;
  ``configuration_t5.py`` 81, ``configuration_umt5.py`` 75), then force ``tie_word_embeddings=True``
  (82). mT5 never rescales (``modeling_mt5.py`` 1096-1098). :class:`ScaledLMHead`.
* the head is tied to ``shared`` unless the checkpoint holds an ``lm_head.weight`` of its own
  (v1.1 / Flan-T5 / mT5 / UMT5): transformers 5.25 builds every model with the two on one storage
  and, loading a file, keeps them apart when both are stored with different values
  (``PreTrainedModel.tie_weights``). The conversion ties when ``lm_head.weight`` is absent or
  shares the embedding's storage (a file storing both as separate equal copies converts untied:
  the same numbers).
  Which checkpoint has a head at all: a state dict that has ``lm_head.weight``; one that keeps every
  tied name (``decoder.embed_tokens.weight``) but not ``lm_head.weight`` is a bare ``*Model``; a
  file saved without the tied copies has a head iff its ``architectures`` names a
  ``*ForConditionalGeneration``.
* ``decoder_start_token_id`` (the pad id, 0 in real checkpoints; T5 uses ``pad_token_id`` when the
  config has none, 622-641) starts :meth:`~attnzoo.EncoderDecoder.generate`; ``eos_token_id`` (an
  int, or a one-element list; several ids: none, pass ``eos_token_id=``) ends it.

Masks: the decoder's key padding (``decoder_attention_mask``) with the causal mask, the source's on
the cross-attention; relative positions are the target tokens' indices (right padding). Dropout
(``dropout_rate``) is not reproduced: the converted model has none, in eval and in training; the
stale ``decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight`` of old checkpoints
is ignored (``_keys_to_ignore_on_load_unexpected``, 901-903).

Refused by name: ``T5ForQuestionAnswering`` (``qa_outputs``), ``T5ForSequenceClassification``
(``classification_head``), ``T5ForTokenClassification`` (a per-token head on the encoder), and every
refusal of the encoder (``is_decoder=True``, activations without an attnzoo feed-forward such as
``gated-relu``, bucket settings whose log buckets are undefined).

Half precision: transformers' ``from_pretrained(dtype=torch.float16)`` keeps every ``wo`` in float32
(``_keep_in_fp32_modules``, 542); attnzoo runs the model in one dtype (with the clamps), as
transformers' ``model.half()``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_bool, check_positive_float
from attnzoo.blocks import BlockLayers, FeedForward
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.encoder import TransformerEncoder
from attnzoo.models.families._seq2seq import config_token
from attnzoo.models.families.t5_encoder import (
    DEFAULTS as ENCODER_DEFAULTS,
)
from attnzoo.models.families.t5_encoder import (
    ClampedBlock,
    RelativeBiasAttention,
    RelativePositionBias,
    _canonical,
    build_t5_encoder,
    convert_t5_encoder,
    feed_forward_activation,
)
from attnzoo.models.hf._state import HFConfig, Plan, float_dtype, load_qkv_into
from attnzoo.models.parts import DecoderParts, LMHead
from attnzoo.models.seq2seq import EncoderDecoder
from attnzoo.nn.attention import MultiHeadAttention, build_softmax

__all__ = ["DEFAULTS", "DISPATCH", "MAX_TARGET_LENGTH", "ScaledLMHead", "build_t5", "convert_t5",
           "decoder_output_scale", "has_lm_head"]

#: each config class's defaults of the keys read here (a ``config.json`` may leave them out);
#: ``num_decoder_layers`` defaults to ``num_layers``, T5's ``decoder_start_token_id`` to ``pad_token_id``
DEFAULTS: dict[str, dict[str, Any]] = {
    "t5": {**ENCODER_DEFAULTS["t5"], "pad_token_id": 0, "eos_token_id": 1},
    "mt5": {**ENCODER_DEFAULTS["mt5"], "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0},
    "umt5": {**ENCODER_DEFAULTS["umt5"], "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}}
#: the decoder's ``max_seq_len``: relative positions have no table, so this only bounds ``generate``
MAX_TARGET_LENGTH = 1 << 20
_CLASS_PREFIX = {"t5": "T5", "mt5": "MT5", "umt5": "UMT5"}


class ScaledLMHead(LMHead):
    """T5 v1.0's LM head: ``logits = (x * scale) W^T`` (``scale = d_model ** -0.5``, applied to the
    hidden states first, as transformers does, so half precision rounds alike). Ties to the token
    embedding as :class:`~attnzoo.models.parts.LMHead` does. Weight: ``weight [V, C]``.

    Shapes: ``[B, N, C]`` -> ``[B, N, V]``.
    """

    def __init__(self, dim: int, vocab_size: int, *, scale: float, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, vocab_size, device=device, dtype=dtype)
        self.scale = check_positive_float(scale, "scale", "ScaledLMHead")

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x * self.scale)  # [B, N, V]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"


def _read(hf: HFConfig) -> HFConfig:
    """``hf`` with its class's defaults, the encoder's refusals applied (``model_type`` checked)."""
    model_type = hf.raw("model_type", "t5")
    if model_type not in DEFAULTS:
        raise hf.unsupported(f"model_type={model_type!r} (the T5 family converts {sorted(DEFAULTS)})")
    out = _canonical(hf.with_defaults(DEFAULTS[model_type]))
    buckets, distance = out.req("relative_attention_num_buckets"), out.req("relative_attention_max_distance")
    try:
        RelativePositionBias(buckets, 1, max_distance=distance, bidirectional=False, device="meta")
    except ValueError as exc:  # the decoder's causal buckets: twice as many exact ones as the encoder's
        raise hf.unsupported(f"relative_attention_num_buckets={buckets!r} with relative_attention_max_distance="
                             f"{distance!r} in the decoder ({exc})") from exc
    return out


def decoder_output_scale(hf: HFConfig) -> bool:
    """Whether transformers multiplies the decoder's output by ``d_model ** -0.5`` before the LM
    head: never for mT5; for T5 / UMT5 the config's ``scale_decoder_outputs`` (what ``to_dict()``
    holds), else the checkpoint's ``tie_word_embeddings`` is not ``False`` (what its config class
    derives it from)."""
    if hf.raw("model_type", "t5") == "mt5":
        return False
    flag = hf.get("scale_decoder_outputs", None, bool)
    if flag is None:
        flag = hf.data.get("tie_word_embeddings") is not False
    return bool(flag)


def build_t5(hf: HFConfig, *, head: bool = True, tied: bool = True, device: Any = None,
             dtype: Any = None) -> EncoderDecoder:
    """The encoder-decoder of a T5 / mT5 / UMT5 config (random weights; see the module docstring).

    Args:
        hf: the config (``model_type`` ``t5``, ``mt5`` or ``umt5``).
        head: with the LM head (``*ForConditionalGeneration``; a :class:`ScaledLMHead` when
            :func:`decoder_output_scale`), else none (``*Model``: the decoder's hidden states).
        tied: the head shares the token embedding.

    Returns: ``EncoderDecoder``; ``forward(src [B, M], tgt [B, N])`` -> ``[B, N, V]`` (``[B, N, C]``
    without a head).
    """
    check_bool(head, "head", "build_t5")
    check_bool(tied, "tied", "build_t5")
    hf = _read(hf)
    umt5 = hf.raw("model_type", "t5") == "umt5"
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    encoder: TransformerEncoder = build_t5_encoder(hf, per_layer_bias=umt5, **kw)
    V, C, H, Dh = hf.req("vocab_size"), hf.req("d_model"), hf.req("num_heads"), hf.req("d_kv")
    depth = hf.get("num_decoder_layers", hf.req("num_layers"))
    eps = hf.req("layer_norm_epsilon", float)
    bias = functools.partial(RelativePositionBias, hf.req("relative_attention_num_buckets"), H,
                             max_distance=hf.req("relative_attention_max_distance"), bidirectional=False, **kw)
    shared = bias()

    def self_attention(i: int) -> nn.Module:
        return build_softmax(RelativeBiasAttention, C, H, head_dim=Dh, bias=False, causal=True, scale=1.0,
                             relative_bias=bias() if umt5 and i else shared, **kw)

    cross = functools.partial(build_softmax, MultiHeadAttention, C, H, kv_dim=C, head_dim=Dh, bias=False,
                              scale=1.0, **kw)
    ffn = functools.partial(FeedForward, C, hf.req("d_ff"), feed_forward_activation(hf), bias=False, **kw)
    norm = parts.rms_norm(C, eps, **kw)
    blocks = [ClampedBlock(C, layers=BlockLayers(attention=functools.partial(self_attention, i), cross_attention=cross,
                                                 feed_forward=ffn, norm=norm)) for i in range(depth)]
    lm_head: nn.Module = nn.Identity()
    if head:
        lm_head = ScaledLMHead(C, V, scale=C ** -0.5, **kw) if decoder_output_scale(hf) else LMHead(C, V, **kw)
    cfg = DecoderConfig(V, C, depth, H, head_dim=Dh, pos="none", norm="rms", norm_eps=eps,
                        max_seq_len=MAX_TARGET_LENGTH, tie_embeddings=head and tied)
    decoder = DecoderLM(config=cfg, parts=DecoderParts(blocks=blocks, embedding=encoder.tok_emb, head=lm_head), **kw)
    start = config_token(hf.raw("decoder_start_token_id"), V)
    return EncoderDecoder(encoder, decoder, decoder_start_token_id=start if start is not None
                          else config_token(hf.raw("pad_token_id"), V), eos_token_id=config_token(hf.raw("eos_token_id"), V))


def _refuse_heads(hf: HFConfig, sd: dict[str, Tensor]) -> None:
    """Refuse, by name, the task heads on the seq2seq model."""
    if any(k.startswith("qa_outputs.") for k in sd):
        raise hf.unsupported("T5ForQuestionAnswering's span head (qa_outputs): convert the "
                             "T5ForConditionalGeneration / T5Model it is built on")
    if any(k.startswith(("classification_head.", "transformer.decoder.")) for k in sd):
        raise hf.unsupported("T5ForSequenceClassification's classification head (read at the last end token): "
                             "convert the T5Model it is built on")


def has_lm_head(hf: HFConfig, sd: dict[str, Tensor]) -> bool:
    """Whether the checkpoint is a ``*ForConditionalGeneration`` (see the module docstring)."""
    if "lm_head.weight" in sd:
        return True
    if "decoder.embed_tokens.weight" in sd:  # every tied name kept (a state dict), yet no head: a bare *Model
        return False
    return any(str(a).endswith("ForConditionalGeneration") for a in hf.get("architectures", [], list))


def _same_storage(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are one tensor (a tied head in a state dict): the same shape and storage."""
    return a.shape == b.shape and a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _put_layer(plan: Plan, ours: str, theirs: str, *, relative_bias: bool, cross: bool, gated: bool) -> None:
    """One T5Block's weights: ``layer.0`` self-attention (+ its relative bias), ``layer.1``
    cross-attention (decoder), then the feed-forward; the norms of each."""
    a, f = f"{theirs}layer.0.", f"{theirs}layer.{2 if cross else 1}."
    load_qkv_into(plan, f"{ours}attn", tuple(f"{a}SelfAttention.{n}.weight" for n in "qkv"), None, False)
    plan.put_pairs(f"{ours}attn.", f"{a}SelfAttention.", [("out_proj", "o")], bias=False)
    if relative_bias:
        plan.put(f"{ours}attn.relative_bias.weight", f"{a}SelfAttention.relative_attention_bias.weight")
    norms = [("attn_norm", f"{a}layer_norm"), ("ffn_norm", f"{f}layer_norm")]
    if cross:
        c = f"{theirs}layer.1."
        plan.put(f"{ours}cross_attn.q_proj.weight", f"{c}EncDecAttention.q.weight")
        plan.put_cat(f"{ours}cross_attn.kv_proj.weight", [f"{c}EncDecAttention.{n}.weight" for n in "kv"])
        plan.put_pairs(f"{ours}cross_attn.", f"{c}EncDecAttention.", [("out_proj", "o")], bias=False)
        norms.append(("cross_norm", f"{c}layer_norm"))
    ffn = [("gate_proj", "wi_0"), ("up_proj", "wi_1")] if gated else [("up_proj", "wi")]
    plan.put_pairs(f"{ours}ffn.", f"{f}DenseReluDense.", [*ffn, ("down_proj", "wo")], bias=False)
    plan.put_pairs(ours, "", norms, bias=False)


def convert_t5(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> EncoderDecoder | TransformerEncoder:
    """Convert a T5 / mT5 / UMT5 checkpoint: the encoder-only ones (no ``decoder.*`` weight) with
    :func:`~attnzoo.models.families.t5_encoder.convert_t5_encoder` (a
    :class:`~attnzoo.TransformerEncoder`), the seq2seq ones into an :class:`~attnzoo.EncoderDecoder`
    (every weight through a :class:`~attnzoo.models.hf._state.Plan`, so
    :func:`~attnzoo.interop.to_hf` writes it back)."""
    _refuse_heads(hf, sd)
    if not any(k.startswith("decoder.") for k in sd):
        return convert_t5_encoder(hf, sd, device=device, dtype=dtype)
    head = has_lm_head(hf, sd)
    emb_key = "shared.weight" if "shared.weight" in sd else "encoder.embed_tokens.weight"
    tied = not head or "lm_head.weight" not in sd or (emb_key in sd and _same_storage(sd["lm_head.weight"], sd[emb_key]))
    model = build_t5(hf, head=head, tied=tied, device=device, dtype=dtype or float_dtype(sd))
    umt5 = hf.raw("model_type") == "umt5"
    plan = parts.plan_for(sd, "", hf.arch)
    plan.put("encoder.tok_emb.weight", emb_key)  # ``shared``: the decoder's embedding and a tied head too
    ignore = [re.escape(k) for k in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
              if k != emb_key]
    ignore.append(r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight")
    for stack, ours in (("encoder", model.encoder), ("decoder", model.decoder)):
        blocks = ours.blocks
        for i, block in enumerate(blocks):
            _put_layer(plan, f"{stack}.blocks.{i}.", f"{stack}.block.{i}.", relative_bias=i == 0 or umt5,
                       cross=stack == "decoder", gated=block.ffn.gate_proj is not None)
    plan.put("encoder.norm.weight", "encoder.final_layer_norm.weight")
    plan.put("decoder.norm.weight", "decoder.final_layer_norm.weight")
    if head and not tied:
        plan.put("decoder.lm_head.weight", "lm_head.weight")
    elif head:
        ignore.append(r"lm_head\.weight")
    plan.apply(model, ignore=ignore)
    return model


def _dispatch(model_type: str, name: str) -> parts.Dispatch:
    prefix = _CLASS_PREFIX[model_type]
    return parts.Dispatch(name, convert_t5, (f"{prefix}ForConditionalGeneration", f"{prefix}Model",
                                             f"{prefix}EncoderModel"))


#: what ``models/hf/convert.py`` dispatches here, by ``model_type`` (the encoder-only classes too)
DISPATCH = {"t5": _dispatch("t5", "T5"), "mt5": _dispatch("mt5", "mT5"), "umt5": _dispatch("umt5", "UMT5")}
