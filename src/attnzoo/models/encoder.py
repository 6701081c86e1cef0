"""``TransformerEncoder``: a bidirectional encoder (BERT / sentence-embedding shape) and pooling."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.blocks import ACTIVATIONS, NORMS, AttentionSpec, TransformerBlock, make_norm
from attnzoo.models._common import (
    POSITIONS,
    check_int,
    check_padding_mask,
    check_tokens,
    init_weights,
)
from attnzoo.models.decoder import _takes_rope

__all__ = ["POOLINGS", "TransformerEncoder", "cls_pool", "max_pool", "mean_pool"]

POOLINGS = ("mean", "cls", "max")


def _check_hidden(hidden: object, owner: str) -> Tensor:
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
        raise ValueError(f"{owner}: hidden must be a tensor [B, N, C], got {got}")
    return hidden


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
    """Channel-wise max over the real tokens: ``[B, N, C] -> [B, C]``."""
    _check_hidden(hidden, "max_pool")
    if attention_mask is None:
        return hidden.amax(dim=1)
    m = check_padding_mask(attention_mask, hidden.shape[0], hidden.shape[1], "max_pool")
    return hidden.masked_fill(~m[:, :, None], float("-inf")).amax(dim=1)


def cls_pool(hidden: Tensor) -> Tensor:
    """The first token's vector (BERT's ``[CLS]``): ``[B, N, C] -> [B, C]``."""
    return _check_hidden(hidden, "cls_pool")[:, 0]


class TransformerEncoder(nn.Module):
    """Bidirectional transformer encoder over token ids.

    Embeddings: token + absolute positions (``"learned"`` as BERT, ``"sinusoidal"`` as the original
    Transformer; or ``"rope"`` in the attention; or ``"none"``) + optional token types, an optional
    embedding norm; then ``depth`` non-causal :class:`TransformerBlock` and an optional final norm.

    Args:
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

    Shapes: ``tokens [B, N]`` -> ``hidden [B, N, C]``; :meth:`encode` -> ``[B, C]``.
    Weights: ``tok_emb``, ``pos_emb``, ``type_emb``, ``embed_norm``, ``blocks``, ``norm``, ``pooler``.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int,
        num_heads: int,
        *,
        max_seq_len: int = 512,
        pos: str = "learned",
        type_vocab_size: int = 0,
        attention: AttentionSpec = "mha",
        attention_kwargs: dict[str, Any] | None = None,
        norm: str = "layer",
        norm_eps: float = 1e-5,
        norm_first: bool = True,
        embed_norm: bool | None = None,
        final_norm: bool | None = None,
        embed_scale: float | None = None,
        ffn: str = "gelu",
        ffn_hidden: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        rope_base: float = 10000.0,
        pooler: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        owner = "TransformerEncoder"
        self.vocab_size = check_int(vocab_size, "vocab_size", owner)
        self.dim = check_int(dim, "dim", owner)
        self.depth = check_int(depth, "depth", owner)
        self.num_heads = check_int(num_heads, "num_heads", owner)
        self.max_seq_len = check_int(max_seq_len, "max_seq_len", owner)
        self.type_vocab_size = check_int(type_vocab_size, "type_vocab_size", owner, minimum=0)
        if pos not in POSITIONS:
            raise ValueError(f"{owner}: pos must be one of {POSITIONS}, got {pos!r}")
        if norm not in NORMS:
            raise ValueError(f"{owner}: norm must be one of {NORMS}, got {norm!r}")
        if ffn not in ACTIVATIONS:
            raise ValueError(f"{owner}: ffn must be one of {list(ACTIVATIONS)}, got {ffn!r}")
        if isinstance(attention, nn.Module):
            raise TypeError(f"{owner}: attention must be a registry name or a callable (dim, num_heads) -> "
                            f"nn.Module (one module per layer), got an nn.Module instance")
        if dim % num_heads:
            raise ValueError(f"{owner}: dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.pos = pos
        self.embed_scale = None if embed_scale is None else float(embed_scale)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        akw = dict(attention_kwargs or {})
        if isinstance(attention, str):
            akw.setdefault("bias", bias)
            if pos == "rope" and _takes_rope(attention):
                from attnzoo.nn.positional import RotaryEmbedding

                akw.setdefault("rope", RotaryEmbedding(dim // num_heads, base=rope_base))

        self.tok_emb = nn.Embedding(vocab_size, dim, **kw)
        self.pos_emb: nn.Module | None = None
        if pos == "learned":
            from attnzoo.nn.positional import LearnedPositionalEmbedding

            self.pos_emb = LearnedPositionalEmbedding(dim, max_seq_len, **kw)
        elif pos == "sinusoidal":
            from attnzoo.nn.positional import SinusoidalPositionalEncoding

            self.pos_emb = SinusoidalPositionalEncoding(dim, max_seq_len, **kw)
        self.type_emb = nn.Embedding(type_vocab_size, dim, **kw) if type_vocab_size else None
        use_embed_norm = (not norm_first) if embed_norm is None else embed_norm
        self.embed_norm: nn.Module = make_norm(norm, dim, norm_eps, **kw) if use_embed_norm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([
            TransformerBlock(dim, num_heads, attention=attention, attention_kwargs=akw or None, causal=False,
                             norm=norm, norm_eps=norm_eps, norm_first=norm_first, ffn=ffn, ffn_hidden=ffn_hidden,
                             dropout=dropout, bias=bias, **kw)
            for _ in range(depth)
        ])
        use_final = norm_first if final_norm is None else final_norm
        self.norm: nn.Module = make_norm(norm, dim, norm_eps, **kw) if use_final else nn.Identity()
        self.pooler = nn.Linear(dim, dim, **kw) if pooler else None
        init_weights(self, depth=depth)

    def num_parameters(self) -> int:
        """Number of distinct parameters."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, tokens: Tensor, token_type_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """Token + position + type embeddings (normalised when ``embed_norm``): ``[B, N, C]``."""
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
        if self.pos in ("learned", "sinusoidal") and positions is None and n > self.max_seq_len:
            raise ValueError(f"{owner}: {n} tokens is longer than the model's {self.max_seq_len} positions "
                             f"(max_seq_len)")
        if token_type_ids is not None:
            if self.type_emb is None:
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
        attn_pos = positions if self.pos == "rope" else None
        x = self.embed(tokens, token_type_ids, None if self.pos == "rope" else positions)
        for block in self.blocks:
            x = block(x, key_padding=kp, positions=attn_pos)  # [B, N, C]
        return self.norm(x)

    def pooler_output(self, hidden: Tensor) -> Tensor:
        """BERT's pooled output ``tanh(pooler(hidden[:, 0]))``: ``[B, N, C] -> [B, C]``."""
        if self.pooler is None:
            raise ValueError("TransformerEncoder: this model has no pooler (build it with pooler=True)")
        return torch.tanh(self.pooler(cls_pool(hidden)))

    def encode(self, tokens: Tensor, attention_mask: Tensor | None = None, *, pooling: str = "mean",
               normalize: bool = False, token_type_ids: Tensor | None = None) -> Tensor:
        """Sentence embeddings ``[B, C]``: the encoder, then ``pooling`` (``"mean"`` over real tokens
        as sentence-transformers, ``"cls"``, ``"max"``), then L2 normalisation if ``normalize``."""
        if pooling not in POOLINGS:
            raise ValueError(f"TransformerEncoder.encode: pooling must be one of {POOLINGS}, got {pooling!r}")
        hidden = self(tokens, attention_mask=attention_mask, token_type_ids=token_type_ids)
        if pooling == "mean":
            out = mean_pool(hidden, attention_mask)
        elif pooling == "max":
            out = max_pool(hidden, attention_mask)
        else:
            out = cls_pool(hidden)
        return F.normalize(out, dim=-1) if normalize else out

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str], *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> TransformerEncoder:
        """Load a BERT-style encoder from a folder with ``config.json`` + ``model.safetensors``
        (no ``transformers`` needed); see :func:`attnzoo.interop.load_bert`."""
        from attnzoo.interop import load_bert

        return load_bert(folder, device=device, dtype=dtype)
