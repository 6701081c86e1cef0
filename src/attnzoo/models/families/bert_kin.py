"""DistilBERT, ELECTRA and ALBERT -> :class:`~attnzoo.TransformerEncoder`: BERT's post-norm encoder
with another embedding, weight layout or head.

* **DistilBERT** (``distilbert``; ``transformers/models/distilbert/modeling_distilbert.py``): BERT's
  layers (``q_lin``/``k_lin``/``v_lin``/``out_lin``, ``sa_layer_norm``, ``ffn.lin1``/``lin2``,
  ``output_layer_norm``, all LayerNorms at eps ``1e-12``, lines 80-250) without token types; the
  sequence classifier is ``classifier(relu(pre_classifier(hidden[:, 0])))`` (lines 560-575).
  ``sinusoidal_pos_embds=True`` only changes how transformers *initialises* the position table
  (lines 60-75, 300-315): the table is a stored parameter, loaded as it is, so it is reproduced.
* **ELECTRA** (``electra``; ``modeling_electra.py``): BERT's layers and names; the embeddings are
  ``embedding_size`` wide (``E``) and projected to ``hidden_size`` by ``embeddings_project`` after
  their LayerNorm when ``E != C`` (lines 550-560, 600-605). ``ElectraModel`` is the discriminator's
  encoder; the generator's masked-LM head is ``lm_head(norm(gelu(dense(hidden))))`` through width ``E``
  (always exact GELU, lines 488-505), the classifier ``out_proj(gelu(dense(hidden[:, 0])))`` (lines
  675-697).
* **ALBERT** (``albert``; ``modeling_albert.py``): ``E``-wide embeddings projected by
  ``encoder.embedding_hidden_mapping_in`` (lines 258-285), then ``num_hidden_layers`` applications of
  ``num_hidden_groups`` shared layer groups of ``inner_group_num`` layers each (layer ``i`` runs group
  ``int(i / (L / G))``): the blocks of the encoder are the same modules repeated (``L * K`` of them,
  ``G * K`` distinct), as the weights are shared; BERT's tanh pooler and classifier; the masked-LM
  head is ALBERT's ``decoder(norm(act(dense(hidden))))`` through width ``E`` (lines 511-530).

The heads follow the weights: ``*Model`` (no prefix) gives the encoder (ALBERT: with its pooler),
``*ForMaskedLM`` also :meth:`~attnzoo.TransformerEncoder.mlm_logits`, ``*ForSequenceClassification``
also :meth:`~attnzoo.TransformerEncoder.classify`; the decoder of the masked-LM head is tied to the
token embeddings unless ``tie_word_embeddings`` is false. Other task heads (token classification,
question answering, multiple choice, ELECTRA's discriminator and ALBERT's sentence-order heads)
are ignored and named in a ``UserWarning``, the encoder loaded. Refused by name: a decoder or cross-
attention (``is_decoder``, ``add_cross_attention``), a ``position_embedding_type`` other than
``absolute``, activations outside :data:`~attnzoo.models.hf.bert.ACTIVATIONS`, ALBERT with more layer
groups than layers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.hf.bert as bert
from attnzoo._validate import check_int
from attnzoo.blocks import TransformerBlock
from attnzoo.models.config import EncoderConfig
from attnzoo.models.encoder import FactorisedMLMHead, FirstTokenClassifier, TransformerEncoder
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.parts import EncoderParts, PackedFromZero
from attnzoo.nn.positional import LearnedPositionalEmbedding

__all__ = ["ALBERT_LAYER", "DEFAULTS", "DISPATCH", "DISTILBERT_LAYER", "FactorisedEmbedding", "albert_blocks", "apply_encoder_plan", "convert_albert", "convert_distilbert", "convert_electra"]

#: transformers' config defaults (``configuration_<name>.py``) for a ``config.json`` that leaves them out
DEFAULTS: dict[str, dict[str, Any]] = {
    "distilbert": {"vocab_size": 30522, "max_position_embeddings": 512, "sinusoidal_pos_embds": False, "n_layers": 6,
                   "n_heads": 12, "dim": 768, "hidden_dim": 3072, "activation": "gelu", "tie_word_embeddings": True},
    "electra": {"vocab_size": 30522, "embedding_size": 128, "hidden_size": 256, "num_hidden_layers": 12,
                "num_attention_heads": 4, "intermediate_size": 1024, "hidden_act": "gelu",
                "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
                "tie_word_embeddings": True},
    "albert": {"vocab_size": 30000, "embedding_size": 128, "hidden_size": 4096, "num_hidden_layers": 12,
               "num_hidden_groups": 1, "num_attention_heads": 64, "intermediate_size": 16384, "inner_group_num": 1,
               "hidden_act": "gelu_new", "max_position_embeddings": 512, "type_vocab_size": 2,
               "layer_norm_eps": 1e-12, "tie_word_embeddings": True},
}

#: a BERT-shaped post-norm layer's checkpoint names: q, k, v, attention output, its norm, FFN up,
#: FFN down, FFN norm (DistilBERT's ``TransformerBlock``, modeling_distilbert.py 200-245)
DISTILBERT_LAYER = ("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin", "sa_layer_norm",
                    "ffn.lin1", "ffn.lin2", "output_layer_norm")
#: the same for ALBERT's ``AlbertLayer`` (modeling_albert.py 138-238)
ALBERT_LAYER = ("attention.query", "attention.key", "attention.value", "attention.dense", "attention.LayerNorm",
                "ffn", "ffn_output", "full_layer_layer_norm")
#: transformers' distilbert LayerNorms are built with this epsilon, whatever the config says
DISTILBERT_EPS = 1e-12
#: checkpoint tensors that are not weights (older files stored the position / type id buffers)
_BUFFERS = r"([a-z_]+\.)?embeddings\.(position_ids|token_type_ids)"


class FactorisedEmbedding(PackedFromZero, nn.Module):
    """BERT's input embedding at its own width ``E``, optionally projected to the model width ``C``:
    ``project(norm(tok(tokens) + types(token_type_ids) + pos(positions)))`` (ELECTRA's
    ``embeddings`` + ``embeddings_project``, ALBERT's ``embeddings`` + ``embedding_hidden_mapping_in``;
    DistilBERT's without types or projection).

    Args:
        vocab_size, width: vocabulary ``V`` and embedding width ``E``.
        max_len: positions of the learned table.
        type_vocab_size: token types (0: none, DistilBERT).
        eps: the LayerNorm's epsilon.
        dim: the model width ``C`` the embeddings are projected to (``Linear(E, C)`` with bias), or
            ``None`` for no projection.

    Weights: ``tok.weight [V, E]``, ``pos.weight [max_len, E]``, ``types.weight [T, E]``, ``norm``,
    ``project [C, E]``. Shapes: ``tokens [B, N]``, ``token_type_ids [B, N] | None`` (default type 0),
    ``positions [N] | [B, N] | None`` (default ``0..N-1``) -> ``[B, N, C]``.
    """

    def __init__(self, vocab_size: int, width: int, max_len: int, type_vocab_size: int, *, eps: float,
                 dim: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.tok = nn.Embedding(vocab_size, width, **kw)
        self.pos = LearnedPositionalEmbedding(width, max_len, **kw)
        self.types = nn.Embedding(type_vocab_size, width, **kw) if type_vocab_size else None
        self.norm = nn.LayerNorm(width, eps=eps, **kw)
        self.project = nn.Linear(width, dim, **kw) if dim is not None else None

    def forward(self, tokens: Tensor, token_type_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        x = self.tok(tokens)  # [B, N, E]
        if self.types is not None:
            x = x + (self.types.weight[0] if token_type_ids is None else self.types(token_type_ids))
        x = self.norm(self.pos(x, positions))
        return x if self.project is None else self.project(x)  # [B, N, C]


def albert_blocks(cfg: EncoderConfig, groups: int, inner: int, depth: int, *, device: Any,
                  dtype: Any) -> tuple[list[nn.Module], dict[tuple[int, int], int]]:
    """ALBERT's ``depth * inner`` blocks: ``groups * inner`` distinct post-norm blocks, layer ``i``
    running group ``int(i / (depth / groups))`` (modeling_albert.py 270-280) so the same module repeats;
    also ``(group, layer in group) -> index of its first use`` (the name its weights have)."""
    owner = "albert_blocks"
    check_int(depth, "depth", owner)
    check_int(inner, "inner", owner)
    if check_int(groups, "groups", owner) > depth:
        raise ValueError(f"{owner}: groups={groups} > depth={depth}: groups that never run")
    made = [[TransformerBlock(config=TransformerEncoder.block_config(cfg), device=device, dtype=dtype)
             for _ in range(inner)] for _ in range(groups)]
    blocks: list[nn.Module] = []
    first: dict[tuple[int, int], int] = {}
    for i in range(depth):
        g = int(i / (depth / groups))
        for j in range(inner):
            first.setdefault((g, j), len(blocks))
            blocks.append(made[g][j])
    return blocks, first


def _prefix(sd: Mapping[str, Tensor], prefix: str) -> str:
    return prefix if any(k.startswith(prefix) for k in sd) else ""


def _tie(hf: HFConfig, model: TransformerEncoder, ignore: list[str], key: str) -> bool:
    """Tie the masked-LM decoder to the token embedding when the config ties them (``key``, the
    checkpoint's copy, then ignored); returns whether it did."""
    if not hf.get("tie_word_embeddings", True, bool):
        return False
    assert model.embedding is not None and model.mlm is not None  # built by the converters
    model.mlm.decoder.weight = model.embedding.tok.weight
    ignore.append(re.escape(key))
    return True


def _put_embedding(plan: Plan, types: bool, project: str | None) -> None:
    plan.put("embedding.tok.weight", "embeddings.word_embeddings.weight")
    plan.put("embedding.pos.weight", "embeddings.position_embeddings.weight")
    if types:
        plan.put("embedding.types.weight", "embeddings.token_type_embeddings.weight")
    plan.put_pairs("embedding.", "embeddings.", [("norm", "LayerNorm")])
    if project is not None:
        plan.put_pairs("embedding.", "", [("project", project)])


def _put_heads(plan: Plan, hf: HFConfig, model: TransformerEncoder, ignore: list[str], mlm: tuple[str, str, str],
               classifier: tuple[str, str]) -> None:
    """The :class:`FactorisedMLMHead` (checkpoint names of its transform, norm and decoder; the decoder
    weight tied or not, :func:`_tie`) and the :class:`FirstTokenClassifier` (dense, output) where the
    model has them, read outside the base model's prefix."""
    prefix, plan.src.prefix = plan.src.prefix, ""
    if model.mlm is not None:
        transform, norm, decoder = mlm
        plan.put_pairs("mlm.", "", [("transform", transform), ("norm", norm)])
        plan.put("mlm.decoder.bias", f"{decoder}.bias")
        if not _tie(hf, model, ignore, f"{decoder}.weight"):
            plan.put("mlm.decoder.weight", f"{decoder}.weight")
    if model.classifier is not None:
        plan.put_pairs("classifier.", "", [("dense", classifier[0]), ("out_proj", classifier[1])])
    plan.src.prefix = prefix


def apply_encoder_plan(plan: Plan, model: TransformerEncoder, hf: HFConfig,
                       ignore: list[str]) -> TransformerEncoder:
    """Check and copy the plan, the task heads attnzoo has no equivalent for warned about and left
    out (:meth:`~attnzoo.models.hf._state.Plan.apply_base`)."""
    plan.apply_base(model, prefix=plan.src.prefix, source=hf.source, ignore=[*ignore, _BUFFERS])
    return model


def convert_distilbert(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> TransformerEncoder:
    """``DistilBertModel`` / ``DistilBertForMaskedLM`` / ``DistilBertForSequenceClassification`` ->
    :class:`~attnzoo.TransformerEncoder` (see the module docstring)."""
    hf = hf.with_defaults(DEFAULTS["distilbert"])
    V, C, act = hf.req("vocab_size"), hf.req("dim"), hf.activation("activation", bert.ACTIVATIONS)
    cfg = EncoderConfig(V, C, hf.req("n_layers"), hf.req("n_heads"), max_seq_len=hf.req("max_position_embeddings"),
                        norm="layer", norm_eps=DISTILBERT_EPS, norm_first=False, final_norm=False, ffn=act,
                        ffn_hidden=hf.req("hidden_dim"))
    prefix = _prefix(sd, "distilbert.")
    kw: dict[str, Any] = {"device": device, "dtype": dtype or float_dtype(sd)}
    mlm = FactorisedMLMHead(C, C, V, activation=act, eps=DISTILBERT_EPS, **kw) \
        if prefix and "vocab_transform.weight" in sd else None
    classifier = FirstTokenClassifier(C, int(sd["classifier.weight"].shape[0]), activation="relu", **kw) \
        if prefix and "pre_classifier.weight" in sd else None
    embedding = FactorisedEmbedding(V, C, cfg.max_seq_len, 0, eps=DISTILBERT_EPS, **kw)
    model = TransformerEncoder(config=cfg, parts=EncoderParts(embedding=embedding, mlm=mlm, classifier=classifier),
                               **kw)
    plan, ignore = Plan(Source(sd, prefix), "DistilBERT"), []
    _put_embedding(plan, types=False, project=None)
    for i in range(cfg.depth):
        bert.put_layer(plan, f"blocks.{i}.", f"transformer.layer.{i}.", DISTILBERT_LAYER)
    _put_heads(plan, hf, model, ignore, ("vocab_transform", "vocab_layer_norm", "vocab_projector"),
               ("pre_classifier", "classifier"))
    return apply_encoder_plan(plan, model, hf, ignore)


def convert_electra(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> TransformerEncoder:
    """``ElectraModel`` (the discriminator's encoder) / ``ElectraForMaskedLM`` (the generator) /
    ``ElectraForSequenceClassification`` -> :class:`~attnzoo.TransformerEncoder` (see the module docstring)."""
    hf = hf.with_defaults(DEFAULTS["electra"])
    cfg = bert.bert_config(hf, pooler=False)
    V, C, E = cfg.vocab_size, cfg.dim, hf.req("embedding_size")
    prefix = _prefix(sd, "electra.")
    kw: dict[str, Any] = {"device": device, "dtype": dtype or float_dtype(sd)}
    mlm = FactorisedMLMHead(C, E, V, activation="gelu", eps=cfg.norm_eps, **kw) \
        if prefix and "generator_predictions.dense.weight" in sd else None
    classifier = FirstTokenClassifier(C, int(sd["classifier.out_proj.weight"].shape[0]), activation="gelu", **kw) \
        if prefix and "classifier.dense.weight" in sd else None
    embedding = FactorisedEmbedding(V, E, cfg.max_seq_len, cfg.type_vocab_size, eps=cfg.norm_eps,
                                    dim=C if E != C else None, **kw)
    model = TransformerEncoder(config=cfg, parts=EncoderParts(embedding=embedding, mlm=mlm, classifier=classifier),
                               **kw)
    plan, ignore = Plan(Source(sd, prefix), "ELECTRA"), []
    _put_embedding(plan, types=True, project="embeddings_project" if E != C else None)
    for i in range(cfg.depth):
        bert._layer(plan, i)
    _put_heads(plan, hf, model, ignore, ("generator_predictions.dense", "generator_predictions.LayerNorm",
                                         "generator_lm_head"), ("classifier.dense", "classifier.out_proj"))
    return apply_encoder_plan(plan, model, hf, ignore)


def _albert_mlm(plan: Plan, hf: HFConfig, model: TransformerEncoder, ignore: list[str]) -> None:
    """ALBERT's ``predictions.*``; tied, the decoder's bias is ``predictions.bias`` (``decoder.bias``
    is the same tensor, left out of saved folders), untied it is ``decoder.bias`` (``predictions.bias``
    unused by transformers' forward, ignored)."""
    plan.put_pairs("mlm.", "predictions.", [("transform", "dense"), ("norm", "LayerNorm")])
    if _tie(hf, model, ignore, "predictions.decoder.weight"):
        plan.put("mlm.decoder.bias", "predictions.bias")
        ignore.append(r"predictions\.decoder\.bias")
    else:
        plan.put_pairs("mlm.", "predictions.", [("decoder", "decoder")])
        ignore.append(r"predictions\.bias")


def convert_albert(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> TransformerEncoder:
    """``AlbertModel`` / ``AlbertForMaskedLM`` / ``AlbertForSequenceClassification`` ->
    :class:`~attnzoo.TransformerEncoder` with shared blocks (see the module docstring)."""
    hf = hf.with_defaults(DEFAULTS["albert"])
    depth, groups, inner = hf.req("num_hidden_layers"), hf.req("num_hidden_groups"), hf.req("inner_group_num")
    if groups > depth:
        raise hf.unsupported(f"num_hidden_groups={groups} > num_hidden_layers={depth} (groups never run)")
    prefix = _prefix(sd, "albert.")
    pooler = Source(sd, prefix).has("pooler.weight")
    num_labels = int(sd["classifier.weight"].shape[0]) if prefix and pooler and "classifier.weight" in sd else 0
    cfg = bert.bert_config(hf, pooler=pooler, num_labels=num_labels).replace(depth=depth * inner)
    V, C, E = cfg.vocab_size, cfg.dim, hf.req("embedding_size")
    kw: dict[str, Any] = {"device": device, "dtype": dtype or float_dtype(sd)}
    mlm = FactorisedMLMHead(C, E, V, activation=cfg.ffn, eps=cfg.norm_eps, **kw) \
        if prefix and "predictions.dense.weight" in sd else None
    blocks, first = albert_blocks(cfg, groups, inner, depth, **kw)
    embedding = FactorisedEmbedding(V, E, cfg.max_seq_len, cfg.type_vocab_size, eps=cfg.norm_eps, dim=C, **kw)
    model = TransformerEncoder(config=cfg, parts=EncoderParts(embedding=embedding, blocks=blocks, mlm=mlm), **kw)
    plan, ignore = Plan(Source(sd, prefix), "ALBERT"), []
    _put_embedding(plan, types=True, project="encoder.embedding_hidden_mapping_in")
    for (g, j), i in first.items():
        bert.put_layer(plan, f"blocks.{i}.", f"encoder.albert_layer_groups.{g}.albert_layers.{j}.", ALBERT_LAYER)
    if pooler:
        plan.put_pairs("", "", [("pooler", "pooler")])
    plan.src.prefix = ""
    if num_labels:
        plan.put_pairs("", "", [("classifier", "classifier")])
    if mlm is not None:
        _albert_mlm(plan, hf, model, ignore)
    plan.src.prefix = prefix
    return apply_encoder_plan(plan, model, hf, ignore)


DISPATCH = {
    "distilbert": parts.Dispatch("DistilBERT", convert_distilbert, (
        "DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification")),
    "electra": parts.Dispatch("ELECTRA", convert_electra, (
        "ElectraModel", "ElectraForMaskedLM", "ElectraForSequenceClassification")),
    "albert": parts.Dispatch("ALBERT", convert_albert, (
        "AlbertModel", "AlbertForMaskedLM", "AlbertForSequenceClassification")),
}
