"""``Transformer``: the encoder-decoder of "Attention Is All You Need" (Vaswani et al. 2017)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_int
from attnzoo.blocks import AttentionSpec
from attnzoo.models._common import (
    FromConfig,
    LayerCaches,
    check_padding_mask,
    check_tokens,
)
from attnzoo.models.config import DecoderConfig, EncoderConfig, Seq2SeqConfig
from attnzoo.models.decoder import DecoderLM, check_sampling
from attnzoo.models.encoder import TransformerEncoder
from attnzoo.models.parts import DecoderParts, ScaledEmbedding

__all__ = ["Transformer"]


class Transformer(FromConfig, nn.Module):
    """Encoder-decoder transformer: a :class:`TransformerEncoder` reads the source, a
    :class:`DecoderLM` with cross-attention writes the target.

    Defaults follow the paper (and ``torch.nn.Transformer``): post-norm blocks with a final
    LayerNorm after each stack, ReLU feed-forward of width ``4 * dim``, sinusoidal positions,
    token embeddings scaled by ``sqrt(dim)``, dropout 0.1.

    Build it from a :class:`~attnzoo.models.Seq2SeqConfig` (``config=``, ``from_config``; preset
    ``transformer_base``). The constructor's own keywords (the six positionals, ``attention``,
    ``dropout``, ``norm_first``) are shorthands for those fields and override ``config``'s when
    given; every other field goes through ``config=``.

    The config's fields:
        src_vocab_size, tgt_vocab_size: vocabularies.
        dim, num_heads: width ``C`` and heads.
        encoder_depth, decoder_depth: number of blocks of each stack.
        ffn, ffn_hidden, norm, norm_eps, norm_first, dropout, bias: as in :class:`TransformerBlock`.
        pos: ``"sinusoidal" | "learned" | "rope" | "none"`` for both stacks.
        max_seq_len: positions of each stack.
        attention, attention_kwargs: the decoder's self-attention (registry name or factory);
            ``encoder_attention`` the encoder's (default: same name, non-causal).
        tie_embeddings: the decoder's output head shares its token embeddings.

    Shapes: ``src [B, M]``, ``tgt [B, N]`` -> ``logits [B, N, tgt_vocab_size]``.
    """

    config_class = Seq2SeqConfig

    def __init__(self, src_vocab_size: int | None = None, tgt_vocab_size: int | None = None,
                 dim: int | None = None, num_heads: int | None = None, encoder_depth: int | None = None,
                 decoder_depth: int | None = None, *, attention: AttentionSpec | None = None,
                 dropout: float | None = None, norm_first: bool | None = None, config: Seq2SeqConfig | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        given = {"src_vocab_size": src_vocab_size, "tgt_vocab_size": tgt_vocab_size, "dim": dim,
                 "num_heads": num_heads, "encoder_depth": encoder_depth, "decoder_depth": decoder_depth,
                 "attention": attention, "dropout": dropout, "norm_first": norm_first}
        cfg = Seq2SeqConfig.resolve(config, "Transformer", given)
        self.config = cfg
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.encoder = TransformerEncoder(config=self.encoder_config(cfg), **kw)
        self.decoder = self.build_decoder(cfg, **kw)

    @staticmethod
    def _common(cfg: Seq2SeqConfig) -> dict[str, Any]:
        return {"dim": cfg.dim, "num_heads": cfg.num_heads, "ffn": cfg.ffn, "ffn_hidden": cfg.ffn_hidden,
                "norm": cfg.norm, "norm_eps": cfg.norm_eps, "max_seq_len": cfg.max_seq_len, "pos": cfg.pos,
                "dropout": cfg.dropout, "bias": cfg.bias}

    @classmethod
    def encoder_config(cls, cfg: Seq2SeqConfig) -> EncoderConfig:
        """The encoder stack: non-causal, no embedding norm, ``encoder_attention`` (default: the
        decoder's attention name)."""
        attention = cfg.attention if cfg.encoder_attention is None else cfg.encoder_attention
        return EncoderConfig(cfg.src_vocab_size, depth=cfg.encoder_depth, attention=attention, embed_norm=False,
                             norm_first=cfg.norm_first, embed_scale=math.sqrt(cfg.dim), final_norm=True,
                             **cls._common(cfg))

    @classmethod
    def decoder_config(cls, cfg: Seq2SeqConfig) -> DecoderConfig:
        """The decoder stack's config (its blocks add cross-attention, see :meth:`build_decoder`)."""
        return DecoderConfig(cfg.tgt_vocab_size, depth=cfg.decoder_depth, attention=cfg.attention,
                             attention_kwargs=cfg.attention_kwargs, tie_embeddings=cfg.tie_embeddings,
                             **cls._common(cfg))

    @classmethod
    def build_decoder(cls, cfg: Seq2SeqConfig, *, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> DecoderLM:
        """The decoder: blocks with causal self-attention and cross-attention to the encoder's
        output (post-norm unless ``norm_first``), token embeddings scaled by ``sqrt(dim)``, a final
        norm (:meth:`DecoderLM.with_blocks`)."""
        stack = cls.decoder_config(cfg)
        embedding = ScaledEmbedding(stack.vocab_size, stack.dim, scale=math.sqrt(cfg.dim), device=device, dtype=dtype)
        nn.init.normal_(embedding.weight, 0.0, 0.02)
        return DecoderLM.with_blocks(stack, lambda block, _: block.replace(cross_attention=True,
                                                                           norm_first=cfg.norm_first),
                                     parts=DecoderParts(embedding=embedding), device=device, dtype=dtype)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """``src [B, M]`` (``src_mask [B, M]`` bool, True = real) -> ``memory [B, M, C]``."""
        return self.encoder(src, attention_mask=src_mask)

    def decode(self, tgt: Tensor, memory: Tensor, *, memory_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None, cache: LayerCaches | None = None) -> Tensor:
        """``tgt [B, N]`` attending causally to itself and fully to ``memory [B, M, C]`` ->
        ``logits [B, N, V]``. ``tgt_mask [B, N]`` (or ``[B, cache.length + N]``) hides padded
        target keys; ``cache`` from :meth:`init_cache` for incremental decoding."""
        return self.decoder(tgt, cache=cache, attention_mask=tgt_mask, context=memory, context_mask=memory_mask)

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LayerCaches:
        """The decoder's self-attention caches."""
        return self.decoder.init_cache(batch_size, max_len, device=device, dtype=dtype)

    def forward(self, src: Tensor, tgt: Tensor, *, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None) -> Tensor:
        """Teacher-forced forward: ``src [B, M]``, ``tgt [B, N]`` (masks ``[B, M]``/``[B, N]`` bool,
        True = real token) -> ``logits [B, N, V]``."""
        memory = self.encode(src, src_mask)
        return self.decode(tgt, memory, memory_mask=src_mask, tgt_mask=tgt_mask)

    @torch.no_grad()
    def generate(self, src: Tensor, max_new_tokens: int, *, bos_token_id: int, src_mask: Tensor | None = None,
                 eos_token_id: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Encode ``src`` once, then decode from ``bos_token_id`` with the cache.

        The sampling settings are those of :meth:`DecoderLM.generate`; every argument is checked
        before the source is encoded. Returns ``[B, 1 + T]`` (the BOS column first),
        ``T <= max_new_tokens``.
        """
        owner = "Transformer.generate"
        check_tokens(src, self.encoder.vocab_size, owner, "src")
        if src.shape[0] == 0:
            raise ValueError(f"{owner}: src must hold at least one row [B, M] with B >= 1, got {tuple(src.shape)}")
        check_int(bos_token_id, "bos_token_id", owner, minimum=0)
        if bos_token_id >= self.decoder.vocab_size:
            raise ValueError(f"{owner}: bos_token_id must be < {self.decoder.vocab_size}, got {bos_token_id}")
        new = check_int(max_new_tokens, "max_new_tokens", owner, minimum=0)
        check_sampling(temperature, top_k, top_p, generator, owner)
        self.decoder._check_generate(1, new, eos_token_id, owner=owner)
        if src_mask is not None:
            src_mask = check_padding_mask(src_mask, src.shape[0], src.shape[1], owner, "src_mask")
        memory = self.encode(src, src_mask)
        start = torch.full((src.shape[0], 1), bos_token_id, dtype=torch.long, device=src.device)
        return self.decoder.generate(start, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                     eos_token_id=eos_token_id, generator=generator, context=memory,
                                     context_mask=src_mask)
