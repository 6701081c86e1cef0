"""RoBERTa and its relatives -> :class:`~attnzoo.TransformerEncoder`: ``roberta`` (RoBERTa),
``xlm-roberta`` (XLM-R; BGE-M3, multilingual E5 and the bge-reranker cross-encoders are
``XLMRobertaModel`` / ``XLMRobertaForSequenceClassification``), ``camembert``,
``roberta-prelayernorm`` and ``xlm-roberta-xl``, each as ``*Model`` (with its pooler when the
checkpoint has one), ``*ForMaskedLM`` and ``*ForSequenceClassification``. Line numbers:
transformers 5.25's ``models/roberta/modeling_roberta.py`` (XLM-R and CamemBERT are the same code,
``modular_*.py``), ``models/roberta_prelayernorm/modeling_roberta_prelayernorm.py`` (PLN) and
``models/xlm_roberta_xl/modeling_xlm_roberta_xl.py`` (XL).

BERT's encoder (its layers are BERT's, post-norm, mapped by :func:`attnzoo.models.hf.bert.put_layer`)
with three differences, each an :class:`~attnzoo.models.EncoderParts` part:

* positions come from the **token ids**, not from the attention mask (57-155): a token equal to
  ``pad_token_id`` (``padding_idx``) gets position ``padding_idx``, every other token
  ``padding_idx + `` the number of non-pad tokens up to and with it (MPNet's
  :func:`~attnzoo.models.families.mpnet.padding_offset_positions`). A masked-out token whose id is not the pad id is counted, a real token equal to the pad id is
  not: the mask only hides keys (:class:`~attnzoo.models.families.mpnet.PaddingOffsetEmbedding`);
* the sequence classifier reads the first position whatever the mask (a left-padded row reads a
  pad), ``out_proj(tanh(dense(h[:, 0])))``, no pooler (1149-1168; MPNet's
  :class:`~attnzoo.models.encoder.FirstTokenClassifier`, MPNet's head being RoBERTa's);
* the masked-LM head ``lm_head`` is BERT's shape with an exact GELU whatever ``hidden_act``
  (879-898): ``decoder(layer_norm(gelu(dense(h))))``, the decoder tied to the word embeddings and
  its bias to ``lm_head.bias`` (``tie_word_embeddings``, 798-802); untied, transformers' forward
  uses ``lm_head.decoder.weight`` and ``lm_head.decoder.bias`` (``lm_head.bias`` is then unused).

RoBERTa-PreLayerNorm normalises before each sub-layer (``attention.LayerNorm``,
``intermediate.LayerNorm``; PLN 340-386) after the embedding LayerNorm, and once more at the end
(the model's ``LayerNorm``, PLN 664). XLM-R-XL has no embedding LayerNorm (XL 62-120), normalises
before each sub-layer (``attention.self_attn_layer_norm``, the layer's ``LayerNorm``; XL 343-467)
and at the end (``encoder.LayerNorm``, XL 499); its defaults differ (``layer_norm_eps`` 1e-5,
514 positions, one token type).

Refused by name: ``position_embedding_type`` other than ``"absolute"`` (transformers 5.25 no longer
reads it; the relative kinds the checkpoint was trained with are gone), ``is_decoder`` /
``add_cross_attention``, a ``hidden_act`` attnzoo has no FFN for, ``pad_token_id: null``
(transformers cannot count positions without it). The other ``*For*`` heads (token
classification, QA, multiple choice) are ignored with a ``UserWarning`` naming their weights, as
BERT's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo.models.encoder import FactorisedMLMHead, FirstTokenClassifier, TransformerEncoder
from attnzoo.models.families.bert_kin import apply_encoder_plan
from attnzoo.models.families.mpnet import PaddingOffsetEmbedding, plan_heads
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.hf.bert import BERT_LAYER, _layer, bert_config, put_layer
from attnzoo.models.parts import EncoderParts

__all__ = ["DEFAULTS", "DISPATCH", "VARIANTS", "Variant", "build_roberta", "convert_roberta"]

#: the config classes' defaults of the keys read here (``configuration_*.py``) that a ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50265, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512, "type_vocab_size": 2,
    "layer_norm_eps": 1e-12, "pad_token_id": 1, "tie_word_embeddings": True}


@dataclass(frozen=True)
class Variant:
    """One ``model_type`` of the family: its name, the base model's attribute (the weights'
    prefix under a head), the transformers classes, the checkpoint names of the pre-norm layers'
    two norms (``None``: post-norm, BERT's layer), whether the embeddings are normalised, the
    final norm's checkpoint name (``None``: none) and the config defaults."""

    name: str
    prefix: str
    classes: tuple[str, ...]
    pre_norms: tuple[str, str] | None = None
    embed_norm: bool = True
    final_norm: str | None = None
    defaults: tuple[tuple[str, Any], ...] = ()


def _classes(stem: str) -> tuple[str, ...]:
    return tuple(f"{stem}{head}" for head in ("Model", "ForMaskedLM", "ForSequenceClassification"))


VARIANTS: dict[str, Variant] = {
    "roberta": Variant("RoBERTa", "roberta", _classes("Roberta")),
    "xlm-roberta": Variant("XLM-RoBERTa", "roberta", _classes("XLMRoberta"), defaults=(("vocab_size", 30522),)),
    "camembert": Variant("CamemBERT", "roberta", _classes("Camembert"), defaults=(("vocab_size", 30522),)),
    "roberta-prelayernorm": Variant("RoBERTa-PreLayerNorm", "roberta_prelayernorm", _classes("RobertaPreLayerNorm"),
                                    ("attention.LayerNorm", "intermediate.LayerNorm"), final_norm="LayerNorm"),
    "xlm-roberta-xl": Variant(
        "XLM-RoBERTa-XL", "roberta", _classes("XLMRobertaXL"), ("attention.self_attn_layer_norm", "LayerNorm"),
        embed_norm=False, final_norm="encoder.LayerNorm", defaults=(
            ("vocab_size", 250880), ("hidden_size", 2560), ("num_hidden_layers", 36), ("num_attention_heads", 32),
            ("intermediate_size", 10240), ("max_position_embeddings", 514), ("type_vocab_size", 1),
            ("layer_norm_eps", 1e-5))),
}


def _read(hf: HFConfig, v: Variant) -> HFConfig:
    """``hf`` with the variant's defaults, ``pad_token_id: null`` refused."""
    if "pad_token_id" in hf.data and hf.data["pad_token_id"] is None:
        raise hf.unsupported("pad_token_id=None (the positions count the tokens that are not pad_token_id)")
    return hf.with_defaults({**DEFAULTS, **dict(v.defaults)})


def build_roberta(hf: HFConfig, v: Variant, *, pooler: bool = False, num_labels: int = 0, mlm: bool = False,
                  tied: bool = True, device: Any = None, dtype: Any = None) -> TransformerEncoder:
    """The encoder of a config read with the variant's defaults: BERT's blocks (post-norm, or
    pre-norm with a final norm), a :class:`~attnzoo.models.families.mpnet.PaddingOffsetEmbedding`, BERT's pooler if ``pooler``, a
    ``FirstTokenClassifier`` of ``num_labels`` and the masked-LM head (exact GELU; decoder
    ``tied`` to the token embedding or its own) as asked."""
    pre = v.pre_norms is not None
    cfg = bert_config(hf, pooler=pooler).replace(pos="none", embed_norm=False, norm_first=pre, final_norm=pre)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    embedding = PaddingOffsetEmbedding(cfg.vocab_size, cfg.dim, cfg.max_seq_len, cfg.type_vocab_size,
                                       padding_idx=hf.get("pad_token_id", 1),
                                       norm_eps=cfg.norm_eps if v.embed_norm else None, **kw)
    head = FactorisedMLMHead(cfg.dim, cfg.dim, cfg.vocab_size, activation="gelu", eps=cfg.norm_eps, **kw) if mlm else None
    if head is not None and tied:
        head.decoder.weight = embedding.tok_emb.weight
    classifier = FirstTokenClassifier(cfg.dim, num_labels, **kw) if num_labels else None
    return TransformerEncoder(config=cfg, parts=EncoderParts(embedding=embedding, mlm=head, classifier=classifier),
                              **kw)


def convert_roberta(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any,
                    model_type: str = "roberta") -> TransformerEncoder:
    """Build the ``model_type`` variant and copy the weights; the heads follow the weights (a
    ``{prefix}.`` base model with ``classifier.out_proj`` / ``lm_head.dense``). The other task
    heads are ignored, listed in a ``UserWarning``."""
    v = VARIANTS[model_type]
    hf = _read(hf, v)
    prefix = f"{v.prefix}." if any(k.startswith(f"{v.prefix}.") for k in sd) else ""
    labels = sd.get("classifier.out_proj.weight") if prefix else None
    tied = hf.get("tie_word_embeddings", True, bool)
    src = Source(sd, prefix)
    model = build_roberta(hf, v, pooler=src.has("pooler.dense.weight"),
                          num_labels=0 if labels is None else int(labels.shape[0]),
                          mlm=bool(prefix) and "lm_head.dense.weight" in sd, tied=tied, device=device,
                          dtype=dtype or float_dtype(sd))
    plan = Plan(src, v.name)
    plan.put_pairs("embedding.", "embeddings.", [("tok_emb", "word_embeddings"), ("pos_emb", "position_embeddings"),
                                                 ("type_emb", "token_type_embeddings")], bias=False)
    if v.embed_norm:
        plan.put_pairs("embedding.", "embeddings.", [("norm", "LayerNorm")])
    for i in range(model.depth):
        if v.pre_norms is None:
            _layer(plan, i)
        else:
            put_layer(plan, f"blocks.{i}.", f"encoder.layer.{i}.", (*BERT_LAYER[:4], v.pre_norms[0], *BERT_LAYER[5:7],
                                                                    v.pre_norms[1]))
    if v.final_norm is not None:
        plan.put_pairs("", "", [("norm", v.final_norm)])
    if model.pooler is not None:
        plan.put_pairs("", "", [("pooler", "pooler.dense")])
    ignore = plan_heads(plan, hf, sd, model, tied)  # MPNet's heads are RoBERTa's (same names, same ties)
    plan.src.prefix = prefix
    return apply_encoder_plan(plan, model, hf, ignore)  # BERT-kin's: other task heads warned about and ignored

DISPATCH = {t: parts.Dispatch(v.name, functools.partial(convert_roberta, model_type=t), v.classes)
            for t, v in VARIANTS.items()}
