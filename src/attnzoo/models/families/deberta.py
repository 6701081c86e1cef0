"""DeBERTa-v2 / v3 and DeBERTa (v1) -> :class:`~attnzoo.TransformerEncoder`: ``DebertaV2Model``,
``DebertaV2ForMaskedLM`` and ``DebertaV2ForSequenceClassification`` (``model_type="deberta-v2"``: the
DeBERTa-v3 checkpoints and the NLI, zero-shot and cross-encoder models fine-tuned from them), and the same three
of v1 (``DebertaModel``, ... ``model_type="deberta"``).

Line numbers: transformers 5.25, ``models/deberta_v2/modeling_deberta_v2.py`` (m.) and
``configuration_deberta_v2.py`` (c.). DeBERTa is BERT-shaped (post-norm layers, biased projections,
an embedding LayerNorm) with one new mechanism, **disentangled attention** (:class:`DisentangledAttention`,
m. 131-340): besides content-to-content scores, content-to-position (c2p) and position-to-content (p2c)
scores against a relative-position table shared by every layer (:class:`RelativePositionTable`, m. 559-593),
relative distances put into log buckets (:func:`relative_positions`, m. 56-100). Where each part lives:

* **Embedding** (:class:`DebertaEmbedding`, m. 480-556): tokens (width ``embedding_size``), absolute
  positions only when ``position_biased_input`` (v3: none), token types when ``type_vocab_size > 0``,
  ``embed_proj`` to ``hidden_size`` when the widths differ, LayerNorm. It also owns the relative table
  (``encoder.rel_embeddings``, with ``encoder.LayerNorm`` when ``norm_rel_ebd`` has ``layer_norm``), which
  every layer's attention reads.
* **Layers** (m. 343-441): :class:`~attnzoo.TransformerBlock` (post-norm) around a
  :class:`DisentangledAttention`; the first one a :class:`FirstBlock` (padded embeddings zeroed; with
  ``conv_kernel_size > 0`` the ``ConvLayer``, m. 443-476: a 1-D convolution of the embeddings added to the
  first layer's output).
* **Heads**: the masked-LM head (``legacy=True``: ``cls.predictions``, m. 796-840; ``legacy=False``:
  ``lm_predictions.lm_head``, m. 843-877; both :class:`~attnzoo.models.encoder.FactorisedMLMHead`, the decoder
  tied to the word embeddings unless ``tie_word_embeddings=False``) and the sequence classifier
  (:class:`~attnzoo.models.encoder.FirstTokenClassifier`: ``ContextPooler`` m. 965-990 then ``classifier``). Token
  classification, question answering, multiple choice and the pretraining heads (``mask_predictions``)
  are ignored with a warning.

Padding: transformers multiplies the embeddings by the attention mask (m. 546-553) and masks the scores
with the outer product of the mask (m. 595-602): a real token attends to the real tokens only, a padded
one uniformly to all tokens. Both are reproduced (:class:`FirstBlock`, :class:`DisentangledAttention`), so
the padded tokens' states equal transformers' too (a left-padded row's first token is a pad, which
the classifier reads). Relative positions are the tokens' indices in the row (``i - j``), also in
left-padded rows, as transformers'; ``positions`` move only the absolute position embedding.

**DeBERTa v1** (``models/deberta/modeling_deberta.py``) is v2 without buckets, shared or normed relative
keys and the convolution (:data:`V1_SETTINGS`), with three differences: one ``in_proj`` without bias whose
rows are interleaved per head (``[q_h; k_h; v_h]``, 159-160, 225-242) plus ``q_bias`` / ``v_bias`` (put into
``qkv_proj``, the key bias zero), ``pos_proj`` without bias, a scale counting every ``pos_att_type`` entry
(246), and ``DebertaLayerNorm`` (38-55: :class:`Float32LayerNorm`) in the embedding and the layers. Its
relative lookup (a window of ``min(N, max_relative_positions)`` rows, 297-301) reads the same rows as v2's
whole table. Refused: ``talking_head=True``.

Refused by name: an even ``conv_kernel_size`` (transformers' convolution would shorten the sequence),
``pooler_hidden_size`` other than ``hidden_size``, ``attention_head_size`` times the heads other than
``hidden_size`` (transformers' output projection fails), ``legacy=False`` with ``embedding_size`` other than
``hidden_size`` (transformers' head multiplies by the embedding table and fails), activations attnzoo has
not (``hidden_act``, ``pooler_hidden_act``, ``conv_act``). ``pos_att_type`` entries other than ``c2p`` /
``p2c`` do nothing, as in transformers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_int
from attnzoo.blocks import ACTIVATIONS, BlockLayers, FeedForward, TransformerBlock
from attnzoo.masks import Mask
from attnzoo.models.config import EncoderConfig
from attnzoo.models.encoder import FactorisedMLMHead, FirstTokenClassifier, TransformerEncoder
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype, load_qkv_into
from attnzoo.models.hf.bert import ACTIVATIONS as HF_ACTIVATIONS
from attnzoo.models.parts import EncoderParts
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.parts import AttentionParts, Scores

__all__ = ["ACTS", "DEFAULTS", "DISPATCH", "OUTPUTS", "V1_SETTINGS", "DebertaEmbedding",
           "DisentangledAttention", "FirstBlock", "Float32LayerNorm", "RelativePositionTable", "build_deberta",
           "convert_deberta", "log_buckets", "relative_positions"]

#: ``DebertaV2Config``'s defaults (c. 60-84) and the ``getattr`` defaults of the model (m. 157-170, 446-448,
#: 486-489, 581-586) a ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "hidden_act": "gelu", "max_position_embeddings": 512, "type_vocab_size": 0, "layer_norm_eps": 1e-7,
    "relative_attention": False, "max_relative_positions": -1, "position_biased_input": True, "pos_att_type": None,
    "pooler_hidden_act": "gelu", "legacy": True, "tie_word_embeddings": True, "position_buckets": -1,
    "share_att_key": False, "norm_rel_ebd": "none", "conv_kernel_size": 0, "conv_groups": 1, "conv_act": "tanh"}
#: DeBERTa v1 read as v2 settings: none of these is v1's (``models/deberta/``: no buckets, no normed or shared
#: relative keys, no convolution, heads of ``hidden_size / heads``), whatever its config says
V1_SETTINGS: dict[str, Any] = {"position_buckets": -1, "norm_rel_ebd": "none", "share_att_key": False,
                               "conv_kernel_size": 0, "attention_head_size": None}
#: the output side of a layer (m. 42-53, 378-407), attnzoo name -> transformers name
OUTPUTS = (("attn.out_proj", "attention.output.dense"), ("attn_norm", "attention.output.LayerNorm"),
           ("ffn.up_proj", "intermediate.dense"), ("ffn.down_proj", "output.dense"), ("ffn_norm", "output.LayerNorm"))
#: transformers' activation names -> attnzoo's (:data:`attnzoo.blocks.ACTIVATIONS`, plus ``tanh``)
ACTS = {**HF_ACTIVATIONS, "tanh": "tanh"}


def _act(name: str) -> Callable[[Tensor], Tensor]:
    """The activation of an attnzoo name (:data:`ACTS` values)."""
    return torch.tanh if name == "tanh" else ACTIVATIONS[name][0]


def log_buckets(rel: Tensor, buckets: int, max_positions: int) -> Tensor:
    """DeBERTa's log buckets of relative distances (m. 56-68): a distance ``|r| <= buckets // 2`` is
    kept, a longer one becomes ``sign(r) * (mid + ceil(log(|r| / mid) / log((max_positions - 1) / mid) * (mid - 1)))``
    with ``mid = buckets // 2`` (``±(buckets - 1)`` at ``|r| = max_positions - 1``; longer distances go
    beyond, and the table's lookup clamps them), computed in
    float32 as transformers does. ``rel`` int ``[...]`` -> int64 ``[...]``."""
    mid = check_int(buckets, "buckets", "log_buckets", minimum=2) // 2
    if check_int(max_positions, "max_positions", "log_buckets") <= mid + 1:
        raise ValueError(f"log_buckets: max_positions must exceed buckets // 2 + 1 = {mid + 1}, got {max_positions}")
    far = rel.abs().clamp(min=mid)  # the near ones are kept as they are below
    ratio = torch.log(far / mid) / torch.log(torch.tensor((max_positions - 1) / mid))  # float32, as transformers
    log_pos = torch.ceil(ratio * (mid - 1)) + mid
    return torch.where(rel.abs() <= mid, rel.to(log_pos.dtype), log_pos * torch.sign(rel)).long()


def relative_positions(n: int, buckets: int, max_positions: int, device: torch.device | str | None = None) -> Tensor:
    """The relative positions ``i - j`` of ``n`` queries and keys, in :func:`log_buckets` when
    ``buckets > 0`` (m. 71-100): int64 ``[N, N]``."""
    ids = torch.arange(n, device=device)
    rel = ids[:, None] - ids[None, :]  # [N, N]
    return log_buckets(rel, buckets, max_positions) if buckets > 0 and max_positions > 0 else rel


class RelativePositionTable(nn.Module):
    """The relative-position embeddings every layer of a DeBERTa encoder shares (``encoder.rel_embeddings``,
    m. 568-593): ``weight [2S, C]``, row ``S + r`` for relative position ``r`` (clamped to ``[-S, S)``),
    normalised by ``norm`` (a LayerNorm, ``norm_rel_ebd="layer_norm"``) when given.

    Args:
        span: ``S`` (``position_buckets`` when set, else ``max_relative_positions``).
        dim: ``C``.
        buckets, max_positions: of :func:`relative_positions` (``buckets <= 0``: plain distances).
        norm: the table's norm, or ``None``.

    Shapes: ``forward() -> [2S, C]``; :meth:`positions` ``-> [N, N]``.
    """

    def __init__(self, span: int, dim: int, *, buckets: int = -1, max_positions: int = -1,
                 norm: nn.Module | None = None) -> None:
        super().__init__()
        self.span, self.buckets, self.max_positions = int(span), int(buckets), int(max_positions)
        self.weight = nn.Parameter(torch.randn(2 * self.span, dim) * 0.02)
        self.norm = norm

    def forward(self) -> Tensor:
        return self.weight if self.norm is None else self.norm(self.weight)  # [2S, C]

    def positions(self, n: int, device: torch.device) -> Tensor:
        """The (bucketed) relative positions ``i - j`` of ``n`` tokens: int64 ``[N, N]``."""
        return relative_positions(n, self.buckets, self.max_positions, device)

    def extra_repr(self) -> str:
        return f"span={self.span}, buckets={self.buckets}, max_positions={self.max_positions}"


class DisentangledAttention(MultiHeadAttention):
    """DeBERTa's disentangled self-attention (He et al. 2021; m. 131-340): bidirectional softmax
    attention whose scores add, to the content-to-content term, a content-to-position (c2p) and a
    position-to-content (p2c) term read from a shared :class:`RelativePositionTable` ``P [2S, C]``::

        delta(i, j) = clamp(rel(i, j) + S, 0, 2S - 1)           rel: RelativePositionTable.positions
        Kr = P Wkr + bkr,   Qr = P Wqr + bqr                     [H, 2S, D] (share_keys: Wk, Wq)
        c2p[b, h, i, j] = q_i . Kr[delta(i, j)]                  [B, H, N, N]
        p2c[b, h, i, j] = k_j . Qr[delta'(j, i)],   delta'(j, i) = clamp(-rel(j, i) + S, 0, 2S - 1)
        scores = (q_i . k_j + c2p + p2c) / sqrt(D * (1 + #terms)),  softmax over the real keys

    ``#terms`` counts ``c2p`` and ``p2c`` in ``pos_att`` whether or not a table is given (transformers
    scales so also without ``relative_attention``, m. 231-237; v1 counts every entry of ``pos_att_type``).
    The relative terms are a float bias ``[B, H, N, N]`` with the mask folded in (masked scores
    ``finfo.min``), given to :func:`attnzoo.attention` (dense softmax). A key-padding mask ``[B, 1, 1, N]``
    (what :class:`~attnzoo.TransformerBlock` passes) also masks the padded queries, whose rows then attend
    uniformly to every token, as transformers'.

    Weights: ``qkv_proj`` (rows ``[q; k; v]``, biased), ``out_proj``; with a table and not ``share_keys``,
    ``pos_key_proj`` (c2p; biased unless ``pos_key_bias=False``) and ``pos_query_proj`` (p2c). The table is
    not a submodule: it is shared by all layers and owned by the caller (:class:`DebertaEmbedding`).

    Args:
        dim, num_heads, head_dim: as :class:`~attnzoo.MultiHeadAttention`.
        table: the shared relative table, or ``None`` (content scores only).
        pos_att: the relative terms, a subset of ``("c2p", "p2c")`` (other names are ignored).
        share_keys: project the table with the content ``Wq`` / ``Wk`` (``share_att_key``).
        pos_key_bias: bias of ``pos_key_proj`` (DeBERTa v1's ``pos_proj`` has none).
        scale_terms: ``#terms`` of the scale (default: the relative terms in ``pos_att``; DeBERTa v1 counts
            every entry of its ``pos_att_type``).

    Shapes: ``x [B, N, C] -> [B, N, C]``. Positions are the tokens' indices (``positions`` are not read);
    no cache, no packed input, no cross-attention.
    """

    def __init__(self, dim: int, num_heads: int, *, table: RelativePositionTable | None,
                 pos_att: Sequence[str] = ("c2p", "p2c"), share_keys: bool = False, pos_key_bias: bool = True,
                 scale_terms: int | None = None, head_dim: int | None = None, dropout: float = 0.0) -> None:
        D = head_dim if head_dim is not None else dim // num_heads
        self.__dict__["pos_att"] = tuple(t for t in ("c2p", "p2c") if t in pos_att)
        self.__dict__["root"] = math.sqrt(D * (1 + (len(self.pos_att) if scale_terms is None else scale_terms)))
        super().__init__(dim, num_heads, head_dim=head_dim, bias=True, causal=False, dropout=dropout,
                         parts=AttentionParts(scores=Scores(scale=1.0 / self.root)))
        self.__dict__["table"] = table  # shared by every layer: not registered here
        self.share_keys = bool(share_keys)
        own = table is not None and not self.share_keys
        width = self.num_heads * self.head_dim
        self.pos_key_proj = nn.Linear(dim, width, bias=pos_key_bias) if own and "c2p" in self.pos_att else None
        self.pos_query_proj = nn.Linear(dim, width) if own and "p2c" in self.pos_att else None

    def _position_heads(self, rows: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The table's keys (c2p) and queries (p2c), ``[1, H, 2S, D]`` each, or ``None`` when unused."""
        if self.share_keys:
            n, w, b = self.num_heads * self.head_dim, self.qkv_proj.weight, self.qkv_proj.bias
            pk, pq = F.linear(rows, w[n:2 * n], b[n:2 * n]), F.linear(rows, w[:n], b[:n])
        else:
            pk = None if self.pos_key_proj is None else self.pos_key_proj(rows)
            pq = None if self.pos_query_proj is None else self.pos_query_proj(rows)
        pk = pk if "c2p" in self.pos_att else None
        pq = pq if "p2c" in self.pos_att else None
        return tuple(None if t is None else self.split_heads(t[None]) for t in (pk, pq))  # type: ignore[return-value]

    def relative_scores(self, q: Tensor, k: Tensor) -> Tensor | None:
        """The scaled c2p + p2c terms of ``q, k [B, H, N, D]``: ``[B, H, N, N]`` (``None`` without a table)."""
        table = self.table
        if table is None or not self.pos_att:
            return None
        B, H, N, _ = q.shape
        S = table.span
        rel = table.positions(N, q.device)  # [N, N]
        pk, pq = self._position_heads(table())
        score = q.new_zeros(())
        if pk is not None:  # c2p[i, j] = q_i . Kr[rel(i, j) + S]
            idx = (rel + S).clamp(0, 2 * S - 1).expand(B, H, N, N)
            score = score + torch.matmul(q, pk.transpose(-1, -2)).gather(-1, idx) / self.root
        if pq is not None:  # p2c[i, j] = k_j . Qr[-rel(j, i) + S]
            idx = (S - rel).clamp(0, 2 * S - 1).expand(B, H, N, N)
            score = score + torch.matmul(k, pq.transpose(-1, -2)).gather(-1, idx).transpose(-1, -2) / self.root
        return score

    def _self(self, x: Tensor, mask: Tensor | Mask | None, cache: Any, positions: Tensor | None,
              return_weights: bool) -> tuple[Tensor, Tensor | None]:
        self._check_self_cache(cache)
        q, k, v = self._project_self(x, None, 0, rotate=False)  # [B, H, N, D]
        bias = self.relative_scores(q, k)
        if mask is not None and not isinstance(mask, Tensor):
            raise TypeError(f"{type(self).__name__}: mask must be a tensor (bool or additive), got "
                            f"{type(mask).__name__}")
        if mask is not None and mask.dtype == torch.bool:
            if mask.shape[-2] == 1:  # key padding [B, 1, 1, N]: also the padded queries, as transformers (m. 595-602)
                mask = mask & mask.transpose(-1, -2)  # [B, 1, N, N]
            base = q.new_zeros(mask.shape) if bias is None else bias
            mask = base.masked_fill(~mask, torch.finfo(q.dtype).min)
        elif bias is not None:
            mask = bias if mask is None else bias + mask
        return self._core(q, k, v, mask=mask, causal=False, window=None, q_offset=0, alibi=None,
                          return_weights=return_weights)

    def _packed(self, *args: Any, **kwargs: Any) -> Tensor:
        raise ValueError(f"{type(self).__name__}: packed input (cu_seqlens) is not supported (relative positions "
                         f"are per padded row)")

    def _cross(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        raise ValueError(f"{type(self).__name__}: self-attention only (no context)")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, pos_att={self.pos_att}, share_keys={self.share_keys}"


class Float32LayerNorm(nn.LayerNorm):
    """DeBERTa v1's ``DebertaLayerNorm`` (``models/deberta/modeling_deberta.py`` 38-55): normalised in float32
    (``eps`` inside the root), rounded to the input's dtype, then ``weight * x + bias`` in that dtype.
    Weights as ``nn.LayerNorm``. Shapes: ``[..., C] -> [..., C]``."""

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(x.float(), self.normalized_shape, None, None, self.eps).to(x.dtype)
        return self.weight * y + self.bias


class DebertaEmbedding(nn.Module):
    """DeBERTa's input embedding (m. 480-556): ``norm(proj(tok_emb(tokens) + pos_emb(positions) +
    type_emb(types)))``, each optional part ``None`` when absent; ``rel`` the
    :class:`RelativePositionTable` the layers share (not used here).

    Weights: ``tok_emb [V, E]``, ``pos_emb [P, E]``, ``type_emb [T, E]``, ``proj [C, E]`` (no bias),
    ``norm`` (LayerNorm of ``C``), ``rel``.
    Shapes: ``(tokens [B, N], token_type_ids [B, N] | None, positions [N] | [B, N] | None) -> [B, N, C]``.
    """

    def __init__(self, vocab_size: int, dim: int, *, embedding_size: int, max_positions: int,
                 type_vocab_size: int, norm: nn.Module, rel: RelativePositionTable | None) -> None:
        super().__init__()
        E = embedding_size
        self.tok_emb = nn.Embedding(vocab_size, E)
        self.pos_emb = nn.Embedding(max_positions, E) if max_positions else None
        self.type_emb = nn.Embedding(type_vocab_size, E) if type_vocab_size else None
        self.proj = nn.Linear(E, dim, bias=False) if dim != E else None
        self.norm = norm
        self.rel = rel

    def forward(self, tokens: Tensor, token_type_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        x = self.tok_emb(tokens)  # [B, N, E]
        if self.pos_emb is not None:
            n = tokens.shape[1]
            if positions is None and n > self.pos_emb.num_embeddings:
                raise ValueError(f"DebertaEmbedding: {n} tokens is longer than the model's "
                                 f"{self.pos_emb.num_embeddings} positions (max_position_embeddings)")
            x = x + self.pos_emb(torch.arange(n, device=tokens.device) if positions is None else positions)
        if self.type_emb is not None:
            x = x + (self.type_emb.weight[0] if token_type_ids is None else self.type_emb(token_type_ids))
        if self.proj is not None:
            x = self.proj(x)
        return self.norm(x)  # [B, N, C]


class FirstBlock(TransformerBlock):
    """DeBERTa's first layer: the embeddings' padded tokens zeroed (transformers multiplies the embeddings by
    the attention mask, m. 546-553), the :class:`~attnzoo.TransformerBlock`, then with ``conv_kernel_size > 0``
    the ``ConvLayer`` (m. 443-476, 657-658): ``conv_norm(y + act(conv(x)))``, ``y`` the block's output, ``x``
    its (zeroed) input, the convolution's output zeroed at padded tokens before ``act``
    (``padding=(k-1)//2``, ``groups``) and the result zeroed at padded tokens.

    Weights: the block's, and with a kernel ``conv`` (``Conv1d(C, C, k)``) and ``conv_norm``.
    Shapes: ``[B, N, C] -> [B, N, C]``.
    """

    def __init__(self, dim: int, layers: BlockLayers, *, kernel_size: int = 0, groups: int = 1, act: str = "tanh",
                 eps: float = 1e-7) -> None:
        super().__init__(dim, layers=layers)
        self.conv = nn.Conv1d(dim, dim, kernel_size, padding=(kernel_size - 1) // 2, groups=groups) \
            if kernel_size else None
        self.conv_norm = nn.LayerNorm(dim, eps=eps) if kernel_size else None
        self.act_name = act
        self.conv_act = _act(act)

    def forward(self, x: Tensor, context: Tensor | None = None, *, key_padding: Tensor | None = None,
                **kwargs: Any) -> Tensor:
        keep = None if key_padding is None else key_padding[..., None].to(x.dtype)  # [B, N, 1]
        x = x if keep is None else x * keep
        y = super().forward(x, context, key_padding=key_padding, **kwargs)  # [B, N, C]
        if self.conv is None or self.conv_norm is None:
            return y
        out = self.conv(x.transpose(1, 2)).transpose(1, 2)
        out = self.conv_act(out if keep is None else out * keep)
        y = self.conv_norm(y + out)
        return y if keep is None else y * keep

    def extra_repr(self) -> str:
        return "" if self.conv is None else f"conv_act={self.act_name!r}"


def _pos_att(hf: HFConfig) -> tuple[str, ...]:
    """``pos_att_type`` as a tuple (a list, or ``"p2c|c2p"`` in older files; c. 87-89)."""
    raw = hf.raw("pos_att_type", [])
    items = raw.lower().split("|") if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(t, str) for t in items):
        raise hf.unsupported(f"pos_att_type={raw!r}")
    return tuple(t.strip() for t in items)


def _table(hf: HFConfig, dim: int, eps: float) -> RelativePositionTable | None:
    """The shared relative table of ``relative_attention`` (m. 161-168, 568-584), else ``None``."""
    if not hf.get("relative_attention", False, bool):
        return None
    max_rel = hf.get("max_relative_positions", -1)
    max_rel = max_rel if max_rel >= 1 else hf.get("max_position_embeddings", 512)
    buckets = hf.get("position_buckets", -1)
    norms = [t.strip() for t in hf.get("norm_rel_ebd", "none", str).lower().split("|")]
    norm = nn.LayerNorm(dim, eps=eps) if "layer_norm" in norms else None
    return RelativePositionTable(buckets if buckets > 0 else max_rel, dim, buckets=buckets, max_positions=max_rel,
                                 norm=norm)


def _check(hf: HFConfig, C: int, E: int) -> None:
    """Refuse what transformers itself cannot run or attnzoo cannot reproduce."""
    kernel = hf.get("conv_kernel_size", 0)
    if kernel > 0 and kernel % 2 == 0:
        raise hf.unsupported(f"conv_kernel_size={kernel} (even: the convolution shortens the sequence)")
    H = hf.req("num_attention_heads")
    if hf.get("attention_head_size", C // H) * H != C:
        raise hf.unsupported(f"attention_head_size={hf.raw('attention_head_size')} (heads * size other than "
                             f"hidden_size={C}: transformers' output projection takes hidden_size)")
    if hf.get("pooler_hidden_size", C) != C:
        raise hf.unsupported(f"pooler_hidden_size={hf.raw('pooler_hidden_size')} (other than hidden_size={C})")
    if not hf.get("legacy", True, bool) and E != C:
        raise hf.unsupported(f"legacy=False with embedding_size={E} (other than hidden_size={C})")


def _tied(hf: HFConfig) -> bool:
    """The masked-LM decoder is the word embeddings (the new head always, m. 862; the legacy one unless
    ``tie_word_embeddings=False``)."""
    return not hf.get("legacy", True, bool) or hf.get("tie_word_embeddings", True, bool)


def _mlm_head(cfg: EncoderConfig, E: int) -> FactorisedMLMHead:
    """BERT's masked-LM head (``transform``, ``norm``, ``decoder`` + bias) from ``C`` to the embedding
    width ``E`` (legacy head, m. 796-830)."""
    return FactorisedMLMHead(cfg.dim, E, cfg.vocab_size, activation=cfg.ffn, eps=cfg.norm_eps)


def _blocks(hf: HFConfig, table: RelativePositionTable | None, *, v1: bool) -> list[nn.Module]:
    """The layers: post-norm :class:`~attnzoo.TransformerBlock` around :class:`DisentangledAttention`
    (v1: ``pos_proj`` without bias, the scale counting every ``pos_att_type`` entry, :class:`Float32LayerNorm`),
    the first a :class:`FirstBlock`."""
    C, H, eps = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.get("layer_norm_eps", 1e-7, float)
    pos_att = _pos_att(hf)
    attention = functools.partial(DisentangledAttention, C, H, table=table, pos_att=pos_att,
                                  share_keys=hf.get("share_att_key", False, bool), pos_key_bias=not v1,
                                  scale_terms=len(pos_att) if v1 else None)
    ffn = functools.partial(FeedForward, C, hf.req("intermediate_size"), hf.activation("hidden_act", HF_ACTIVATIONS))
    layers = BlockLayers(attention=attention, feed_forward=ffn, norm=functools.partial(
        Float32LayerNorm if v1 else nn.LayerNorm, C, eps=eps), norm_first=False)
    first = FirstBlock(C, layers, kernel_size=max(hf.get("conv_kernel_size", 0), 0), groups=hf.get("conv_groups", 1),
                       act=hf.activation("conv_act", ACTS, "tanh"), eps=eps)
    return [first] + [TransformerBlock(C, layers=layers) for _ in range(hf.req("num_hidden_layers") - 1)]


def build_deberta(hf: HFConfig, *, v1: bool = False, mlm: bool = False, num_labels: int = 0,
                  device: Any = None, dtype: Any = None) -> TransformerEncoder:
    """The :class:`~attnzoo.TransformerEncoder` of a DeBERTa-v2 config, or of a v1 one (``v1``; read as v2
    settings with :data:`V1_SETTINGS`), ``hf`` with :data:`DEFAULTS`; with the masked-LM head (``mlm``) and a
    classifier of ``num_labels`` labels when asked."""
    V, C, depth, H = (hf.req(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"))
    E, eps = hf.get("embedding_size", C), hf.get("layer_norm_eps", 1e-7, float)
    P = hf.get("max_position_embeddings", 512)
    _check(hf, C, E)
    act = hf.activation("hidden_act", HF_ACTIVATIONS)
    cfg = EncoderConfig(V, C, depth, H, max_seq_len=P, type_vocab_size=hf.get("type_vocab_size", 0), pos="none",
                        norm="layer", norm_eps=eps, norm_first=False, final_norm=False, ffn=act,
                        ffn_hidden=hf.req("intermediate_size"))
    table = _table(hf, C, eps)
    embedding = DebertaEmbedding(V, C, embedding_size=E, max_positions=P if hf.get("position_biased_input", True, bool)
                                 else 0, type_vocab_size=cfg.type_vocab_size,
                                 norm=(Float32LayerNorm if v1 else nn.LayerNorm)(C, eps=eps), rel=table)
    classifier = FirstTokenClassifier(C, num_labels, activation=hf.activation("pooler_hidden_act", ACTS)) if num_labels \
        else None
    head = _mlm_head(cfg, E) if mlm else None
    model = TransformerEncoder(config=cfg, parts=EncoderParts(embedding=embedding, blocks=_blocks(hf, table, v1=v1),
                                                              mlm=head, classifier=classifier))
    model = model.to(device=device, dtype=dtype)
    if head is not None and _tied(hf):  # after the move: a move to another device makes new parameters
        head.decoder.weight = embedding.tok_emb.weight
    return model


def _layer(plan: Plan, i: int, attn: DisentangledAttention) -> None:
    """Layer ``i``'s weights (m. 343-441) into ``blocks.{i}``."""
    h, o = f"encoder.layer.{i}.", f"blocks.{i}."
    names = ("query_proj", "key_proj", "value_proj")
    load_qkv_into(plan, o + "attn", tuple(f"{h}attention.self.{n}.weight" for n in names),
                  tuple(f"{h}attention.self.{n}.bias" for n in names), True)
    if attn.pos_key_proj is not None:
        plan.put_pairs(o, h, [("attn.pos_key_proj", "attention.self.pos_key_proj")], bias=attn.pos_key_proj.bias
                       is not None)
    if attn.pos_query_proj is not None:
        plan.put_pairs(o, h, [("attn.pos_query_proj", "attention.self.pos_query_proj")])
    plan.put_pairs(o, h, OUTPUTS)


def _heads_first(w: Tensor, heads: int) -> Tensor:
    """v1's ``in_proj.weight`` (rows per head ``[q_h; k_h; v_h]``, v1 225-227) as rows ``[q; k; v]``."""
    return w.view(heads, 3, -1, w.shape[-1]).transpose(0, 1).reshape(w.shape)


def _zero_key_bias(qv: Tensor) -> Tensor:
    """v1's ``q_bias`` and ``v_bias`` (``[q; v]``) as the ``[q; k; v]`` bias, ``k``'s zero (v1 241-242)."""
    n = qv.shape[0] // 2
    return torch.cat([qv[:n], qv.new_zeros(n), qv[n:]])


def _layer_v1(plan: Plan, i: int, attn: DisentangledAttention) -> None:
    """Layer ``i``'s weights of DeBERTa v1 (``models/deberta/modeling_deberta.py`` 138-277, 415-512): one
    head-interleaved ``in_proj`` without bias, ``q_bias`` / ``v_bias``, ``pos_proj`` (c2p, no bias) and
    ``pos_q_proj`` (p2c)."""
    h, o = f"encoder.layer.{i}.", f"blocks.{i}."
    plan.put(f"{o}attn.qkv_proj.weight", f"{h}attention.self.in_proj.weight",
             functools.partial(_heads_first, heads=attn.num_heads))
    plan.put_cat(f"{o}attn.qkv_proj.bias", [f"{h}attention.self.q_bias", f"{h}attention.self.v_bias"], _zero_key_bias)
    if attn.pos_key_proj is not None:
        plan.put(f"{o}attn.pos_key_proj.weight", f"{h}attention.self.pos_proj.weight")
    if attn.pos_query_proj is not None:
        plan.put_pairs(o, h, [("attn.pos_query_proj", "attention.self.pos_q_proj")])
    plan.put_pairs(o, h, OUTPUTS)


def _embeddings(plan: Plan, emb: DebertaEmbedding) -> None:
    """The embedding's weights (m. 480-510) and the shared relative table (m. 579-584)."""
    pairs = [("tok_emb", "word_embeddings")] + [(ours, theirs) for ours, theirs, part in (
        ("pos_emb", "position_embeddings", emb.pos_emb), ("type_emb", "token_type_embeddings", emb.type_emb),
        ("proj", "embed_proj", emb.proj)) if part is not None]
    plan.put_pairs("embedding.", "embeddings.", pairs, bias=False)
    plan.put_pairs("embedding.", "embeddings.", [("norm", "LayerNorm")])
    if emb.rel is not None:
        plan.put("embedding.rel.weight", "encoder.rel_embeddings.weight")
        if emb.rel.norm is not None:
            plan.put_pairs("embedding.rel.", "encoder.", [("norm", "LayerNorm")])


def _heads(plan: Plan, hf: HFConfig, model: TransformerEncoder, ignore: list[str]) -> None:
    """The masked-LM head (legacy ``cls.predictions`` or ``lm_predictions.lm_head``) and the classifier
    (``pooler.dense``, ``classifier``), outside the ``deberta.`` prefix."""
    plan.src.prefix = ""
    if model.mlm is not None:
        legacy = hf.get("legacy", True, bool)
        head = "cls.predictions." if legacy else "lm_predictions.lm_head."
        plan.put_pairs("mlm.", head, [("transform", "transform.dense" if legacy else "dense"),
                                      ("norm", "transform.LayerNorm" if legacy else "LayerNorm")])
        if _tied(hf):
            plan.put("mlm.decoder.bias", head + "bias")
            ignore.append(r"cls\.predictions\.decoder\.(weight|bias)")
        else:
            plan.put_pairs("mlm.", head, [("decoder", "decoder")])
            ignore.append(r"cls\.predictions\.bias")  # unused by an untied decoder (m. 815-830)
    if model.classifier is not None:
        plan.put_pairs("classifier.", "", [("dense", "pooler.dense"), ("out_proj", "classifier")])


def _settings(hf: HFConfig, v1: bool) -> HFConfig:
    """``hf`` with :data:`DEFAULTS`; a v1 config with :data:`V1_SETTINGS` (what v1 has not), ``talking_head``
    refused."""
    hf = hf.with_defaults(DEFAULTS)
    if not v1:
        return hf
    if hf.get("talking_head", False, bool):
        raise hf.unsupported("talking_head=True")
    return HFConfig({**hf.data, **V1_SETTINGS}, hf.source, hf.arch)


def convert_deberta(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any,
                    v1: bool = False) -> TransformerEncoder:
    """Build the encoder (DeBERTa-v2, or v1 when ``v1``) and copy the weights. The heads follow the weights
    under no ``deberta.`` prefix: ``cls.predictions`` (``legacy``) or ``lm_predictions.lm_head`` the masked-LM
    head, ``pooler.dense`` + ``classifier`` the sequence classifier; other head weights are ignored with a
    ``UserWarning``."""
    hf = _settings(hf, v1)
    prefix = "deberta." if any(k.startswith("deberta.") for k in sd) else ""
    mlm_key = "cls.predictions.transform.dense.weight" if hf.get("legacy", True, bool) else \
        "lm_predictions.lm_head.dense.weight"
    mlm = bool(prefix) and mlm_key in sd
    num_labels = int(sd["classifier.weight"].shape[0]) if prefix and "pooler.dense.weight" in sd and \
        "classifier.weight" in sd else 0
    model = build_deberta(hf, v1=v1, mlm=mlm, num_labels=num_labels, device=device, dtype=dtype or float_dtype(sd))
    plan = Plan(Source(sd, prefix), "DeBERTa" if v1 else "DeBERTa-v2")
    emb = model.embedding
    assert isinstance(emb, DebertaEmbedding)
    _embeddings(plan, emb)
    for i, block in enumerate(model.blocks):
        (_layer_v1 if v1 else _layer)(plan, i, block.attn)
    if getattr(model.blocks[0], "conv", None) is not None:
        plan.put_pairs("blocks.0.", "encoder.conv.", [("conv", "conv"), ("conv_norm", "LayerNorm")])
    ignore = [r"(deberta\.)?embeddings\.position_ids"]
    if emb.pos_emb is None:  # transformers ignores them too (m. 681)
        ignore.append(r"(deberta\.)?embeddings\.position_embeddings\.weight")
    if emb.rel is None:  # built without relative_attention but never used (m. 583-584)
        ignore.append(r"(deberta\.)?encoder\.LayerNorm\.(weight|bias)")
    _heads(plan, hf, model, ignore)
    plan.apply_base(model, prefix=prefix, source=hf.source, ignore=ignore)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "deberta-v2": parts.Dispatch("DeBERTa-v2", convert_deberta, (
        "DebertaV2Model", "DebertaV2ForMaskedLM", "DebertaV2ForSequenceClassification")),
    "deberta": parts.Dispatch("DeBERTa", functools.partial(convert_deberta, v1=True), (
        "DebertaModel", "DebertaForMaskedLM", "DebertaForSequenceClassification"))}
