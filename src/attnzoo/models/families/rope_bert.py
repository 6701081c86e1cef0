"""RoPE encoders of modern embedding models -> :class:`~attnzoo.TransformerEncoder`: GTE (``gte``,
Alibaba's GTE-v1.5 / mGTE), NomicBERT (``nomic_bert``, nomic-embed-text), EuroBERT (``eurobert``) and
Jina Embeddings v3 (``jina_embeddings_v3``), as ``*Model``, ``*ForMaskedLM`` and
``*ForSequenceClassification``. One builder over a table of rows (:data:`FAMILIES`), the encoders
assembled from parts (:class:`~attnzoo.models.EncoderParts`): an embedding, non-causal
:class:`~attnzoo.TransformerBlock` s around :class:`~attnzoo.MultiHeadAttention` with its rotary
embedding (split halves, ``rotate_half``; positions ``0 .. N-1`` of the padded row, as transformers'
``position_ids = arange(N)``: left padding shifts the positions of the real tokens there as well),
a final norm and the heads. Line numbers: transformers 5.25's ``models/<name>/modeling_<name>.py``.

* GTE (``modeling_gte.py``): BERT's post-norm layer, LayerNorm ``layer_norm_eps``
  (``x = ln(x + attn(x))``, ``x = ln(x + mlp(x))``; 268-300) over q/k/v/o with biases (206-209) and a
  gated MLP ``down(act(gate(x)) * up(x))`` whose ``gate_proj`` / ``up_proj`` have no bias and
  ``down_proj`` has one (248-265; ``hidden_act`` ``gelu``: GeGLU with the exact GELU); the embedding
  is the token embedding plus the token-type embedding (none when ``type_vocab_size`` is 0, 50-55,
  74-79), then a LayerNorm (58) -- no absolute positions; RoPE base ``160000`` by default
  (configuration). The MLM head ``decoder(ln(gelu(dense(h))))`` (423-440, always the exact GELU) with
  the decoder tied to the token embedding by ``tie_word_embeddings`` (446) and its own bias; the
  sequence classifier ``classifier(tanh(pooler(h[:, 0])))`` (303-315, 520-530).
* NomicBERT (``modeling_nomic_bert.py``): GTE's layer without any bias in the attention or the MLP
  (207-210, 249-262; ``hidden_act`` ``silu``: SwiGLU), ``head_dim`` from the config (may differ from
  ``hidden / heads``), always a token-type embedding (49-87), RoPE base ``1000``; BERT's MLM head with
  the transform's activation ``hidden_act`` (446-461), its decoder bias tied to
  ``cls.predictions.bias`` when the embeddings are tied (476-479); BERT's pooled classifier (541-551).
* EuroBERT (``modeling_eurobert.py``): LLaMA's pre-norm layer made bidirectional (``is_causal=False``,
  147): RMSNorm ``rms_norm_eps`` (45-60, 228-229; the weight applied after the cast back, as
  attnzoo's :class:`~attnzoo.blocks.RMSNorm`), GQA with ``attention_bias`` on q/k/v/o (150-160), a
  gated MLP biased by ``mlp_bias`` (204-217), a final RMSNorm (339), no embedding norm; the MLM head one
  linear layer (bias ``mlp_bias``) tied by ``tie_word_embeddings`` (default: not tied; 392-405); the
  classifier ``classifier(gelu(dense(.)))`` of the first token (``classifier_pooling="bos"``: slot 0,
  a pad under left padding, as transformers), of the masked mean (``"mean"``), or per token and then
  the masked mean of the logits (``"late"``, the default; 460-525).
* Jina Embeddings v3 (``modeling_jina_embeddings_v3.py``): GTE's layer with an ungated biased MLP
  ``fc2(act(fc1(x)))`` (251-263), always a token-type embedding, RoPE base ``20000``; RoBERTa's MLM
  head with the decoder bias tied to ``lm_head.bias`` (426-447) and RoBERTa's classification head
  ``out_proj(tanh(dense(h[:, 0])))`` (520-540). transformers' model has no task LoRA adapters: a
  checkpoint holding them (``lora_A`` / ``lora_B`` / ``parametrizations`` keys, the remote-code
  ``XLMRobertaLoRA`` layout) is refused by name; merge one task's adapter into the weights first (with
  PEFT, ``merge_and_unload()``) and convert the merged model, which is exact.

A base ``*Model`` built with its pooler (``add_pooling_layer=True``; Jina's default) keeps it as the
encoder's ``pooler`` (:meth:`~attnzoo.TransformerEncoder.pooler_output`). Refused by name:
``partial_rotary_factor`` other than 1, rope types attnzoo's rotary does not know, activations without
an attnzoo equivalent, ``hidden_size`` not a multiple of ``num_attention_heads``, EuroBERT's
``classifier_pooling`` other than ``bos`` / ``mean`` / ``late``, token-classification heads and LoRA
adapters in the checkpoint.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock, make_norm
from attnzoo.models.config import EncoderConfig
from attnzoo.models.encoder import (
    FactorisedMLMHead,
    FirstTokenClassifier,
    TransformerEncoder,
    cls_pool,
    mean_pool,
)
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.hf.bert import ACTIVATIONS
from attnzoo.models.parts import EncoderParts, LMHead, PackedFromZero
from attnzoo.variants import build_attention

__all__ = ["CLASSIFIER_POOLINGS", "DISPATCH", "FAMILIES", "FUSED", "SAVED", "EuroBertClassifier", "Family",
           "Heads", "TypedEmbedding", "build_rope_bert", "canonical", "convert_rope_bert", "transformers_names"]

#: EuroBERT's ``classifier_pooling`` values (modeling 492-517)
CLASSIFIER_POOLINGS = ("bos", "mean", "late")


class TypedEmbedding(PackedFromZero, nn.Module):
    """Token embedding plus token-type embedding (type 0 where none is given; none at all without
    ``type_vocab_size``), then ``norm`` (a LayerNorm, or ``nn.Identity``): the embedding of GTE,
    NomicBERT, Jina v3 (LayerNorm) and EuroBERT (no types, no norm). No absolute positions: RoPE
    is in the attention.

    Weights: ``tok [V, C]``, ``types [T, C]``, ``norm``.
    Shapes: ``tokens [B, N]``, ``token_type_ids [B, N] | None`` -> ``[B, N, C]``.
    """

    def __init__(self, vocab_size: int, dim: int, type_vocab_size: int, norm: nn.Module, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim, device=device, dtype=dtype)
        self.types = nn.Embedding(type_vocab_size, dim, device=device, dtype=dtype) if type_vocab_size else None
        self.norm = norm

    def forward(self, tokens: Tensor, token_type_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        x = self.tok(tokens)  # [B, N, C]
        if self.types is not None:
            x = x + (self.types.weight[0] if token_type_ids is None else self.types(token_type_ids))
        return self.norm(x)


class EuroBertClassifier(nn.Module):
    """EuroBERT's sequence classifier ``classifier(gelu(dense(.)))`` (exact GELU): of the first
    token (``"bos"``), of the mean over the real tokens (``"mean"``), or of every token, the logits
    then averaged over the real tokens (``"late"``).

    Weights: ``dense [C, C]``, ``classifier [L, C]``, both biased.
    Shapes: ``hidden [B, N, C]``, ``attention_mask [B, N] | None`` -> ``[B, L]``.
    """

    def __init__(self, dim: int, num_labels: int, pooling: str, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if pooling not in CLASSIFIER_POOLINGS:
            raise ValueError(f"EuroBertClassifier: pooling must be one of {CLASSIFIER_POOLINGS}, got {pooling!r}")
        self.pooling = pooling
        self.dense = nn.Linear(dim, dim, device=device, dtype=dtype)
        self.classifier = nn.Linear(dim, num_labels, device=device, dtype=dtype)

    def _logits(self, x: Tensor) -> Tensor:
        return self.classifier(nn.functional.gelu(self.dense(x)))

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if self.pooling == "bos":
            return self._logits(cls_pool(hidden))  # [B, L]
        if self.pooling == "mean":
            return self._logits(mean_pool(hidden, attention_mask))
        return mean_pool(self._logits(hidden), attention_mask)  # late: per-token logits [B, N, L], then the mean

    def extra_repr(self) -> str:
        return f"pooling={self.pooling!r}"


@dataclass(frozen=True)
class Family:
    """One row of the lineage: its name and transformers classes, the base model's prefix in the
    head classes, the config defaults a ``config.json`` may leave out (``rope_theta`` included), and
    what differs (layer layout, MLP, biases, heads)."""

    name: str
    classes: tuple[str, ...]
    prefix: str  # "gte.": the base model inside *ForMaskedLM / *ForSequenceClassification
    defaults: Mapping[str, Any]
    mlp: str  # "gated" (gate/up/down), "gated_down_bias" (GTE: only down_proj biased), "plain" (fc1/fc2)
    attention_bias: bool | str  # a constant, or the config key that sets q/k/v/o biases
    mlm: str  # the MLM head's weights: "lm_head." (GTE, Jina), "cls.predictions." (Nomic), "linear" (EuroBERT)
    classifier: str  # "pooler" (BERT's), "roberta" (dense + out_proj), "eurobert"
    pre_norm: bool = False  # EuroBERT: LLaMA's layer, RMSNorms, a final norm, no embedding norm
    mlm_act: str | None = "gelu"  # the MLM transform's activation (None: hidden_act)


@dataclass(frozen=True)
class Heads:
    """What a checkpoint holds besides the encoder: the base model's ``prefix`` ("" for a base
    ``*Model``), a ``pooler`` of the base model, a masked-LM head, a sequence classifier of
    ``num_labels`` labels (0: none)."""

    prefix: str
    pooler: bool
    mlm: bool
    num_labels: int


def _attention_bias(hf: HFConfig, family: Family) -> bool:
    bias = family.attention_bias
    return hf.get(bias, False, bool) if isinstance(bias, str) else bias


def _transform(head: str) -> str:
    """Where an MLM head's dense + LayerNorm are: ``cls.predictions.transform.`` (BERT's), else the head's own."""
    return f"{head}transform." if head.startswith("cls.") else head


_POST_NORM = {"layer_norm_eps": 1e-12, "hidden_act": "gelu", "type_vocab_size": 1, "tie_word_embeddings": True,
              "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.0}
#: one row per ``model_type``; defaults: the configuration classes' (``configuration_<name>.py``)
FAMILIES: dict[str, Family] = {
    "gte": Family("GTE", ("GteModel", "GteForMaskedLM", "GteForSequenceClassification"), "gte.",
                  {**_POST_NORM, "max_position_embeddings": 8192, "rope_theta": 160000.0}, "gated_down_bias",
                  True, "lm_head.", "pooler"),
    "nomic_bert": Family("NomicBERT", ("NomicBertModel", "NomicBertForMaskedLM", "NomicBertForSequenceClassification"),
                         "nomic_bert.", {**_POST_NORM, "hidden_act": "silu", "type_vocab_size": 2, "rope_theta": 1000.0,
                                         "max_position_embeddings": 2048, "hidden_dropout_prob": 0.0},
                         "gated", False, "cls.predictions.", "pooler", mlm_act=None),
    "eurobert": Family("EuroBERT", ("EuroBertModel", "EuroBertForMaskedLM", "EuroBertForSequenceClassification"),
                       "model.", {"rms_norm_eps": 1e-5, "hidden_act": "silu", "max_position_embeddings": 8192,
                                  "tie_word_embeddings": False, "rope_theta": 10000.0, "attention_dropout": 0.0,
                                  "attention_bias": False, "mlp_bias": False, "classifier_pooling": "late"},
                       "gated", "attention_bias", "linear", "eurobert", pre_norm=True),
    "jina_embeddings_v3": Family(
        "Jina Embeddings v3", ("JinaEmbeddingsV3Model", "JinaEmbeddingsV3ForMaskedLM",
                               "JinaEmbeddingsV3ForSequenceClassification"), "roberta.",
        {**_POST_NORM, "layer_norm_eps": 1e-5, "max_position_embeddings": 8194, "rope_theta": 20000.0,
         "attention_probs_dropout_prob": 0.1}, "plain", True, "lm_head.", "roberta"),
}


#: a saved folder's names -> transformers' module names (``conversion_mapping.py`` 1820-1884: what
#: ``save_pretrained`` writes back and ``from_pretrained`` renames), applied in order; no-ops on
#: transformers' own names
SAVED: dict[str, tuple[tuple[str, str], ...]] = {
    "gte": ((r"^new\.", "gte."), (r"encoder\.layer\.", "layers."), (r"attention\.o_proj", "self_attn.o_proj"),
            (r"attn_ln", "post_attention_layernorm"), (r"mlp_ln", "post_mlp_layernorm"),
            (r"lm_head\.norm\.", "lm_head.layer_norm.")),
    "nomic_bert": ((r"encoder\.layers\.", "layers."), (r"emb_ln", "embeddings.LayerNorm"),
                   (r"attn\.out_proj", "self_attn.o_proj"), (r"fc11", "up_proj"), (r"fc12", "gate_proj"),
                   (r"fc2", "down_proj"), (r"norm1", "post_attention_layernorm"), (r"norm2", "post_mlp_layernorm")),
    "jina_embeddings_v3": ((r"emb_ln", "embeddings.LayerNorm"), (r"encoder\.layers\.", "layers."),
                           (r"mixer\.out_proj", "self_attn.o_proj"), (r"norm1", "post_attention_layernorm"),
                           (r"norm2", "post_mlp_layernorm")),
}
#: a saved folder's fused tensors -> the transformers modules of their equal row blocks, in order
FUSED = ((re.compile(r"(attention\.qkv_proj|attn\.Wqkv|mixer\.Wqkv)\."), ("self_attn.q_proj.", "self_attn.k_proj.",
                                                                          "self_attn.v_proj.")),
         (re.compile(r"mlp\.up_gate_proj\."), ("mlp.up_proj.", "mlp.gate_proj.")))


def transformers_names(model_type: str, sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` under transformers' module names: a saved folder's keys renamed (:data:`SAVED`) and
    its fused q/k/v and up/gate tensors split by rows (:data:`FUSED`); transformers' own state dict
    comes back as it is."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        for pattern, repl in SAVED.get(model_type, ()):
            key = re.sub(pattern, repl, key)
        fused = next(((m, names) for p, names in FUSED if (m := p.search(key))), None)
        if fused is None:
            out[key] = t
            continue
        match, names = fused
        for name, block in zip(names, t.chunk(len(names), dim=0), strict=True):
            out[key[:match.start()] + name + key[match.end():]] = block
    return out


def canonical(hf: HFConfig) -> tuple[HFConfig, Family]:
    """``hf`` as transformers reads it (the row's defaults where a key is absent) and its row; the
    options attnzoo cannot reproduce refused by name."""
    family = FAMILIES.get(hf.raw("model_type"))
    if family is None:
        raise hf.unsupported(f"model_type={hf.raw('model_type')!r} (this converter: {', '.join(map(repr, FAMILIES))})")
    out = hf.with_defaults(family.defaults)
    params = parts.rope_params(out)
    for where, value in (("", out.raw("partial_rotary_factor")), ("rope_parameters.", params.get("partial_rotary_factor"))):
        if value is not None and float(value) != 1.0:
            raise hf.unsupported(f"{where}partial_rotary_factor={value!r} (these encoders rotate whole heads)")
    C, H = out.req("hidden_size"), out.req("num_attention_heads")
    if C % H:
        raise hf.unsupported(f"hidden_size={C} not a multiple of num_attention_heads={H}")
    out.activation("hidden_act", ACTIVATIONS if family.mlp == "plain" else parts.GATED)
    if family.pre_norm:
        parts.dims(out)  # pretraining_tp
        if out.req("classifier_pooling", str) not in CLASSIFIER_POOLINGS:
            raise hf.unsupported(f"classifier_pooling={out.raw('classifier_pooling')!r} "
                                 f"(supported: {', '.join(map(repr, CLASSIFIER_POOLINGS))})")
    return out, family


def _feed_forward(hf: HFConfig, family: Family, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The MLP factory of a row (``up_proj``, ``gate_proj``, ``down_proj`` of a :class:`FeedForward`)."""
    C, F = hf.req("hidden_size"), hf.req("intermediate_size")
    if family.mlp == "plain":
        return functools.partial(FeedForward, C, F, hf.activation("hidden_act", ACTIVATIONS), bias=True, **kw)
    act = hf.activation("hidden_act", parts.GATED)
    if family.mlp == "gated":
        return parts.gated_mlp(C, F, act, bias=hf.get("mlp_bias", False, bool), **kw)

    def gte_mlp() -> nn.Module:  # gate/up without biases, down_proj with one (GTE 254-256)
        ffn = FeedForward(C, F, act, bias=False, dropout=hf.get("hidden_dropout_prob", 0.0, float), **kw)
        ffn.down_proj = nn.Linear(F, C, bias=True, **kw)
        return ffn
    return gte_mlp


def _blocks(hf: HFConfig, family: Family, kw: dict[str, Any]) -> list[nn.Module]:
    """The non-causal blocks: post-norm LayerNorm (GTE, Nomic, Jina) or pre-norm RMSNorm (EuroBERT),
    each attention with its rotary embedding."""
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    head_dim = hf.get("head_dim", C // H)
    drop_key = "attention_dropout" if family.pre_norm else "attention_probs_dropout_prob"
    attention = functools.partial(
        build_attention, "mha", C, H, num_kv_heads=hf.get("num_key_value_heads", H), head_dim=head_dim,
        bias=_attention_bias(hf, family), causal=False, rope=parts.rotary(hf, parts.rope_params(hf), head_dim),
        dropout=hf.get(drop_key, 0.0, float), **kw)
    norm = (parts.rms_norm(C, hf.req("rms_norm_eps", float), **kw) if family.pre_norm else
            functools.partial(nn.LayerNorm, C, eps=hf.req("layer_norm_eps", float), **kw))
    layers = BlockLayers(attention=attention, feed_forward=_feed_forward(hf, family, kw), norm=norm,
                         norm_first=family.pre_norm, dropout=hf.get("hidden_dropout_prob", 0.0, float))
    return [TransformerBlock(C, layers=layers) for _ in range(depth)]


def _mlm(hf: HFConfig, family: Family, embedding: TypedEmbedding, kw: dict[str, Any]) -> nn.Module:
    """The masked-LM head, its decoder tied to the token embedding by ``tie_word_embeddings``."""
    V, C = hf.req("vocab_size"), hf.req("hidden_size")
    if family.mlm == "linear":
        head: nn.Module = LMHead(C, V, bias=hf.get("mlp_bias", False, bool), **kw)
        decoder = head
    else:
        act = family.mlm_act or hf.get("hidden_act", "gelu", str)
        if act not in ACTIVATIONS:
            raise hf.unsupported(f"hidden_act={act!r} in the MLM head (supported: {sorted(ACTIVATIONS)})")
        head = FactorisedMLMHead(C, C, V, activation=ACTIVATIONS[act], eps=hf.req("layer_norm_eps", float), **kw)
        decoder = head.decoder
    if hf.get("tie_word_embeddings", False, bool):
        decoder.weight = embedding.tok.weight
    return head


def _classifier(hf: HFConfig, family: Family, num_labels: int, kw: dict[str, Any]) -> nn.Module:
    C = hf.req("hidden_size")
    if family.classifier == "eurobert":
        return EuroBertClassifier(C, num_labels, hf.req("classifier_pooling", str), **kw)
    dropout = hf.get("classifier_dropout", None, float)
    return FirstTokenClassifier(C, num_labels, dropout=hf.get("hidden_dropout_prob", 0.0, float) if dropout is None
                                else dropout, **kw)


def build_rope_bert(hf: HFConfig, heads: Heads, *, device: Any = None, dtype: Any = None) -> TransformerEncoder:
    """The encoder of the config's ``model_type`` with the ``heads`` of the checkpoint (random
    weights; see the module docstring)."""
    hf, family = canonical(hf)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    V, C, H = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_attention_heads")
    types = 0 if family.pre_norm else hf.get("type_vocab_size", 0)
    embed_norm = nn.Identity() if family.pre_norm else nn.LayerNorm(C, eps=hf.req("layer_norm_eps", float), **kw)
    embedding = TypedEmbedding(V, C, types, embed_norm, **kw)
    final = make_norm("rms", C, hf.req("rms_norm_eps", float), **kw) if family.pre_norm else nn.Identity()
    cfg = EncoderConfig(V, C, hf.req("num_hidden_layers"), H, max_seq_len=parts.max_positions(hf), pos="rope",
                        type_vocab_size=types, norm="rms" if family.pre_norm else "layer", norm_first=family.pre_norm,
                        dropout=0.0 if family.pre_norm else hf.get("hidden_dropout_prob", 0.0, float),
                        pooler=heads.pooler)
    encoder_parts = EncoderParts(
        embedding=embedding, blocks=_blocks(hf, family, kw), norm=final,
        mlm=_mlm(hf, family, embedding, kw) if heads.mlm else None,
        classifier=_classifier(hf, family, heads.num_labels, kw) if heads.num_labels else None)
    return TransformerEncoder(config=cfg, parts=encoder_parts, **kw)


def _heads(hf: HFConfig, family: Family, sd: Mapping[str, Tensor]) -> Heads:
    """The heads a checkpoint holds, read from its weights (a tied MLM decoder, absent from a saved
    folder, from ``architectures``)."""
    if any(re.search(r"lora_[AB]|parametrizations\.", k) for k in sd):
        raise hf.unsupported("task LoRA adapters in the checkpoint (merge one task's adapter into the weights "
                             "first, e.g. PEFT's merge_and_unload(), and convert the merged model)")
    prefix = family.prefix if any(k.startswith(family.prefix) for k in sd) else ""
    archs = [str(a) for a in hf.get("architectures", [], list)]
    mlm_key = "lm_head.weight" if family.mlm == "linear" else f"{_transform(family.mlm)}dense.weight"
    mlm = bool(prefix) and (mlm_key in sd or any(a.endswith("ForMaskedLM") for a in archs))
    seq_key = {"pooler": f"{prefix}pooler.dense.weight", "roberta": "classifier.dense.weight",
               "eurobert": "dense.weight"}[family.classifier]
    out_key = "classifier.out_proj.weight" if family.classifier == "roberta" else "classifier.weight"
    num_labels = int(sd[out_key].shape[0]) if prefix and out_key in sd and seq_key in sd else 0
    if prefix and "classifier.weight" in sd and not num_labels:
        raise hf.unsupported("a token-classification head (classifier.weight on every token)")
    pooler = f"{prefix}pooler.dense.weight" in sd and not (num_labels and family.classifier == "pooler")
    return Heads(prefix, pooler, mlm, num_labels)


def _put_layer(plan: Plan, family: Family, hf: HFConfig, i: int) -> None:
    o, h = f"blocks.{i}.", f"layers.{i}."
    bias = _attention_bias(hf, family)
    parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias)
    if family.mlp == "plain":
        plan.put_pairs(f"{o}ffn.", f"{h}mlp.", [("up_proj", "fc1"), ("down_proj", "fc2")])
    elif family.mlp == "gated":
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.", bias=hf.get("mlp_bias", False, bool))
    else:
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put(f"{o}ffn.down_proj.bias", f"{h}mlp.down_proj.bias")
    norms = parts.PRE_NORMS if family.pre_norm else (("attn_norm", "post_attention_layernorm"),
                                                     ("ffn_norm", "post_mlp_layernorm"))
    plan.put_pairs(o, h, norms, bias=not family.pre_norm)


def _put_mlm(plan: Plan, family: Family, hf: HFConfig, ignore: list[str]) -> None:
    """The MLM head's weights; a tied decoder weight is the token embedding's (the checkpoint's copy
    ignored), a decoder bias tied to ``{head}bias`` read from there (the untied ``{head}bias`` is
    unused by transformers' forward and ignored)."""
    tied = hf.get("tie_word_embeddings", False, bool)
    if family.mlm == "linear":
        if not tied:
            plan.put("mlm.weight", "lm_head.weight")
        if hf.get("mlp_bias", False, bool):
            plan.put("mlm.bias", "lm_head.bias")
        ignore.append(r"lm_head\.weight")
        return
    head = family.mlm
    plan.put_pairs("mlm.", _transform(head), [("transform", "dense"), ("norm", "layer_norm")])
    if not tied:
        plan.put("mlm.decoder.weight", f"{head}decoder.weight")
    shared = tied and plan.src.has(f"{head}bias")
    plan.put("mlm.decoder.bias", f"{head}bias" if shared else f"{head}decoder.bias")
    ignore += [re.escape(f"{head}decoder.weight"), re.escape(f"{head}decoder.bias"), re.escape(f"{head}bias")]


def _put_classifier(plan: Plan, family: Family, prefix: str) -> None:
    if family.classifier == "pooler":
        plan.put_pairs("classifier.", "", [("dense", f"{prefix}pooler.dense"), ("out_proj", "classifier")])
    elif family.classifier == "roberta":
        plan.put_pairs("classifier.", "classifier.", [("dense", "dense"), ("out_proj", "out_proj")])
    else:
        plan.put_pairs("classifier.", "", [("dense", "dense"), ("classifier", "classifier")])


def convert_rope_bert(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> TransformerEncoder:
    """Build the encoder (the heads from the checkpoint's weights) and copy every weight."""
    hf, family = canonical(hf)
    sd = transformers_names(hf.raw("model_type"), sd)
    heads = _heads(hf, family, sd)
    model = build_rope_bert(hf, heads, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(Source(sd, heads.prefix), family.name)
    if family.pre_norm:
        plan.put("embedding.tok.weight", "embed_tokens.weight")
        plan.put("norm.weight", "norm.weight")
    else:
        plan.put("embedding.tok.weight", "embeddings.word_embeddings.weight")
        if model.embedding.types is not None:
            plan.put("embedding.types.weight", "embeddings.token_type_embeddings.weight")
        plan.put_pairs("embedding.", "embeddings.", [("norm", "LayerNorm")])
    for i in range(model.depth):
        _put_layer(plan, family, hf, i)
    if heads.pooler:
        plan.put_pairs("", "", [("pooler", "pooler.dense")])
    plan.src.prefix = ""
    ignore = [r"(\w+\.)?rotary_emb\.\w+", r"(\w+\.)?embeddings\.(position_ids|token_type_ids)"]
    if heads.mlm:
        _put_mlm(plan, family, hf, ignore)
    if heads.num_labels:
        _put_classifier(plan, family, heads.prefix)
    plan.apply(model, ignore=ignore)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {t: parts.Dispatch(f.name, convert_rope_bert, f.classes) for t, f in FAMILIES.items()}
