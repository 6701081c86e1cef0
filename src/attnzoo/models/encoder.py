"""``TransformerEncoder``: a bidirectional encoder (BERT / sentence-embedding shape) and pooling."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import check_choice, check_float_tensor
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
from attnzoo.models.parts import EncoderParts, given_blocks

__all__ = ["POOLINGS", "TransformerEncoder", "cls_pool", "max_pool", "mean_pool"]

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
        if parts is None:
            parts = EncoderParts()
        elif not isinstance(parts, EncoderParts):
            raise TypeError(f"{owner}: parts must be an EncoderParts, got {type(parts).__name__}")
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
        self.blocks = nn.ModuleList(given_blocks(parts.blocks, cfg.depth, owner) if parts.blocks is not None else [
            TransformerBlock(config=self.block_config(cfg), **kw) for _ in range(cfg.depth)])
        use_final = cfg.norm_first if cfg.final_norm is None else cfg.final_norm
        self.norm: nn.Module = parts.norm if parts.norm is not None else \
            make_norm(cfg.norm, cfg.dim, cfg.norm_eps, **kw) if use_final else nn.Identity()
        self.pooler = nn.Linear(cfg.dim, cfg.dim, **kw) if cfg.pooler else None
        self.classifier = nn.Linear(cfg.dim, cfg.num_labels, **kw) if cfg.num_labels else parts.classifier
        self.mlm = MaskedLMHead(cfg, **kw) if cfg.mlm_head else parts.mlm
        self._given_heads = parts.classifier is not None, parts.mlm is not None
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

    def forward(self, tokens: Tensor, *, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                positions: Tensor | None = None) -> Tensor:
        """Args:
            tokens: ``[B, N]`` token ids.
            attention_mask: ``[B, N]`` bool (or 0/1), True for real tokens; padded keys are hidden.
            token_type_ids: ``[B, N]`` ids in ``[0, type_vocab_size)`` (default all 0).
            positions: ``[N]`` or ``[B, N]`` absolute positions (default ``0..N-1``).

        Returns: ``hidden [B, N, C]`` (padded positions hold unspecified values; pool with the mask).
        """
        owner = "TransformerEncoder"
        check_tokens(tokens, self.vocab_size, owner)
        B, n = tokens.shape
        if self.pos in ("learned", "sinusoidal") and self.pos_emb is not None and positions is None \
                and n > self.max_seq_len:
            raise ValueError(f"{owner}: {n} tokens is longer than the model's {self.max_seq_len} positions "
                             f"(max_seq_len)")
        if token_type_ids is not None:
            if not self.type_vocab_size:
                raise ValueError(f"{owner}: token_type_ids given but the model has no token types "
                                 f"(type_vocab_size=0)")
            check_tokens(token_type_ids, self.type_vocab_size, owner, "token_type_ids")
            if token_type_ids.shape != tokens.shape:
                raise ValueError(f"{owner}: token_type_ids shape {tuple(token_type_ids.shape)} != tokens shape "
                                 f"{tuple(tokens.shape)}")
        kp = None
        if attention_mask is not None:
            am = check_padding_mask(attention_mask, B, n, owner)
            kp = am  # [B, N]
        attn_pos = positions if self.pos == "rope" or self.given_blocks else None
        x = self.embed(tokens, token_type_ids, None if self.pos == "rope" else positions)
        for block in self.blocks:
            x = block(x, key_padding=kp, positions=attn_pos)  # [B, N, C]
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
        if self._given_heads[0]:
            return self.classifier(_check_hidden(hidden, "TransformerEncoder.classify"), attention_mask)
        return self.classifier(self.pooler_output(hidden))

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """Masked-LM logits ``[B, N, C] -> [B, N, V]`` (BERT's ``BertForMaskedLM``; needs ``mlm_head``)."""
        if self.mlm is None:
            raise ValueError("TransformerEncoder: this model has no masked-LM head (build it with mlm_head=True)")
        return self.mlm(hidden)

    def encode(self, tokens: Tensor, attention_mask: Tensor | None = None, *, pooling: str = "mean",
               normalize: bool = False, token_type_ids: Tensor | None = None) -> Tensor:
        """Sentence embeddings ``[B, C]``: the encoder, then ``pooling`` (``"mean"`` over real tokens
        as sentence-transformers, ``"cls"``, ``"max"``), then L2 normalisation if ``normalize``."""
        check_choice(pooling, "pooling", "TransformerEncoder.encode", choices=POOLINGS)
        hidden = self(tokens, attention_mask=attention_mask, token_type_ids=token_type_ids)
        if pooling == "mean":
            out = mean_pool(hidden, attention_mask)
        elif pooling == "max":
            out = max_pool(hidden, attention_mask)
        else:
            out = cls_pool(hidden)
        return F.normalize(out, dim=-1) if normalize else out
