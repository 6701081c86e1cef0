"""MPNet (``mpnet``: ``MPNetModel``, ``MPNetForMaskedLM``, ``MPNetForSequenceClassification``; e.g.
sentence-transformers' all-mpnet-base-v2) -> :class:`~attnzoo.TransformerEncoder`. Its relative
position bias is T5's (the buckets, the bias table and the attention adding it are
:mod:`~attnzoo.models.families.t5_encoder`'s, imported). Line numbers: transformers 5.25's
``models/mpnet/modeling_mpnet.py``.

MPNet is BERT's post-norm layer (attention, ``x + attn`` LayerNorm, ungated MLP of ``hidden_act``,
``x + mlp`` LayerNorm; 114-260) with two position signals:

* learned absolute positions counted RoBERTa's way (57-94, 849-857): ``padding_idx`` is **1
  whatever the config's** ``pad_token_id`` (60), a token equal to it gets position 1 and the others
  ``1 + (number of non-pad tokens up to and including it)``, so a left-padded row's first real
  token sits at 2 as a right-padded one's (the attention mask is not read);
  :class:`PaddingOffsetEmbedding` (tokens + positions, LayerNorm; no token types);
* one relative position bias table ``encoder.relative_attention_bias [num_buckets, H]`` shared by
  every layer (269, 280, 311-346) and added to the scaled scores before the padding mask (152-157).
  Its buckets are T5's bidirectional log buckets over ``key - query`` with ``max_distance`` 128,
  **always 32 of them**: ``compute_position_bias`` is called without ``num_buckets`` (280, 311), so
  ``relative_attention_num_buckets`` only sizes the table (its rows past 32 are never read; fewer
  than 32 rows fail in transformers, refused here). The relative positions are the slots'
  (``arange``, 317-318), padding included, whatever ``position_ids`` say (:class:`SlotBiasAttention`);
  a shift does not change them, so padded rows need nothing. The table is loaded as its first 32
  rows (T5's :class:`~attnzoo.models.families.t5_encoder.RelativePositionBias` of 32 buckets).

Heads: the base ``MPNetModel`` keeps its pooler (``tanh(dense(hidden[:, 0]))``,
:meth:`~attnzoo.TransformerEncoder.pooler_output`); ``MPNetForMaskedLM`` (prefix ``mpnet.``) its LM
head ``decoder(LayerNorm(gelu(dense(h))))`` with the **exact** GELU whatever ``hidden_act`` (507-526),
the decoder tied to the word embeddings under ``tie_word_embeddings`` (441-444); with
``tie_word_embeddings=False`` transformers unties ``lm_head.bias`` from ``lm_head.decoder.bias`` and
the forward adds only the latter, which is what is loaded (``lm_head.bias`` is then unused);
``MPNetForSequenceClassification`` RoBERTa's head ``out_proj(tanh(dense(hidden[:, 0])))`` on the first
slot, a pad in a left-padded row as in transformers (755-771; :class:`~attnzoo.models.encoder.FirstTokenClassifier`).

Refused by name: the task heads of ``MPNetForTokenClassification``, ``MPNetForQuestionAnswering`` and
``MPNetForMultipleChoice`` (their weights have no attnzoo head), ``relative_attention_num_buckets``
below 32, a ``hidden_size`` not divisible by the heads. Dropout is not kept (inference, as BERT's).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_int
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock
from attnzoo.masks import Mask
from attnzoo.models.config import EncoderConfig
from attnzoo.models.encoder import FactorisedMLMHead, FirstTokenClassifier, TransformerEncoder
from attnzoo.models.families._common import Dispatch
from attnzoo.models.families.t5_encoder import RelativeBiasAttention, RelativePositionBias
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.hf.bert import ACTIVATIONS, put_layer
from attnzoo.models.parts import EncoderParts
from attnzoo.nn.attention import build_softmax
from attnzoo.nn.cache import KVCache, SlidingWindowKVCache
from attnzoo.nn.frontier import packed_positions

__all__ = ["DISPATCH", "MPNET_BUCKETS", "MPNET_LAYER", "MPNET_MAX_DISTANCE", "MPNET_PADDING_IDX", "PaddingOffsetEmbedding", "SlotBiasAttention",
           "build_mpnet", "convert_mpnet", "padding_offset_positions", "plan_heads"]

#: the buckets MPNet's bias always uses (``compute_position_bias``'s default, ``modeling_mpnet.py`` 311)
MPNET_BUCKETS = 32
#: the distance from which every bucket is the last one (328)
MPNET_MAX_DISTANCE = 128
#: the padding index of MPNet's embeddings, whatever the config's ``pad_token_id`` (60)
MPNET_PADDING_IDX = 1
#: MPNet's names of a layer's sub-modules, in :data:`attnzoo.models.hf.bert.BERT_LAYER`'s order
MPNET_LAYER = ("attention.attn.q", "attention.attn.k", "attention.attn.v", "attention.attn.o", "attention.LayerNorm",
               "intermediate.dense", "output.dense", "output.LayerNorm")
#: the head weights outside the ``mpnet.`` prefix that attnzoo converts (LM head, sequence classifier)
_HEADS = r"(lm_head|classifier\.(dense|out_proj))\."


# --------------------------------------------------------------------------- relative position bias
class SlotBiasAttention(RelativeBiasAttention):
    """T5's :class:`~attnzoo.models.families.t5_encoder.RelativeBiasAttention` (the scaled scores plus
    a :class:`~attnzoo.models.families.t5_encoder.RelativePositionBias`, one table shared by every
    layer) with the bias over the tokens' **slots**: MPNet computes it from ``arange`` whatever
    ``position_ids`` say (``modeling_mpnet.py`` 280, 317-318), so the ``positions`` the encoder hands
    its blocks (they move MPNet's absolute embeddings only) are not passed on.

    Shapes: ``x [B, N, C] -> [B, N, C]``; ``mask`` broadcastable to ``[B, H, N, N]``.
    """

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,
                cache: KVCache | SlidingWindowKVCache | None = None, positions: Tensor | None = None,
                return_weights: bool = False, cu_seqlens: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """As :meth:`RelativeBiasAttention.forward`, ``positions`` ignored (the bias is over slots)."""
        return super().forward(x, context, mask=mask, cache=cache, return_weights=return_weights,
                               cu_seqlens=cu_seqlens)


# --------------------------------------------------------------------------- embeddings and heads
def padding_offset_positions(tokens: Tensor, padding_idx: int = MPNET_PADDING_IDX,
                             cu_seqlens: Tensor | None = None) -> Tensor:
    """RoBERTa's / MPNet's positions from the token ids (``modeling_mpnet.py`` 849-857): a pad
    (``tokens == padding_idx``) gets ``padding_idx``, a real token ``padding_idx + k`` for the k-th
    real token of its row. ``tokens [B, N]`` -> int64 ``[B, N]``; with ``cu_seqlens [S+1]``,
    ``tokens [1, T]`` holds packed sequences and the count restarts in each (as in its own row)."""
    real = tokens.ne(padding_idx).long()
    count = real.cumsum(dim=1)  # [B, N]
    if cu_seqlens is not None:
        t = tokens.shape[1]
        starts = torch.arange(t, device=tokens.device) - packed_positions(cu_seqlens, t)  # [T]: its sequence's first slot
        before = torch.cat((count.new_zeros(1, 1), count[:, :-1]), dim=1)  # [1, T]: the count before each slot
        count = count - before[:, starts]
    return count * real + padding_idx


class PaddingOffsetEmbedding(nn.Module):
    """The input embedding of RoBERTa (``modeling_roberta.py`` 57-120) and MPNet (``modeling_mpnet.py``
    57-94): ``norm(tok_emb[t] + type_emb[s] + pos_emb[p])`` with the positions ``p`` counted from the
    token ids (:func:`padding_offset_positions`) unless given (table indices, as transformers'
    ``position_ids``), token types 0 unless given (none when ``type_vocab_size == 0``: MPNet), ``norm``
    a LayerNorm (``norm_eps``) or none (``None``: XLM-R-XL).

    Weights: ``tok_emb [V, C]``, ``pos_emb [P, C]``, ``type_emb [T, C]`` (``T > 0``), ``norm``.
    Shapes: ``tokens [B, N]``, ``token_type_ids [B, N] | None``, ``positions [B, N] | None`` -> ``[B, N, C]``.
    """

    def __init__(self, vocab_size: int, dim: int, max_positions: int, type_vocab_size: int, *, padding_idx: int,
                 norm_eps: float | None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        owner = "PaddingOffsetEmbedding"
        self.padding_idx = check_int(padding_idx, "padding_idx", owner, minimum=0)
        self.tok_emb = nn.Embedding(vocab_size, dim, **kw)
        self.pos_emb = nn.Embedding(max_positions, dim, **kw)
        types = check_int(type_vocab_size, "type_vocab_size", owner, minimum=0)
        self.type_emb = nn.Embedding(types, dim, **kw) if types else None
        self.norm: nn.Module = nn.Identity() if norm_eps is None else nn.LayerNorm(dim, eps=norm_eps, **kw)

    def forward(self, tokens: Tensor, token_type_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        owner, table = "PaddingOffsetEmbedding", self.pos_emb.num_embeddings
        longest = table - self.padding_idx - 1
        if positions is None:
            if tokens.shape[-1] > longest:  # counted from the ids: at most padding_idx + N (no host sync)
                raise ValueError(f"{owner}: {tokens.shape[-1]} tokens is longer than the model's {longest} "
                                 f"positions (max_position_embeddings - padding_idx - 1)")
            positions = padding_offset_positions(tokens, self.padding_idx)  # [B, N]
        elif positions.numel():
            lo, hi = (int(t) for t in positions.aminmax())
            if hi >= table or lo < 0:
                raise ValueError(f"{owner}: positions must lie in [0, {table}) (max_position_embeddings), got "
                                 f"{lo}..{hi}")
        x = self.tok_emb(tokens)  # [B, N, C]
        if self.type_emb is not None:
            x = x + (self.type_emb.weight[0] if token_type_ids is None else self.type_emb(token_type_ids))
        elif token_type_ids is not None:
            raise ValueError(f"{owner}: this embedding has no token types; token_type_ids must be None")
        return self.norm(x + self.pos_emb(positions))

    def packed(self, tokens: Tensor, token_type_ids: Tensor | None, cu_seqlens: Tensor) -> Tensor:
        """Packed sequences ``tokens [1, T]`` (``cu_seqlens [S+1]``), each counted as its own row."""
        return self(tokens, token_type_ids, padding_offset_positions(tokens, self.padding_idx, cu_seqlens))

    def extra_repr(self) -> str:
        return f"padding_idx={self.padding_idx}"


# --------------------------------------------------------------------------- the model
def _mpnet_config(hf: HFConfig, pooler: bool) -> EncoderConfig:
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    if C % H:
        raise hf.unsupported(f"hidden_size={C} not divisible by num_attention_heads={H}")
    if hf.get("relative_attention_num_buckets", MPNET_BUCKETS) < MPNET_BUCKETS:
        raise hf.unsupported(f"relative_attention_num_buckets={hf.raw('relative_attention_num_buckets')!r} "
                             f"(MPNet reads {MPNET_BUCKETS} buckets from the table; fewer rows fail in transformers)")
    return EncoderConfig(hf.req("vocab_size"), C, hf.req("num_hidden_layers"), H,
                         max_seq_len=hf.get("max_position_embeddings", 512), pos="none", norm="layer",
                         norm_eps=hf.get("layer_norm_eps", 1e-12, float), norm_first=False, final_norm=False,
                         ffn=hf.activation("hidden_act", ACTIVATIONS), ffn_hidden=hf.req("intermediate_size"),
                         pooler=pooler)


def build_mpnet(hf: HFConfig, *, pooler: bool, num_labels: int = 0, mlm: bool = False, tied: bool = True,
                device: Any = None, dtype: Any = None) -> TransformerEncoder:
    """The encoder of an MPNet config: :class:`PaddingOffsetEmbedding`, post-norm blocks of
    :class:`SlotBiasAttention` sharing one T5 ``RelativePositionBias`` (32 buckets, max distance
    128), the pooler (``pooler``), a :class:`FirstTokenClassifier` of ``num_labels``
    (0: none) and the exact-GELU masked-LM head (``mlm``; its decoder tied to the word embeddings
    when ``tied``)."""
    cfg = _mpnet_config(hf, pooler)
    C, H, eps = cfg.dim, cfg.num_heads, cfg.norm_eps
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    rel = RelativePositionBias(MPNET_BUCKETS, H, max_distance=MPNET_MAX_DISTANCE, **kw)
    layers = BlockLayers(
        attention=functools.partial(build_softmax, SlotBiasAttention, C, H, relative_bias=rel, bias=True, **kw),
        feed_forward=functools.partial(FeedForward, C, cfg.ffn_hidden, cfg.ffn, bias=True, **kw),
        norm=functools.partial(nn.LayerNorm, C, eps=eps, **kw), norm_first=False)
    embedding = PaddingOffsetEmbedding(cfg.vocab_size, C, cfg.max_seq_len, 0, padding_idx=MPNET_PADDING_IDX,
                                       norm_eps=eps, **kw)
    head = FactorisedMLMHead(cfg.dim, cfg.dim, cfg.vocab_size, activation="gelu", eps=cfg.norm_eps, **kw) if mlm else None
    if head is not None and tied:
        head.decoder.weight = embedding.tok_emb.weight
    parts = EncoderParts(embedding=embedding, blocks=[TransformerBlock(C, layers=layers) for _ in range(cfg.depth)],
                         mlm=head, classifier=FirstTokenClassifier(C, num_labels, **kw) if num_labels else None)
    return TransformerEncoder(config=cfg, parts=parts, **kw)


def plan_heads(plan: Plan, hf: HFConfig, sd: dict[str, Tensor], model: TransformerEncoder,
                tied: bool) -> list[str]:
    """Plan the classifier and the LM head (keys outside the ``mpnet.`` prefix); returns the
    checkpoint keys to ignore (tied copies, the unused ``lm_head.bias``)."""
    plan.src.prefix = ""
    ignore = [r"(mpnet\.)?embeddings\.position_ids"]
    if model.classifier is not None:
        plan.put_pairs("classifier.", "classifier.", [("dense", "dense"), ("out_proj", "out_proj")])
    if model.mlm is not None:
        plan.put_pairs("mlm.", "lm_head.", [("transform", "dense"), ("norm", "layer_norm")])
        bias = "lm_head.decoder.bias" if "lm_head.decoder.bias" in sd else "lm_head.bias"
        plan.put("mlm.decoder.bias", bias)
        ignore.append(r"lm_head\.bias")  # the decoder's bias when tied, else unused by transformers' forward
        if tied:
            ignore.append(r"lm_head\.decoder\.weight")
        else:
            plan.put("mlm.decoder.weight", "lm_head.decoder.weight")
    return ignore


def convert_mpnet(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> TransformerEncoder:
    """Build the encoder and map every weight (``mpnet.`` prefix for the head classes; the heads
    from the weights present). Task-head weights attnzoo has no head for are refused by name."""
    prefix = "mpnet." if any(k.startswith("mpnet.") for k in sd) else ""
    other = sorted(k for k in sd if prefix and not k.startswith(prefix) and not re.match(_HEADS, k))
    if other:
        raise hf.unsupported(f"the task head weights {other} (MPNetForTokenClassification / QuestionAnswering / "
                             f"MultipleChoice; attnzoo converts MPNetModel, MPNetForMaskedLM and "
                             f"MPNetForSequenceClassification)")
    src = Source(sd, prefix)
    num_labels = int(sd["classifier.out_proj.weight"].shape[0]) if "classifier.out_proj.weight" in sd else 0
    tied = hf.get("tie_word_embeddings", True, bool)
    model = build_mpnet(hf, pooler=src.has("pooler.dense.weight"), num_labels=num_labels,
                        mlm="lm_head.dense.weight" in sd, tied=tied, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(src, hf.arch)
    plan.put("embedding.tok_emb.weight", "embeddings.word_embeddings.weight")
    plan.put("embedding.pos_emb.weight", "embeddings.position_embeddings.weight")
    plan.put_pairs("embedding.", "embeddings.", [("norm", "LayerNorm")])
    plan.put("blocks.0.attn.relative_bias.weight", "encoder.relative_attention_bias.weight",  # one table, shared
             lambda t: t[:MPNET_BUCKETS])  # the rows past 32 are never read
    for i in range(model.depth):
        put_layer(plan, f"blocks.{i}.", f"encoder.layer.{i}.", MPNET_LAYER)
    if model.pooler is not None:
        plan.put_pairs("", "", [("pooler", "pooler.dense")])
    plan.apply(model, ignore=plan_heads(plan, hf, sd, model, tied))
    return model


DISPATCH = {"mpnet": Dispatch("MPNet", convert_mpnet,
                              ("MPNetModel", "MPNetForMaskedLM", "MPNetForSequenceClassification"))}
