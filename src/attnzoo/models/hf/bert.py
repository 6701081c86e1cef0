"""BERT (``BertModel`` and the encoder of ``BertFor*``) -> :class:`~attnzoo.TransformerEncoder`.

BERT is post-norm with an embedding LayerNorm, exact GELU and learned absolute positions; the
pooler (``tanh(Linear(hidden[:, 0]))``) is kept when the checkpoint has one.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnzoo.models.config import EncoderConfig
from attnzoo.models.encoder import TransformerEncoder
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype, load_qkv_into

__all__ = ["ACTIVATIONS", "BERT_LAYER", "bert_config", "convert_bert", "put_layer"]

#: Hugging Face activation names -> :class:`attnzoo.FeedForward` activations.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}


def bert_config(hf: HFConfig, *, pooler: bool, num_labels: int = 0, mlm_head: bool = False) -> EncoderConfig:
    """The :class:`EncoderConfig` of a BERT config (``pooler``, ``num_labels``, ``mlm_head``: the
    checkpoint has a pooler, a sequence classifier of that many labels, a masked-LM head)."""
    if hf.get("position_embedding_type", "absolute", str) != "absolute":
        raise hf.unsupported(f"position_embedding_type={hf.raw('position_embedding_type')!r}")
    if hf.get("is_decoder", False, bool) or hf.get("add_cross_attention", False, bool):
        raise hf.unsupported("a BERT decoder (is_decoder/add_cross_attention)")
    return EncoderConfig(
        hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers"), hf.req("num_attention_heads"),
        max_seq_len=hf.get("max_position_embeddings", 512), pos="learned",
        type_vocab_size=hf.get("type_vocab_size", 2), norm="layer", norm_eps=hf.get("layer_norm_eps", 1e-12, float),
        norm_first=False, embed_norm=True, final_norm=False, ffn=hf.activation("hidden_act", ACTIVATIONS),
        ffn_hidden=hf.req("intermediate_size"), pooler=pooler, num_labels=num_labels, mlm_head=mlm_head)


#: BERT's names of a layer's eight sub-modules (q, k, v, output, attention norm, FFN up, FFN down, FFN norm)
BERT_LAYER = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
              "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")


def put_layer(plan: Plan, ours: str, theirs: str, names: tuple[str, ...] = BERT_LAYER) -> None:
    """Map a BERT-shaped layer at ``theirs`` (its eight sub-module ``names``, :data:`BERT_LAYER`'s
    order, all with biases; pre- or post-norm alike) onto the :class:`~attnzoo.TransformerBlock` at
    ``ours``: q/k/v fused into ``attn.qkv_proj``, then ``attn.out_proj``, ``attn_norm``, the FFN, ``ffn_norm``."""
    q, k, v, out, attn_norm, up, down, ffn_norm = names
    load_qkv_into(plan, ours + "attn", tuple(f"{theirs}{n}.weight" for n in (q, k, v)),
                  tuple(f"{theirs}{n}.bias" for n in (q, k, v)), True)
    plan.put_pairs(ours, theirs, [("attn.out_proj", out), ("attn_norm", attn_norm), ("ffn.up_proj", up),
                                  ("ffn.down_proj", down), ("ffn_norm", ffn_norm)])


def _layer(plan: Plan, i: int) -> None:
    put_layer(plan, f"blocks.{i}.", f"encoder.layer.{i}.")


def convert_bert(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any,
                 strict_prefix: bool = False) -> TransformerEncoder:
    """Build the encoder and copy the weights (a ``bert.`` prefix is stripped unless
    ``strict_prefix``). Of the task heads of ``BertFor*``, the sequence classifier (on the pooled
    output) and the masked-LM head are loaded (:meth:`~attnzoo.TransformerEncoder.classify`,
    :meth:`~attnzoo.TransformerEncoder.mlm_logits`); the others (token classification, QA,
    next-sentence) are ignored and listed in a ``UserWarning``."""
    prefix = "bert." if not strict_prefix and any(k.startswith("bert.") for k in sd) else ""
    src = Source(sd, prefix)
    pooler = src.has("pooler.dense.weight")
    num_labels = int(sd["classifier.weight"].shape[0]) if prefix and pooler and "classifier.weight" in sd else 0
    mlm = bool(prefix) and "cls.predictions.transform.dense.weight" in sd
    cfg = bert_config(hf, pooler=pooler, num_labels=num_labels, mlm_head=mlm)
    model = TransformerEncoder.from_config(cfg, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(src, "BERT")
    plan.put("tok_emb.weight", "embeddings.word_embeddings.weight")
    plan.put("pos_emb.weight", "embeddings.position_embeddings.weight")
    if model.type_emb is not None:
        plan.put("type_emb.weight", "embeddings.token_type_embeddings.weight")
    plan.put_pairs("", "embeddings.", [("embed_norm", "LayerNorm")])
    for i in range(cfg.depth):
        _layer(plan, i)
    if cfg.pooler:
        plan.put_pairs("", "", [("pooler", "pooler.dense")])
    plan.src.prefix = ""
    if num_labels:
        plan.put_pairs("", "", [("classifier", "classifier")])
    if mlm:
        plan.put_pairs("mlm.", "cls.predictions.", [("transform", "transform.dense"), ("norm", "transform.LayerNorm")])
        plan.put("mlm.decoder.bias", "cls.predictions.bias")
    # position_ids is a non-persistent buffer in recent versions but present in older files; the
    # MLM decoder's weight and bias are the (tied) word embeddings and cls.predictions.bias.
    plan.apply_base(model, prefix=prefix, source=hf.source,
                    ignore=[r"(bert\.)?embeddings\.position_ids", r"cls\.predictions\.decoder\.(weight|bias)"])
    return model
