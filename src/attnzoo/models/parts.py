"""The parts a :class:`~attnzoo.DecoderLM` (or a :class:`~attnzoo.TransformerEncoder`) is assembled
from, for builders that inject them.

A decoder is a token embedding, a list of blocks, a final norm and a head. By default
``DecoderLM`` builds all four from its :class:`~attnzoo.models.DecoderConfig`; a family builder
(or a user) passes the ones that differ as modules in :class:`DecoderParts` instead of setting
flags on a shared config (torchtune's ``TransformerDecoder(tok_embeddings=, layers=, norm=,
output=)``)::

    parts = DecoderParts(embedding=ScaledEmbedding(V, C, scale=C ** 0.5),   # Gemma's sqrt(C)
                         head=LMHead(C, V, softcap=30.0))                     # Gemma 2's logit softcap
    lm = DecoderLM(config=cfg, parts=parts)

The weight names do not change with the parts (``tok_emb.weight``, ``norm.weight``,
``lm_head.weight``): :class:`ScaledEmbedding` is an ``nn.Embedding`` and :class:`LMHead` an
``nn.Linear``, so state dicts saved before parts existed load as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

from attnzoo._validate import check_bool, check_int, check_positive_float
from attnzoo.models.mtp import MultiTokenPredictor
from attnzoo.nn.frontier import packed_positions

__all__ = ["DecoderParts", "EncoderParts", "LMHead", "PackedFromZero", "ScaledEmbedding", "ViTParts", "given_blocks",
           "head_for", "resolve_parts"]


class ScaledEmbedding(nn.Embedding):
    """A token embedding whose vectors are multiplied by ``scale`` (Gemma and the original
    Transformer use ``sqrt(dim)``). Weight: ``weight [V, C]``, as ``nn.Embedding``.

    Shapes: ``tokens [B, N]`` -> ``[B, N, C]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, scale: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        checked = check_positive_float(scale, "scale", "ScaledEmbedding", optional=True)
        if checked is None:
            raise TypeError("ScaledEmbedding: scale must be a float > 0, got None (use nn.Embedding for no scale)")
        self.scale = checked

    def forward(self, tokens: Tensor) -> Tensor:
        return super().forward(tokens) * self.scale  # [B, N, C]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"


class LMHead(nn.Linear):
    """The language-model head: ``logits = x W^T`` over the vocabulary, optionally soft-capped
    (``c * tanh(logits / c)``, Gemma 2's ``final_logit_softcapping``). It is the head a
    :class:`~attnzoo.DecoderLM` ties to its token embedding (``tie_embeddings``) and samples from
    in :meth:`~attnzoo.DecoderLM.generate`. Weight: ``weight [V, C]`` (no bias by default).

    Shapes: ``[B, N, C]`` -> ``[B, N, V]``.
    """

    def __init__(self, dim: int, vocab_size: int, *, softcap: float | None = None, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        check_int(dim, "dim", "LMHead")
        check_int(vocab_size, "vocab_size", "LMHead")
        check_bool(bias, "bias", "LMHead")
        super().__init__(dim, vocab_size, bias=bias, device=device, dtype=dtype)
        self.softcap = check_positive_float(softcap, "softcap", "LMHead", optional=True)

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x)  # [B, N, V]
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def extra_repr(self) -> str:
        cap = "" if self.softcap is None else f", softcap={self.softcap:g}"
        return f"{super().extra_repr()}{cap}"


def head_for(dim: int, vocab_size: int, size: int | None, *, softcap: float | None = None,
             device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> nn.Module | None:
    """The head a converted checkpoint has, for ``DecoderParts(head=...)``: ``size=None`` the
    :class:`LMHead` over the vocabulary with the final-logit ``softcap`` (it belongs to the LM
    head only, as in transformers), or ``None`` without a softcap (the model's default head, which
    it builds and initialises itself),
    ``0`` none (``nn.Identity``: the model returns its final hidden states ``[B, N, C]``), ``k`` a
    ``k``-way per-token classification head (``nn.Linear(dim, k, bias=False)``, transformers'
    ``score``)."""
    if size is None:
        return None if softcap is None else LMHead(dim, vocab_size, softcap=softcap, device=device, dtype=dtype)
    check_int(size, "size", "head_for", minimum=0)
    if size == 0:
        return nn.Identity()
    return nn.Linear(dim, size, bias=False, device=device, dtype=dtype)


Blocks = Sequence[nn.Module] | Callable[[int], nn.Module]


@dataclass(frozen=True)
class DecoderParts:
    """Modules a :class:`~attnzoo.DecoderLM` takes as they are instead of building them from its
    config (each ``None``: built from the config). Given parts keep their own weights.

    Fields:
        blocks: one module per layer (``depth`` of them; e.g. :class:`~attnzoo.TransformerBlock`
            with cross-attention, per-layer windows, QK norms, sub-layer output norms), or a
            factory ``layer -> module``. The config's block fields (``attention``,
            ``attention_kwargs``, ``num_kv_heads``, ``ffn``, ``ffn_hidden``) must then keep
            their defaults: they would be ignored (:func:`~attnzoo.models.decoder.outer_config`).
        embedding: ``tokens [B, N] -> [B, N, C]`` (default ``nn.Embedding(V, C)``; e.g.
            :class:`ScaledEmbedding`). Tied to an :class:`LMHead` by ``tie_embeddings`` when it
            has a ``weight [V, C]``.
        norm: the final norm (default: the config's ``norm``); ``nn.Identity()`` for none.
        head: ``[B, N, C] -> [B, N, *]`` (default :class:`LMHead` over the vocabulary); a
            classification head (``nn.Linear(C, k, bias=False)``: per-token scores, read at the
            last token for sequence classification), or ``nn.Identity()`` to return the final
            hidden states ``[B, N, C]``.
        positions: ``positions(x [B, N, C], positions [N] | [B, N]) -> [B, N, C]``, the absolute
            positions added after the token embedding in place of the config's table (the config's
            ``pos`` must then be ``"learned"`` or ``"sinusoidal"``, the kind it stands for): e.g.
            BART's learned table followed by its embedding LayerNorm. The model passes the
            positions it computes (the cache's offset, the attention mask's count); a module whose
            ``counts_mask`` attribute is ``False`` gets the tokens' indices ``cache.length + 0..N-1``
            whatever the attention mask (BART's positions are ``arange`` on left-padded rows too).
        mtp: multi-token-prediction layers (:class:`~attnzoo.models.mtp.MultiTokenPredictor`,
            DeepSeek-V3's ``num_nextn_predict_layers``): :meth:`DecoderLM.mtp_logits
            <attnzoo.DecoderLM.mtp_logits>` and ``generate(..., use_mtp=True)`` use them; the
            model's own forward does not (default ``None``: none).
    """

    blocks: Blocks | None = None
    embedding: nn.Module | None = None
    norm: nn.Module | None = None
    head: nn.Module | None = None
    positions: nn.Module | None = None
    mtp: MultiTokenPredictor | None = None

    def __post_init__(self) -> None:
        _check_parts(self, "DecoderParts", ("embedding", "norm", "head", "positions"))
        if self.mtp is not None and not isinstance(self.mtp, MultiTokenPredictor):
            raise TypeError(f"DecoderParts: mtp must be a MultiTokenPredictor or None, got {type(self.mtp).__name__}")


def _check_parts(parts: DecoderParts | EncoderParts | ViTParts, owner: str, modules: tuple[str, ...]) -> None:
    """The fields ``modules`` of a parts object are modules or ``None``; its ``blocks`` a list or factory."""
    for name in modules:
        value = getattr(parts, name)
        if value is not None and not isinstance(value, nn.Module):
            raise TypeError(f"{owner}: {name} must be an nn.Module or None, got {type(value).__name__}")
    _check_blocks(parts.blocks, owner)


def _check_blocks(b: object, owner: str) -> None:
    if b is not None and (isinstance(b, nn.Module) or not (callable(b) or isinstance(b, Sequence))):
        raise TypeError(f"{owner}: blocks must be a list of modules (one per layer) or a callable "
                        f"layer -> module, got {type(b).__name__}")


class PackedFromZero:
    """Mixin of an :class:`EncoderParts` embedding whose ``positions`` are the tokens' 0-based places
    in their sequence (a learned table read from 0, or no positions at all): its packed form embeds
    ``tokens [1, T]`` with the positions restarting at 0 in every sequence of ``cu_seqlens``."""

    def packed(self, tokens: Tensor, token_type_ids: Tensor | None, cu_seqlens: Tensor) -> Tensor:
        """``tokens [1, T]`` (types ``[1, T]`` or ``None``) of the sequences of ``cu_seqlens [S+1]`` -> ``[1, T, C]``."""
        return self(tokens, token_type_ids, packed_positions(cu_seqlens, tokens.shape[1])[None])  # type: ignore[operator]


P = TypeVar("P", "DecoderParts", "EncoderParts", "ViTParts")


def resolve_parts(parts: object, kind: type[P], owner: str) -> P:
    """A model's ``parts=`` argument: ``None`` -> ``kind()`` (every part built from the config), else
    it must be a ``kind``."""
    if parts is None:
        return kind()
    if not isinstance(parts, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{owner}: parts must be {article} {kind.__name__}, got {type(parts).__name__}")
    return parts


def given_blocks(blocks: Blocks, depth: int, owner: str) -> list[nn.Module]:
    """``blocks`` of a parts object as a list of ``depth`` modules (a factory is called per layer)."""
    if callable(blocks) and not isinstance(blocks, nn.Module):
        blocks = [blocks(i) for i in range(depth)]
    _check_blocks(blocks, owner)
    if len(blocks) != depth or not all(isinstance(b, nn.Module) for b in blocks):
        raise ValueError(f"{owner}: blocks must hold depth={depth} nn.Module entries, got "
                         f"{[type(b).__name__ for b in blocks]}")
    return list(blocks)


@dataclass(frozen=True)
class EncoderParts:
    """Modules a :class:`~attnzoo.TransformerEncoder` takes as they are instead of building them from
    its :class:`~attnzoo.models.EncoderConfig` (each ``None``: built from the config), so that an
    encoder family (RoBERTa's padding-offset positions, ModernBERT's local/global layers, DeBERTa's
    disentangled attention) is a builder of parts rather than config flags::

        enc = TransformerEncoder(config=EncoderConfig(V, C, L, H, pos="none"),
                                 parts=EncoderParts(blocks=[my_block(i) for i in range(L)]))

    Fields:
        embedding: ``embedding(tokens [B, N], token_type_ids [B, N] | None, positions [B, N] | None)
            -> [B, N, C]``: the whole input embedding (tokens, positions, types, its norm) in place
            of the config's ``tok_emb`` / ``pos_emb`` / ``type_emb`` / ``embed_norm`` (then not built).
            One that also has ``packed(tokens [1, T], token_type_ids [1, T] | None, cu_seqlens [S+1])
            -> [1, T, C]`` (each sequence embedded as a right-padded row; :class:`PackedFromZero`)
            lets the encoder take packed sequences.
        blocks: one module per layer (``depth`` of them) or a factory ``layer -> module``, each
            called ``block(x [B, N, C], key_padding=[B, N] bool | None, positions=[B, N] | None)``
            (positions as given to the encoder). The config's block fields (``attention``,
            ``attention_kwargs``, ``ffn``, ``ffn_hidden``, ``norm_first``) are then not used.
        norm: the final norm (default: the config's ``final_norm``); ``nn.Identity()`` for none.
        mlm: the masked-LM head ``[B, N, C] -> [B, N, V]`` of :meth:`~attnzoo.TransformerEncoder.mlm_logits`
            (ties, if any, are the builder's).
        classifier: the sequence classifier ``(hidden [B, N, C], attention_mask [B, N] | None) -> [B, L]``
            of :meth:`~attnzoo.TransformerEncoder.classify`, its pooling included.
    """

    embedding: nn.Module | None = None
    blocks: Blocks | None = None
    norm: nn.Module | None = None
    mlm: nn.Module | None = None
    classifier: nn.Module | None = None

    def __post_init__(self) -> None:
        _check_parts(self, "EncoderParts", ("embedding", "norm", "mlm", "classifier"))


@dataclass(frozen=True)
class ViTParts:
    """Modules a :class:`~attnzoo.VisionTransformer` takes as they are instead of building them from
    its :class:`~attnzoo.models.ViTConfig` (each ``None``: built from the config), for a vision family
    whose parts differ (DINOv2's register tokens and layer scales, SigLIP's attention-pooling head,
    CLIP's pre-norm)::

        vit = VisionTransformer(config=cfg, parts=ViTParts(embedding=my_patches, head=my_head))

    Fields:
        embedding: ``images [B, in_channels, H, W] -> tokens [B, T, C]`` (patches, prefix tokens,
            positions, any norm before the blocks) in place of the config's ``patch_embed`` /
            ``cls_token`` / ``pos_embed`` (then not built).
        blocks: one module per layer (``depth``) or a factory ``layer -> module``, each called
            ``block(x [B, T, C])``.
        norm: the final norm (default: the config's); ``nn.Identity()`` for none.
        head: ``features [B, T, C] -> [B, K]`` with its own pooling, what :meth:`~attnzoo.VisionTransformer.forward`
            returns (the config's ``pool`` / ``pooler`` / ``num_classes`` head is then not built).
    """

    embedding: nn.Module | None = None
    blocks: Blocks | None = None
    norm: nn.Module | None = None
    head: nn.Module | None = None

    def __post_init__(self) -> None:
        _check_parts(self, "ViTParts", ("embedding", "norm", "head"))
