"""``Transformer``: the encoder-decoder of "Attention Is All You Need" (Vaswani et al. 2017)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.blocks import AttentionSpec
from attnzoo.models._common import LayerCaches, check_int, check_padding_mask, check_tokens
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.encoder import TransformerEncoder

__all__ = ["Transformer"]


class Transformer(nn.Module):
    """Encoder-decoder transformer: a :class:`TransformerEncoder` reads the source, a
    :class:`DecoderLM` with cross-attention writes the target.

    Defaults follow the paper (and ``torch.nn.Transformer``): post-norm blocks with a final
    LayerNorm after each stack, ReLU feed-forward of width ``4 * dim``, sinusoidal positions,
    token embeddings scaled by ``sqrt(dim)``, dropout 0.1.

    Args:
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

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        dim: int = 512,
        num_heads: int = 8,
        encoder_depth: int = 6,
        decoder_depth: int = 6,
        *,
        ffn: str = "relu",
        ffn_hidden: int | None = None,
        norm: str = "layer",
        norm_eps: float = 1e-5,
        norm_first: bool = False,
        pos: str = "sinusoidal",
        max_seq_len: int = 1024,
        dropout: float = 0.1,
        bias: bool = True,
        attention: AttentionSpec = "mha",
        attention_kwargs: dict[str, Any] | None = None,
        encoder_attention: AttentionSpec | None = None,
        tie_embeddings: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_int(dim, "dim", "Transformer")
        common: dict[str, Any] = {"ffn": ffn, "ffn_hidden": ffn_hidden, "norm": norm, "norm_eps": norm_eps,
                                  "norm_first": norm_first, "max_seq_len": max_seq_len, "pos": pos,
                                  "dropout": dropout, "bias": bias, "embed_scale": math.sqrt(dim),
                                  "final_norm": True, "device": device, "dtype": dtype}
        self.encoder = TransformerEncoder(src_vocab_size, dim, encoder_depth, num_heads,
                                          attention=attention if encoder_attention is None else encoder_attention,
                                          embed_norm=False, **common)
        self.decoder = DecoderLM(tgt_vocab_size, dim, decoder_depth, num_heads, attention=attention,
                                 attention_kwargs=attention_kwargs, cross_attention=True,
                                 tie_embeddings=tie_embeddings, **common)

    def num_parameters(self) -> int:
        """Number of distinct parameters."""
        return sum(p.numel() for p in self.parameters())

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

        Returns ``[B, 1 + T]`` (the BOS column first), ``T <= max_new_tokens``.
        """
        owner = "Transformer.generate"
        check_tokens(src, self.encoder.vocab_size, owner, "src")
        check_int(bos_token_id, "bos_token_id", owner, minimum=0)
        if bos_token_id >= self.decoder.vocab_size:
            raise ValueError(f"{owner}: bos_token_id must be < {self.decoder.vocab_size}, got {bos_token_id}")
        if src_mask is not None:
            src_mask = check_padding_mask(src_mask, src.shape[0], src.shape[1], owner, "src_mask")
        memory = self.encode(src, src_mask)
        start = torch.full((src.shape[0], 1), bos_token_id, dtype=torch.long, device=src.device)
        return self.decoder.generate(start, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                     eos_token_id=eos_token_id, generator=generator, context=memory,
                                     context_mask=src_mask)
