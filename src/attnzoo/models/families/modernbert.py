"""ModernBERT (``model_type="modernbert"``) -> :class:`~attnzoo.TransformerEncoder`: ``ModernBertModel``,
``ModernBertForMaskedLM`` and ``ModernBertForSequenceClassification`` (transformers 5.25,
``models/modernbert/modeling_modernbert.py``; line numbers below are that file's).

The encoder is pre-norm, LayerNorms without biases by default (``norm_bias``):

* the embedding: ``norm(tok_embeddings[tokens])`` (51-70), no absolute positions, no token types;
* per layer: ``x + Wo(attn(attn_norm(x)))`` then ``x + mlp(mlp_norm(x))`` (292-322), the first
  layer's ``attn_norm`` an identity (298); one fused ``Wqkv`` (rows ``[q; k; v]``, 276-279) into a
  non-causal :class:`~attnzoo.MultiHeadAttention` with RoPE (rotate-half, 176-208) whose base is
  the layer kind's: ``rope_parameters["full_attention" | "sliding_attention"]["rope_theta"]``, or the
  older ``global_rope_theta`` (160k) / ``local_rope_theta`` (10k) keys (configuration 123-156);
* the layer kinds: ``layer_types``, or every ``global_attn_every_n_layers``-th layer (default 3)
  global and the others local (configuration 112-121); a local layer sees the keys within
  ``local_attention // 2`` of the query on each side (the bidirectional sliding mask of
  ``masking_utils.py`` 139-156, ``|q - k| <= sliding_window``), i.e. ``window=local_attention // 2``;
* the GLU MLP: ``Wi`` gives ``[input; gate]``, ``Wo(act(input) * gate)`` (73-90), loaded as a gated
  :class:`~attnzoo.FeedForward` (``gate_proj`` = the activated half); ``attention_bias`` / ``mlp_bias``
  biases;
* a final LayerNorm; the prediction head ``norm(act(dense(h)))`` (468-482, ``classifier_bias``,
  ``classifier_activation``) shared by the masked-LM head (``decoder`` tied to the embeddings unless
  ``tie_word_embeddings=False``, its bias ``decoder_bias``; 485-553) and the classifier
  (``classifier_pooling`` ``"cls"``: ``hidden[:, 0]`` whatever the padding, or ``"mean"`` over the real
  tokens; then the head and a biased ``classifier``; 556-638).

What transformers' eager path computes is what is reproduced (its flash path unpads the batch and
gives zeros at padded positions; at real tokens both agree). A padded query whose local window
holds only padded keys (left padding longer than ``local_attention // 2``) gets zeros here where
transformers' eager softmax spreads over every key: padded positions' values are unspecified
(pool them with the mask). ``sparse_prediction`` (only with labels, training),
``reference_compile``, ``deterministic_flash_attn`` and the dropouts change nothing in eval and are
accepted. Refused by name: RoPE types other than ``default`` / ``linear``, activations outside
the tables, a ``head_dim`` other than ``hidden_size // num_attention_heads``, a ``sliding_window``
key disagreeing with ``local_attention``, and the token-classification, question-answering and
multiple-choice heads when the config's ``architectures`` names them (their weights look like the
sequence classifier's).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import ACTIVATIONS as ACTIVATION_FNS
from attnzoo.blocks import FeedForward
from attnzoo.models.config import EncoderConfig
from attnzoo.models.encoder import TransformerEncoder, cls_pool, mean_pool
from attnzoo.models.families.minimax import NormedEmbedding
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.hf.bert import ACTIVATIONS
from attnzoo.models.parts import EncoderParts, PackedFromZero
from attnzoo.variants import build_attention

__all__ = ["DEFAULTS", "DISPATCH", "TYPES", "EncoderEmbedding", "PooledClassifier", "PredictionHead",
           "build_modernbert", "convert_modernbert", "layer_kinds", "rope_for"]

TYPES = ("sliding_attention", "full_attention")
#: ``ModernBertConfig``'s defaults (configuration_modernbert.py 70-107) for the keys a folder may leave out
DEFAULTS: dict[str, Any] = {
    "hidden_activation": "gelu", "max_position_embeddings": 8192, "norm_eps": 1e-5, "norm_bias": False,
    "attention_bias": False, "attention_dropout": 0.0, "local_attention": 128, "embedding_dropout": 0.0,
    "mlp_bias": False, "mlp_dropout": 0.0, "decoder_bias": True, "classifier_pooling": "cls",
    "classifier_dropout": 0.0, "classifier_bias": False, "classifier_activation": "gelu",
    "tie_word_embeddings": True, "global_attn_every_n_layers": 3, "global_rope_theta": 160_000.0,
    "local_rope_theta": 10_000.0}
#: the heads whose weights look like the sequence classifier's (refused when ``architectures`` names them)
OTHER_HEADS = ("ModernBertForTokenClassification", "ModernBertForQuestionAnswering", "ModernBertForMultipleChoice")
ROPE_TYPES = ("default", "linear")


class EncoderEmbedding(PackedFromZero, NormedEmbedding):
    """ModernBERT's input embedding as an :class:`~attnzoo.models.EncoderParts` embedding:
    ``drop(norm(weight[tokens]))`` (no positions: RoPE is in the attention; no token types).
    Weights: ``weight [V, C]`` (tied to the masked-LM decoder) and ``norm``'s.

    Shapes: ``tokens [B, N]`` -> ``[B, N, C]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, norm: nn.Module, dropout: float = 0.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, norm=norm, device=device, dtype=dtype)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: Tensor, token_type_ids: Tensor | None = None,  # type: ignore[override]
                positions: Tensor | None = None) -> Tensor:
        return self.drop(super().forward(tokens))  # [B, N, C]


class PredictionHead(nn.Module):
    """``norm(act(dense(h)))`` (transformers' ``ModernBertPredictionHead``): ``[..., C] -> [..., C]``.
    Weights: ``dense [C, C]`` (+ bias if ``bias``), ``norm``'s."""

    def __init__(self, dim: int, activation: str, norm: nn.Module, *, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if activation not in ACTIVATION_FNS or ACTIVATION_FNS[activation][1]:
            plain = sorted(k for k, (_, gated) in ACTIVATION_FNS.items() if not gated)
            raise ValueError(f"PredictionHead: activation must be one of {plain}, got {activation!r}")
        self.dense = nn.Linear(dim, dim, bias=bias, device=device, dtype=dtype)
        self.act = ACTIVATION_FNS[activation][0]
        self.norm = norm

    def forward(self, h: Tensor) -> Tensor:
        return self.norm(self.act(self.dense(h)))


class PooledClassifier(nn.Module):
    """Sequence classifier ``classifier(drop(head(pool(hidden))))``: ``pooling="cls"`` takes
    ``hidden[:, 0]`` (the first slot, also on a left-padded row, as transformers), ``"mean"`` the mean
    over the real tokens of ``attention_mask`` (all tokens without one).

    Shapes: ``hidden [B, N, C]``, ``attention_mask [B, N] | None`` -> ``[B, L]``.
    Weights: ``head`` (a :class:`PredictionHead`), ``classifier [L, C]`` + bias.
    """

    def __init__(self, head: nn.Module, dim: int, num_labels: int, *, pooling: str, dropout: float = 0.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if pooling not in ("cls", "mean"):
            raise ValueError(f"PooledClassifier: pooling must be 'cls' or 'mean', got {pooling!r}")
        self.pooling = pooling
        self.head = head
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(dim, num_labels, device=device, dtype=dtype)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        pooled = cls_pool(hidden) if self.pooling == "cls" else mean_pool(hidden, attention_mask)  # [B, C]
        return self.classifier(self.drop(self.head(pooled)))

    def extra_repr(self) -> str:
        return f"pooling={self.pooling!r}"


def layer_kinds(hf: HFConfig, depth: int) -> list[str]:
    """``layer_types``, else every ``global_attn_every_n_layers``-th layer (from 0) full, the others sliding."""
    every = hf.get("global_attn_every_n_layers", 3)
    if every < 1:
        raise hf.unsupported(f"global_attn_every_n_layers={every}")
    default = ["sliding_attention" if i % every else "full_attention" for i in range(depth)]
    return parts.layer_types(hf, depth, TYPES, default=default)


def rope_for(hf: HFConfig, kind: str, head_dim: int) -> nn.Module:
    """The rotary embedding of a layer kind: ``rope_parameters[kind]`` updated by a legacy
    ``rope_scaling``, its base defaulting to ``global_rope_theta`` / ``local_rope_theta``."""
    given = hf.get("rope_parameters", {}, dict).get(kind)
    params = {**(given if isinstance(given, dict) else {}), **hf.get("rope_scaling", {}, dict)}
    theta_key = "global_rope_theta" if kind == "full_attention" else "local_rope_theta"
    params.setdefault("rope_theta", hf.get(theta_key, DEFAULTS[theta_key], float))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise hf.unsupported(f"rope_type={rope_type!r} on {kind} layers (supported: {', '.join(ROPE_TYPES)})")
    return parts.rotary(hf, params, head_dim)


def _checks(hf: HFConfig, C: int, H: int) -> int:
    """Refuse what cannot be reproduced; return the local window (each side)."""
    if hf.get("head_dim", C // H) != C // H:
        raise hf.unsupported(f"head_dim={hf.raw('head_dim')} (ModernBERT's heads are hidden_size // "
                             f"num_attention_heads = {C // H} wide)")
    window = hf.get("local_attention", 128) // 2
    if hf.has("sliding_window") and hf.get("sliding_window", 0) != window:
        raise hf.unsupported(f"sliding_window={hf.raw('sliding_window')} besides local_attention="
                             f"{hf.raw('local_attention')} (transformers reads local_attention // 2 = {window})")
    if hf.get("classifier_pooling", "cls", str) not in ("cls", "mean"):
        raise hf.unsupported(f"classifier_pooling={hf.raw('classifier_pooling')!r} (supported: 'cls', 'mean')")
    other = [a for a in hf.get("architectures", [], list) if a in OTHER_HEADS]
    if other:
        raise hf.unsupported(f"the {other[0]} head (supported: ModernBertModel, ModernBertForMaskedLM, "
                             f"ModernBertForSequenceClassification)")
    return window


def _blocks(hf: HFConfig, C: int, H: int, window: int, kw: dict[str, Any]) -> list[nn.Module]:
    """One pre-norm :class:`~attnzoo.TransformerBlock` per layer (the first without an attention norm)."""
    depth = hf.req("num_hidden_layers")
    kinds = layer_kinds(hf, depth)
    ropes = {k: rope_for(hf, k, C // H) for k in set(kinds)}
    norm = functools.partial(nn.LayerNorm, C, eps=hf.get("norm_eps", 1e-5, float), bias=hf.get("norm_bias", False, bool),
                             **kw)
    ffn = functools.partial(FeedForward, C, hf.req("intermediate_size"), hf.activation("hidden_activation", parts.GATED),
                            bias=hf.get("mlp_bias", False, bool), dropout=hf.get("mlp_dropout", 0.0, float), **kw)
    blocks = []
    for i, kind in enumerate(kinds):
        attn = functools.partial(build_attention, "mha", C, H, causal=False, rope=ropes[kind],
                                 window=window if kind == "sliding_attention" else None,
                                 bias=hf.get("attention_bias", False, bool),
                                 dropout=hf.get("attention_dropout", 0.0, float), **kw)
        blk = parts.block(C, attn, ffn, norm)
        if i == 0:
            blk.attn_norm = nn.Identity()
        blocks.append(blk)
    return blocks


def build_modernbert(hf: HFConfig, *, mlm: bool = False, num_labels: int = 0, device: Any = None,
                     dtype: Any = None) -> TransformerEncoder:
    """The encoder of a ``ModernBertConfig`` (random weights; see the module docstring), with the
    masked-LM head (``mlm``) or a sequence classifier of ``num_labels`` labels."""
    hf = hf.with_defaults(DEFAULTS)
    V, C, H = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_attention_heads")
    window = _checks(hf, C, H)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    eps, nb = hf.get("norm_eps", 1e-5, float), hf.get("norm_bias", False, bool)
    norm = functools.partial(nn.LayerNorm, C, eps=eps, bias=nb, **kw)
    act = hf.activation("classifier_activation", ACTIVATIONS)
    head = functools.partial(PredictionHead, C, act, bias=hf.get("classifier_bias", False, bool), **kw)
    blocks = _blocks(hf, C, H, window, kw)
    embedding = EncoderEmbedding(V, C, norm=norm(), dropout=hf.get("embedding_dropout", 0.0, float), **kw)
    mlm_head = classifier = None
    if mlm:
        decoder = nn.Linear(C, V, bias=hf.get("decoder_bias", True, bool), **kw)
        if hf.get("tie_word_embeddings", True, bool):
            decoder.weight = embedding.weight
        mlm_head = nn.Sequential(OrderedDict(head=head(norm()), decoder=decoder))
    elif num_labels:
        classifier = PooledClassifier(head(norm()), C, num_labels, pooling=hf.get("classifier_pooling", "cls", str),
                                      dropout=hf.get("classifier_dropout", 0.0, float), **kw)
    cfg = EncoderConfig(V, C, len(blocks), H, max_seq_len=hf.get("max_position_embeddings", 8192), pos="rope",
                        type_vocab_size=0, norm="layer", norm_eps=eps, norm_first=True)
    return TransformerEncoder(config=cfg, parts=EncoderParts(embedding=embedding, blocks=blocks, norm=norm(),
                                                             mlm=mlm_head, classifier=classifier), **kw)


def _put_halves(plan: Plan, ours: str, key: str, names: tuple[str, str]) -> None:
    """A fused ``[first; second]`` tensor at ``key`` (``Wi``: input, gate) into ``{ours}{names[i]}.<suffix>``."""
    t = plan.src.take(key)
    if t is not None:
        suffix = key.rsplit(".", 1)[1]
        for name, half, rows in zip(names, t.chunk(2, dim=0), ("[:F]", "[F:]"), strict=True):
            plan.put_tensor(f"{ours}{name}.{suffix}", half, f"{plan.src.prefix}{key}{rows}")


def _put_layer(plan: Plan, i: int, *, attn_bias: bool, mlp_bias: bool, norm_bias: bool) -> None:
    o, h = f"blocks.{i}.", f"layers.{i}."
    plan.put_pairs(o, h, [("attn.qkv_proj", "attn.Wqkv"), ("attn.out_proj", "attn.Wo")], bias=attn_bias)
    for suffix in ("weight", "bias") if mlp_bias else ("weight",):
        _put_halves(plan, f"{o}ffn.", f"{h}mlp.Wi.{suffix}", ("gate_proj", "up_proj"))
    plan.put_pairs(o, h, [("ffn.down_proj", "mlp.Wo")], bias=mlp_bias)
    norms = [("ffn_norm", "mlp_norm")] + ([("attn_norm", "attn_norm")] if i else [])
    plan.put_pairs(o, h, norms, bias=norm_bias)


def _put_heads(plan: Plan, hf: HFConfig, model: TransformerEncoder, ignore: list[str]) -> None:
    """The prediction head and the masked-LM decoder or the classifier (outside the ``model.`` prefix)."""
    plan.src.prefix = ""
    if model.mlm is None and model.classifier is None:
        return
    owner = "mlm.head." if model.mlm is not None else "classifier.head."
    plan.put_pairs(owner, "head.", [("dense", "dense")], bias=hf.get("classifier_bias", False, bool))
    plan.put_pairs(owner, "head.", [("norm", "norm")], bias=hf.get("norm_bias", False, bool))
    if model.classifier is not None:
        plan.put_pairs("classifier.", "", [("classifier", "classifier")])
        return
    if hf.get("tie_word_embeddings", True, bool):
        ignore.append(r"decoder\.weight")
    else:
        plan.put("mlm.decoder.weight", "decoder.weight")
    if hf.get("decoder_bias", True, bool):
        plan.put("mlm.decoder.bias", "decoder.bias")


def convert_modernbert(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> TransformerEncoder:
    """Build the encoder and copy the weights; the head follows them (``decoder.*``: the masked-LM
    head, ``classifier.*``: the sequence classifier, neither: the base ``ModernBertModel``)."""
    hf = hf.with_defaults(DEFAULTS)
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    mlm = bool(prefix) and "head.dense.weight" in sd and "classifier.weight" not in sd
    num_labels = int(sd["classifier.weight"].shape[0]) if prefix and "classifier.weight" in sd else 0
    model = build_modernbert(hf, mlm=mlm, num_labels=num_labels, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(Source(sd, prefix), hf.arch)
    norm_bias = hf.get("norm_bias", False, bool)
    plan.put("embedding.weight", "embeddings.tok_embeddings.weight")
    plan.put_pairs("embedding.", "embeddings.", [("norm", "norm")], bias=norm_bias)
    for i in range(model.depth):
        _put_layer(plan, i, attn_bias=hf.get("attention_bias", False, bool), mlp_bias=hf.get("mlp_bias", False, bool),
                   norm_bias=norm_bias)
    plan.put_pairs("", "", [("norm", "final_norm")], bias=norm_bias)
    ignore = [r"(model\.)?rotary_emb\.\w+"]
    _put_heads(plan, hf, model, ignore)
    plan.apply(model, ignore=ignore)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"modernbert": parts.Dispatch("ModernBERT", convert_modernbert, (
    "ModernBertModel", "ModernBertForMaskedLM", "ModernBertForSequenceClassification"))}
