"""``TransformerEncoder``: a bidirectional encoder (BERT / sentence-embedding shape) and pooling."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import check_choice, check_float_tensor, check_int, check_probability
from attnzoo.blocks import ACTIVATIONS, AttentionSpec, BlockConfig, TransformerBlock, make_norm
from attnzoo.models._common import (
    FromConfig,
    check_padding_mask,
    check_tokens,
    init_weights,
    position_table,
    rotary_for,
)
from attnzoo.models.config import EncoderConfig
from attnzoo.models.parts import EncoderParts, given_blocks, resolve_parts
from attnzoo.nn.frontier import packed_cu_seqlens, packed_positions

__all__ = ["POOLINGS", "FactorisedMLMHead", "FirstTokenClassifier", "TransformerEncoder", "cls_pool", "max_pool", "mean_pool"]

POOLINGS = ("mean", "cls", "max")


def _check_hidden(hidden: object, owner: str) -> Tensor:
    return check_float_tensor(hidden, "hidden", owner, "[B, N, C]", nonempty=1)


def mean_pool(hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Mean of the real tokens' vectors (sentence-transformers' pooling): ``[B, N, C] -> [B, C]``.

    ``attention_mask [B, N]`` (bool or 0/1), True for real tokens; padded tokens are ignored.
    A row without real tokens gives zeros.
    """
    _check_hidden(hidden, "mean_pool")
    if attention_mask is None:
        return hidden.mean(dim=1)
    m = check_padding_mask(attention_mask, hidden.shape[0], hidden.shape[1], "mean_pool").to(hidden.dtype)
    total = torch.einsum("bnc,bn->bc", hidden, m)  # [B, C]
    return total / m.sum(dim=1, keepdim=True).clamp(min=1e-9)


def max_pool(hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Channel-wise max over the real tokens: ``[B, N, C] -> [B, C]``; a row without real tokens
    gives zeros (as :func:`mean_pool`; its max over nothing was ``-inf``)."""
    _check_hidden(hidden, "max_pool")
    if attention_mask is None:
        return hidden.amax(dim=1)
    m = check_padding_mask(attention_mask, hidden.shape[0], hidden.shape[1], "max_pool")
    out = hidden.masked_fill(~m[:, :, None], float("-inf")).amax(dim=1)  # [B, C]
    return torch.where(m.any(dim=1, keepdim=True), out, torch.zeros_like(out))


def cls_pool(hidden: Tensor) -> Tensor:
    """The first token's vector (BERT's ``[CLS]``): ``[B, N, C] -> [B, C]``."""
    return _check_hidden(hidden, "cls_pool")[:, 0]


class MaskedLMHead(nn.Module):
    """BERT's masked-LM head: ``decoder(norm(act(transform(hidden))))``, the decoder weight tied to
    the token embeddings (set by the encoder), with its own bias.

    Weights: ``transform [C, C]``, ``norm``, ``decoder [V, C]`` + ``decoder.bias [V]``.
    Shapes: ``[B, N, C] -> [B, N, V]``.
    """

    def __init__(self, cfg: EncoderConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        act, gated = ACTIVATIONS[cfg.ffn]
        if gated:
            raise ValueError(f"TransformerEncoder: mlm_head needs a plain activation, got ffn={cfg.ffn!r}")
        self.act = act
        self.transform = nn.Linear(cfg.dim, cfg.dim, device=device, dtype=dtype)
        self.norm = make_norm(cfg.norm, cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.decoder = nn.Linear(cfg.dim, cfg.vocab_size, device=device, dtype=dtype)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.norm(self.act(self.transform(hidden))))  # [B, N, V]


class FactorisedMLMHead(nn.Module):
    """A masked-LM head through the embedding width ``E``: ``decoder(norm(act(transform(hidden))))``
    (ELECTRA's generator head, ALBERT's ``AlbertMLMHead``, DeBERTa's legacy head; with ``E = C``
    DistilBERT's ``vocab_*`` layers, RoBERTa's / MPNet's / GTE's ``lm_head``). The decoder weight ``[V, E]`` is the token embedding's when the builder ties it.

    Weights: ``transform [E, C]`` + bias, ``norm`` (LayerNorm over ``E``), ``decoder [V, E]`` + bias.
    Shapes: ``[B, N, C] -> [B, N, V]``.
    """

    def __init__(self, dim: int, width: int, vocab_size: int, *, activation: str, eps: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        check_choice(activation, "activation", "FactorisedMLMHead", choices=ACTIVATIONS)
        if ACTIVATIONS[activation][1]:
            raise ValueError(f"FactorisedMLMHead: activation must not be gated, got {activation!r}")
        self.act = ACTIVATIONS[activation][0]
        self.transform = nn.Linear(dim, width, **kw)
        self.norm = nn.LayerNorm(width, eps=eps, **kw)
        self.decoder = nn.Linear(width, vocab_size, **kw)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.norm(self.act(self.transform(hidden))))  # [B, N, V]


class FirstTokenClassifier(nn.Module):
    """A sequence classifier of the first token: ``out_proj(act(dense(hidden[:, 0])))`` — RoBERTa's
    and MPNet's classification head (``tanh``), DistilBERT's ``pre_classifier`` (``relu``),
    ELECTRA's (``gelu``); the first slot whatever the mask (a pad in a left-padded row, as in
    transformers). ``dropout`` between the layers in training.

    Weights: ``dense [C, C]``, ``out_proj [L, C]``, both biased.
    Shapes: ``hidden [B, N, C]`` (``attention_mask [B, N]`` unused) -> ``[B, L]``.
    """

    def __init__(self, dim: int, num_labels: int, *, activation: str = "tanh", dropout: float = 0.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        owner = "FirstTokenClassifier"
        check_int(dim, "dim", owner)
        check_int(num_labels, "num_labels", owner)
        check_probability(dropout, "dropout", owner)
        check_choice(activation, "activation", owner, choices=("tanh", *ACTIVATIONS))
        act, gated = (torch.tanh, False) if activation == "tanh" else ACTIVATIONS[activation]
        if gated:
            raise ValueError(f"FirstTokenClassifier: activation must not be gated, got {activation!r}")
        self.act = act
        self.dense = nn.Linear(dim, dim, device=device, dtype=dtype)
        self.out_proj = nn.Linear(dim, num_labels, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        first = self.dropout(cls_pool(hidden))  # [B, C]
        return self.out_proj(self.dropout(self.act(self.dense(first))))  # [B, L]


def _packs(block: nn.Module) -> bool:
    """Whether an encoder layer takes packed sequences (see :attr:`TransformerEncoder.packable`)."""
    return isinstance(block, TransformerBlock) and (type(block).forward is TransformerBlock.forward
                                                    or getattr(type(block), "takes_packed", False) is True)


class TransformerEncoder(FromConfig, nn.Module):
    """Bidirectional transformer encoder over token ids.

    Embeddings: token + absolute positions (``"learned"`` as BERT, ``"sinusoidal"`` as the original
    Transformer; or ``"rope"`` in the attention; or ``"none"``) + optional token types, an optional
    embedding norm; then ``depth`` non-causal :class:`TransformerBlock` and an optional final norm.

    Build it from an :class:`~attnzoo.models.EncoderConfig` (``config=``, ``from_config``; preset
    ``bert``). The constructor's own keywords (``vocab_size``, ``dim``, ``depth``, ``num_heads``,
    ``attention``, ``max_seq_len``, ``pos``, ``type_vocab_size``) are shorthands for those fields
    and override ``config``'s when given; every other field goes through ``config=`` (an unknown
    keyword is a ``TypeError`` naming it). A BERT folder loads with :func:`attnzoo.interop.load_bert`.

    The config's fields:
        vocab_size, dim, depth, num_heads: vocabulary ``V``, width ``C``, blocks, heads.
        max_seq_len: number of positions of the learned/sinusoidal table.
        pos: ``"learned" | "sinusoidal" | "rope" | "none"``.
        type_vocab_size: number of token types (BERT: 2); 0 = none.
        attention, attention_kwargs: the mixer (registry name or factory), as in :class:`DecoderLM`.
        norm, norm_eps, norm_first: normalisation kind, epsilon, pre-norm (``True``) or post-norm
            (``False``, BERT and the original Transformer).
        embed_norm: normalise the summed embeddings (BERT); default ``not norm_first``.
        final_norm: normalise the last block's output; default ``norm_first``.
        embed_scale: multiply token embeddings by this (``sqrt(dim)`` in the original Transformer).
        ffn, ffn_hidden, dropout, bias: as in :class:`TransformerBlock`.
        pooler: add BERT's pooler (``tanh(Linear(hidden[:, 0]))``, see :meth:`pooler_output`).
        num_labels: add a classifier of the pooled output (:meth:`classify`); 0 = none.
        mlm_head: add BERT's masked-LM head (:meth:`mlm_logits`).

    Shapes: ``tokens [B, N]`` -> ``hidden [B, N, C]``; :meth:`encode` -> ``[B, C]``.
    Weights: ``tok_emb``, ``pos_emb``, ``type_emb``, ``embed_norm``, ``blocks``, ``norm``, ``pooler``,
    ``classifier``, ``mlm`` (:class:`MaskedLMHead`).
    """

    config_class = EncoderConfig

    def __init__(self, vocab_size: int | None = None, dim: int | None = None, depth: int | None = None,
                 num_heads: int | None = None, *, attention: AttentionSpec | None = None,
                 max_seq_len: int | None = None, pos: str | None = None, type_vocab_size: int | None = None,
                 config: EncoderConfig | None = None, parts: EncoderParts | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        owner = "TransformerEncoder"
        cfg = EncoderConfig.resolve(config, owner, {
            "vocab_size": vocab_size, "dim": dim, "depth": depth, "num_heads": num_heads, "attention": attention,
            "max_seq_len": max_seq_len, "pos": pos, "type_vocab_size": type_vocab_size})
        parts = resolve_parts(parts, EncoderParts, owner)
        for field, part in (("mlm_head", parts.mlm), ("num_labels", parts.classifier)):
            if part is not None and getattr(cfg, field):
                raise ValueError(f"{owner}: {field}={getattr(cfg, field)!r} builds the head that "
                                 f"EncoderParts gives; keep one of them")
        self.config = cfg
        self.vocab_size, self.dim, self.depth, self.num_heads = cfg.vocab_size, cfg.dim, cfg.depth, cfg.num_heads
        self.max_seq_len, self.type_vocab_size, self.pos = cfg.max_seq_len, cfg.type_vocab_size, cfg.pos
        self.embed_scale = None if cfg.embed_scale is None else float(cfg.embed_scale)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embedding = parts.embedding
        own = parts.embedding is None
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim, **kw) if own else None
        self.pos_emb = position_table(cfg.pos, cfg.dim, cfg.max_seq_len, **kw) if own else None
        self.type_emb = nn.Embedding(cfg.type_vocab_size, cfg.dim, **kw) if own and cfg.type_vocab_size else None
        use_embed_norm = own and ((not cfg.norm_first) if cfg.embed_norm is None else cfg.embed_norm)
        self.embed_norm: nn.Module = make_norm(cfg.norm, cfg.dim, cfg.norm_eps, **kw) if use_embed_norm \
            else nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)
        self.given_blocks = parts.blocks is not None
        if not self.given_blocks and cfg.dim % cfg.num_heads:  # given blocks hold their own head widths (T5's d_kv)
            raise ValueError(f"{owner}: dim ({cfg.dim}) must be divisible by num_heads ({cfg.num_heads})")
        self.blocks = nn.ModuleList(given_blocks(parts.blocks, cfg.depth, owner) if parts.blocks is not None else [
            TransformerBlock(config=self.block_config(cfg), **kw) for _ in range(cfg.depth)])
        use_final = cfg.norm_first if cfg.final_norm is None else cfg.final_norm
        self.norm: nn.Module = parts.norm if parts.norm is not None else \
            make_norm(cfg.norm, cfg.dim, cfg.norm_eps, **kw) if use_final else nn.Identity()
        self.pooler = nn.Linear(cfg.dim, cfg.dim, **kw) if cfg.pooler else None
        self.classifier = nn.Linear(cfg.dim, cfg.num_labels, **kw) if cfg.num_labels else parts.classifier
        self.mlm = MaskedLMHead(cfg, **kw) if cfg.mlm_head else parts.mlm
        self._own_classifier = parts.classifier is None
        given = {name for name, part in (("embedding", parts.embedding), ("blocks", parts.blocks), ("norm", parts.norm),
                                         ("mlm", parts.mlm), ("classifier", parts.classifier)) if part is not None}
        for name, child in self.named_children():  # given parts keep their own weights
            if name not in given:
                init_weights(child, depth=cfg.depth)
        if cfg.mlm_head and self.mlm is not None and self.tok_emb is not None:
            self.mlm.decoder.weight = self.tok_emb.weight

    @staticmethod
    def block_config(cfg: EncoderConfig) -> BlockConfig:
        """The (non-causal) :class:`~attnzoo.blocks.BlockConfig` of every layer."""
        akw = dict(cfg.attention_kwargs or {})
        if isinstance(cfg.attention, str):
            akw.setdefault("bias", cfg.bias)
            rope = rotary_for(cfg.pos, cfg.attention, akw, cfg.dim // cfg.num_heads, cfg.rope_base)
            if rope is not None:
                akw["rope"] = rope
        return BlockConfig(cfg.dim, cfg.num_heads, attention=cfg.attention, attention_kwargs=akw or None,
                           causal=False, norm=cfg.norm, norm_eps=cfg.norm_eps, norm_first=cfg.norm_first,
                           ffn=cfg.ffn, ffn_hidden=cfg.ffn_hidden, dropout=cfg.dropout, bias=cfg.bias)

    def embed(self, tokens: Tensor, token_type_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """Token + position + type embeddings (normalised when ``embed_norm``), or the given
        ``EncoderParts.embedding``: ``[B, N, C]``."""
        if self.embedding is not None:
            return self.drop(self.embedding(tokens, token_type_ids, positions))
        assert self.tok_emb is not None  # built when no embedding part is given
        x = self.tok_emb(tokens)  # [B, N, C]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.pos_emb is not None:
            x = self.pos_emb(x, positions)
        if self.type_emb is not None:
            if token_type_ids is None:
                x = x + self.type_emb.weight[0]
            else:
                x = x + self.type_emb(token_type_ids)
        return self.drop(self.embed_norm(x))

    @property
    def packable(self) -> bool:
        """Whether :meth:`forward` takes packed sequences (``cu_seqlens``): the config's embedding (or
        a given one with a ``packed`` form, :class:`~attnzoo.models.parts.PackedFromZero`) and
        :class:`~attnzoo.TransformerBlock` layers that keep its forward (their mixers run packed
        sequences in one call, or one sequence at a time: exact either way). A block class with its
        own forward (DeBERTa's first layer) is not assumed to take them unless it says so with a true
        class attribute ``takes_packed`` (the float16-clamped layers of T5 and BART's lineage)."""
        embeds = self.embedding is None or callable(getattr(self.embedding, "packed", None))
        return embeds and all(_packs(b) for b in self.blocks)

    def forward(self, tokens: Tensor, *, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """Args:
            tokens: ``[B, N]`` token ids, or ``[1, T]`` packed sequences with ``cu_seqlens``.
            attention_mask: ``[B, N]`` bool (or 0/1), True for real tokens; padded keys are hidden.
            token_type_ids: ``[B, N]`` ids in ``[0, type_vocab_size)`` (default all 0).
            positions: ``[N]`` or ``[B, N]`` absolute positions (default ``0..N-1``).
            cu_seqlens: int32 ``[S+1]``: ``tokens [1, T]`` holds ``S`` sequences end to end (no padding),
                sequence ``i`` at ``cu_seqlens[i]:cu_seqlens[i+1]``, each attending only to itself and
                positioned from 0 (as a right-padded row); needs :attr:`packable`.

        Returns: ``hidden [B, N, C]`` (padded positions hold unspecified values; pool with the mask),
        or ``[1, T, C]`` packed.
        """
        owner = "TransformerEncoder"
        check_tokens(tokens, self.vocab_size, owner)
        if cu_seqlens is not None:
            return self._packed(tokens, cu_seqlens, token_type_ids, attention_mask, positions)
        B, n = tokens.shape
        if self.pos in ("learned", "sinusoidal") and self.pos_emb is not None and positions is None \
                and n > self.max_seq_len:
            raise ValueError(f"{owner}: {n} tokens is longer than the model's {self.max_seq_len} positions "
                             f"(max_seq_len)")
        self._check_types(token_type_ids, tokens)
        kp = None
        if attention_mask is not None:
            am = check_padding_mask(attention_mask, B, n, owner)
            kp = am  # [B, N]
        attn_pos = positions if self.pos == "rope" or self.given_blocks else None
        x = self.embed(tokens, token_type_ids, None if self.pos == "rope" else positions)
        for block in self.blocks:
            x = block(x, key_padding=kp, positions=attn_pos)  # [B, N, C]
        return self.norm(x)

    def _check_types(self, token_type_ids: Tensor | None, tokens: Tensor) -> None:
        owner = "TransformerEncoder"
        if token_type_ids is None:
            return
        if not self.type_vocab_size:
            raise ValueError(f"{owner}: token_type_ids given but the model has no token types (type_vocab_size=0)")
        check_tokens(token_type_ids, self.type_vocab_size, owner, "token_type_ids")
        if token_type_ids.shape != tokens.shape:
            raise ValueError(f"{owner}: token_type_ids shape {tuple(token_type_ids.shape)} != tokens shape "
                             f"{tuple(tokens.shape)}")

    def _packed(self, tokens: Tensor, cu_seqlens: Tensor, token_type_ids: Tensor | None,
                attention_mask: Tensor | None, positions: Tensor | None) -> Tensor:
        """:meth:`forward` of packed sequences ``tokens [1, T]`` -> ``[1, T, C]``."""
        owner = "TransformerEncoder"
        if attention_mask is not None or positions is not None:
            raise ValueError(f"{owner}: packed input (cu_seqlens) takes no attention_mask or positions: the "
                             "sequences are unpadded and each is positioned from 0")
        if not self.packable:
            kinds = sorted({type(b).__name__ for b in self.blocks if not _packs(b)})
            raise ValueError(f"{owner}: packed input (cu_seqlens) needs the config's embedding (or one with a "
                             f"packed form) and TransformerBlock layers; this model has "
                             f"{'blocks ' + str(kinds) if kinds else 'a given embedding without a packed form'}")
        cu = packed_cu_seqlens(cu_seqlens, tokens.unsqueeze(-1), owner)
        pos = packed_positions(cu, tokens.shape[1])  # [T], restarting per sequence
        if self.pos in ("learned", "sinusoidal") and pos.numel() and int(pos.max()) >= self.max_seq_len:
            raise ValueError(f"{owner}: a packed sequence of {int(pos.max()) + 1} tokens is longer than the "
                             f"model's {self.max_seq_len} positions (max_seq_len)")
        self._check_types(token_type_ids, tokens)
        if self.embedding is not None:
            x = self.drop(self.embedding.packed(tokens, token_type_ids, cu))  # [1, T, C]
        else:
            x = self.embed(tokens, token_type_ids, None if self.pos == "rope" else pos[None])  # [1, T, C]
        for block in self.blocks:
            x = block(x, cu_seqlens=cu)  # [1, T, C]
        return self.norm(x)

    def pooler_output(self, hidden: Tensor) -> Tensor:
        """BERT's pooled output ``tanh(pooler(hidden[:, 0]))``: ``[B, N, C] -> [B, C]``."""
        if self.pooler is None:
            raise ValueError("TransformerEncoder: this model has no pooler (build it with pooler=True)")
        return torch.tanh(self.pooler(cls_pool(hidden)))

    def classify(self, hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Sequence-classification logits ``classifier(pooler_output(hidden))``: ``[B, N, C] -> [B, L]``
        (BERT's ``BertForSequenceClassification``; needs ``num_labels``), or the given
        ``EncoderParts.classifier`` with its own pooling over the real tokens of ``attention_mask [B, N]``."""
        if self.classifier is None:
            raise ValueError("TransformerEncoder: this model has no classifier (build it with num_labels=...)")
        if not self._own_classifier:
            return self.classifier(_check_hidden(hidden, "TransformerEncoder.classify"), attention_mask)
        return self.classifier(self.pooler_output(hidden))

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """Masked-LM logits ``[B, N, C] -> [B, N, V]`` (BERT's ``BertForMaskedLM``; needs ``mlm_head``)."""
        if self.mlm is None:
            raise ValueError("TransformerEncoder: this model has no masked-LM head (build it with mlm_head=True)")
        return self.mlm(hidden)

    def encode(self, tokens: Tensor, attention_mask: Tensor | None = None, *, pooling: str = "mean",
               normalize: bool = False, token_type_ids: Tensor | None = None, packed: bool | None = None) -> Tensor:
        """Sentence embeddings ``[B, C]``: the encoder, then ``pooling`` (``"mean"`` over real tokens
        as sentence-transformers, ``"cls"``, ``"max"``), then L2 normalisation if ``normalize``.

        ``packed``: run only the real tokens of a right-padded batch, as packed sequences
        (``cu_seqlens``: no work on padding, the same embeddings as the padded forward). ``None``
        (default) packs when the model is :attr:`packable` with plain :class:`~attnzoo.TransformerBlock`
        layers and ``attention_mask`` is right-padded with some padding — measured never slower and up
        to 2x faster on sentence batches (``benchmarks/bench_encoders.py``); ``True`` requires it (and
        packs the layers that say ``takes_packed`` too: T5's, BART's lineage's); ``False`` never packs."""
        owner = "TransformerEncoder.encode"
        check_choice(pooling, "pooling", owner, choices=POOLINGS)
        if packed is not None and not isinstance(packed, bool):
            raise TypeError(f"{owner}: packed must be a bool or None, got {type(packed).__name__}")
        keep = None
        if attention_mask is not None and packed is not False:
            check_tokens(tokens, self.vocab_size, owner)
            self._check_types(token_type_ids, tokens)
            keep = check_padding_mask(attention_mask, tokens.shape[0], tokens.shape[1], owner)
            lengths = keep.sum(1)
            right = bool((keep == (torch.arange(keep.shape[1], device=keep.device) < lengths[:, None])).all())
            if packed and not (right and self.packable):
                raise ValueError(f"{owner}: packed=True needs a right-padded attention_mask and a packable model "
                                 f"(right-padded: {right}, packable: {self.packable})")
            plain = all(type(b).forward is TransformerBlock.forward for b in self.blocks)  # default: plain layers
            if not (right and self.packable and (packed or plain) and 0 < int(lengths.sum()) < keep.numel()):
                keep = None
        if keep is not None:
            out = self._encode_packed(tokens, keep, token_type_ids, pooling)
        else:
            if packed:
                raise ValueError(f"{owner}: packed=True needs an attention_mask")
            hidden = self(tokens, attention_mask=attention_mask, token_type_ids=token_type_ids)
            out = self.pool(hidden, attention_mask, pooling)
        return F.normalize(out, dim=-1) if normalize else out

    @staticmethod
    def pool(hidden: Tensor, attention_mask: Tensor | None, pooling: str) -> Tensor:
        """``hidden [B, N, C] -> [B, C]`` by :func:`mean_pool`, :func:`max_pool` or :func:`cls_pool`
        (``pooling``: one of :data:`POOLINGS`; ``attention_mask [B, N]``: the real tokens)."""
        check_choice(pooling, "pooling", "TransformerEncoder.pool", choices=POOLINGS)
        if pooling == "mean":
            return mean_pool(hidden, attention_mask)
        if pooling == "max":
            return max_pool(hidden, attention_mask)
        return cls_pool(hidden)

    def _encode_packed(self, tokens: Tensor, keep: Tensor, token_type_ids: Tensor | None, pooling: str) -> Tensor:
        """:meth:`encode` of the real tokens ``keep [B, N]`` (right-padded) as packed sequences."""
        lengths = keep.sum(1)  # [B]
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # [B+1]
        types = None if token_type_ids is None else token_type_ids[keep][None]
        h = self(tokens[keep][None], token_type_ids=types, cu_seqlens=cu)[0]  # [T, C]
        B, C = keep.shape[0], h.shape[-1]
        seg = torch.repeat_interleave(torch.arange(B, device=h.device), lengths)  # [T]
        some = (lengths > 0)[:, None]
        if pooling == "mean":
            total = torch.zeros(B, C, dtype=h.dtype, device=h.device).index_add_(0, seg, h)
            return total / lengths.clamp(min=1)[:, None].to(h.dtype)
        if pooling == "max":
            top = torch.full((B, C), float("-inf"), dtype=h.dtype, device=h.device)
            top = top.scatter_reduce(0, seg[:, None].expand(-1, C), h, "amax")
            return torch.where(some, top, torch.zeros_like(top))
        first = h[cu[:-1].long().clamp(max=h.shape[0] - 1)]  # [B, C]
        return torch.where(some, first, torch.zeros_like(first))
