"""``LayerLoopLM``: a :class:`~attnzoo.DecoderLM` whose layers pass more than the residual stream.

Most decoders are a chain of blocks ``[B, N, C] -> [B, N, C]``, which :class:`~attnzoo.DecoderLM`
runs. Some 2026 models pass more between their layers: several residual streams mixed by
hyper-connections (GLM-5-Next, DeepSeek-V4), the outputs of every earlier block for an attention
over depth (Inkling2), a key selection one layer hands to the next. Such a model subclasses
:class:`LayerLoopLM` and writes only its layer loop, :meth:`LayerLoopLM.run_layers`; the rest is
``DecoderLM``'s own: the checks of ``forward``'s arguments, the all-or-nothing cache transaction,
:meth:`~attnzoo.DecoderLM.init_cache`, :meth:`~attnzoo.DecoderLM.generate`, the embedding, the
final norm and the head::

    class TwoStreamLM(LayerLoopLM):
        def run_layers(self, x, *, tokens, key_padding, positions, past, cache):
            streams = torch.stack([x, x], dim=2)                      # [B, N, 2, C]
            for i, block in enumerate(self.blocks):
                streams = block(streams, key_padding=key_padding, cache=None if cache is None else cache[i])
            return streams.mean(dim=2)                                # [B, N, C] -> final norm, head

Packed input (``cu_seqlens``) runs each sequence alone, so the layers need no packed path; a
subclass whose layers take ``cu_seqlens`` sets ``packs = True`` and gets the packed row whole
(``cu_seqlens`` and the positions restarting in every sequence). There is no cross-attention
(``context``).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from attnzoo._validate import check_int
from attnzoo.models._common import (
    LayerCaches,
    check_padding_mask,
    check_tokens,
    positions_from_mask,
)
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.parts import DecoderParts
from attnzoo.nn.cache import transaction
from attnzoo.nn.frontier import packed_cu_seqlens, packed_positions

__all__ = ["LayerLoopLM", "StreamsLM"]


class LayerLoopLM(DecoderLM):
    """A :class:`~attnzoo.DecoderLM` that runs its own layer loop (see the module docstring):
    a subclass implements :meth:`run_layers`. Built as ``DecoderLM`` is (``config=``, ``parts=``
    with the blocks); its ``forward`` takes ``DecoderLM.forward``'s arguments but ``context``.

    Shapes: ``tokens [B, N]`` -> ``logits [B, N, V]`` (packed: ``[1, T]`` -> ``[1, T, V]``).
    """

    #: the layers take packed input (``cu_seqlens``) themselves; otherwise each sequence runs alone
    packs: bool = False

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The layers on the embeddings ``x [B, N, C]``; returns ``[B, N, C]`` for the final norm.

        Args:
            tokens: the token ids ``[B, N]`` (for layers that read them).
            key_padding: bool ``[B, past + N]`` (True = real token) or ``None`` (all real).
            positions: the caller's positions ``[N]`` or ``[B, N]`` (checked), or ``None``
                (:meth:`default_positions` gives the usual ones).
            past: tokens already in ``cache`` (0 without one).
            cache: one cache per layer (``cache[i]``), or ``None``.
            cu_seqlens: with ``packs = True``, packed sequences' cumulative lengths (int32
                ``[S+1]``; ``x`` is ``[1, T, C]``, ``positions [T]`` restart in each), else ``None``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement run_layers")

    @staticmethod
    def default_positions(key_padding: Tensor | None, past: int, n: int, device: torch.device) -> Tensor:
        """Positions ``[B, N]`` counting real tokens only (from ``key_padding``), else ``[1, N]``
        ``past .. past + N - 1``."""
        if key_padding is not None:
            return positions_from_mask(key_padding)[:, past:]
        return torch.arange(past, past + n, device=device)[None]

    def rotary_positions(self, positions: Tensor | None, key_padding: Tensor | None, past: int, n: int,
                         device: torch.device, cu_seqlens: Tensor | None = None) -> Tensor | None:
        """The positions to hand rotary attention modules, as :class:`~attnzoo.DecoderLM` hands
        them: the caller's; without them, counted over real tokens when ``key_padding`` is given
        (:meth:`default_positions`), else ``None`` (the modules count from their cache); ``None``
        for packed input (the modules restart at each boundary of ``cu_seqlens``)."""
        if cu_seqlens is not None:
            return None
        if positions is None and key_padding is not None:
            return self.default_positions(key_padding, past, n, device)
        return positions

    def forward(self, tokens: Tensor, *, cache: LayerCaches | None = None, positions: Tensor | None = None,
                attention_mask: Tensor | None = None, context: Tensor | None = None,
                context_mask: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """As :meth:`DecoderLM.forward <attnzoo.DecoderLM.forward>`, without ``context``."""
        return self._loop(tokens, cache, (positions, attention_mask, context, context_mask, cu_seqlens), head=True)

    def hidden_states(self, tokens: Tensor, *, cache: LayerCaches | None = None, positions: Tensor | None = None,
                      attention_mask: Tensor | None = None, context: Tensor | None = None,
                      context_mask: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """As :meth:`DecoderLM.hidden_states <attnzoo.DecoderLM.hidden_states>`: :meth:`forward`
        without the head, ``[B, N, C]``."""
        return self._loop(tokens, cache, (positions, attention_mask, context, context_mask, cu_seqlens), head=False)

    def _loop(self, tokens: Tensor, cache: LayerCaches | None, given: tuple[Any, Any, Any, Any, Any], *,
              head: bool) -> Tensor:
        """:meth:`forward` (``head``) or :meth:`hidden_states`; ``given``: ``(positions, attention_mask,
        context, context_mask, cu_seqlens)``."""
        positions, attention_mask, context, context_mask, cu_seqlens = given
        if isinstance(cache, LayerCaches) and not cache.in_transaction:
            return transaction(cache, lambda: self._loop(tokens, cache, given, head=head))
        owner = type(self).__name__
        check_tokens(tokens, self.vocab_size, owner)
        if context is not None or context_mask is not None:
            raise ValueError(f"{owner}: context= is not supported (the model has no cross-attention)")
        if cu_seqlens is not None:
            return self._packed(tokens, cu_seqlens, head, cache, positions, attention_mask)
        B, N = tokens.shape
        past = self._cache_length(cache, B)
        kp = None if attention_mask is None else check_padding_mask(attention_mask, B, past + N, owner)
        pos = None if positions is None else self._check_positions(positions, B, N)
        h = self.run_layers(self.embed(tokens), tokens=tokens, key_padding=kp, positions=pos, past=past, cache=cache)
        return self.logits(h) if head else self.final(h)

    def final(self, h: Tensor) -> Tensor:
        """The final norm on the layers' output ``h [B, N, C]``: what the head reads, ``[B, N, C]``."""
        return self.norm(h)

    def logits(self, h: Tensor) -> Tensor:
        """The final norm and the head on the layers' output ``h [B, N, C]`` -> ``[B, N, V]``."""
        return self.lm_head(self.final(h))

    def _packed(self, tokens: Tensor, cu_seqlens: Tensor, head: bool, *unsupported: object) -> Tensor:
        """Packed sequences (``[1, T, V]``; without ``head`` ``[1, T, C]``): through the layers whole
        (``packs``), else each alone."""
        owner = type(self).__name__
        if any(u is not None for u in unsupported):
            raise ValueError(f"{owner}: packed input (cu_seqlens) takes no cache, positions or attention_mask")
        if tokens.shape[0] != 1:
            raise ValueError(f"{owner}: packed input must be one row of tokens [1, T], got {tuple(tokens.shape)}")
        cu = packed_cu_seqlens(cu_seqlens, tokens.unsqueeze(-1), owner)
        if not self.packs:
            run = self if head else self.hidden_states
            return torch.cat([run(tokens[:, a:b]) for a, b in itertools.pairwise(cu.tolist()) if b > a], dim=1)
        pos = packed_positions(cu, tokens.shape[1])  # [T], restarting per sequence
        h = self.run_layers(self.embed(tokens, pos), tokens=tokens, key_padding=None, positions=pos, past=0,
                            cache=None, cu_seqlens=cu)
        return self.logits(h) if head else self.final(h)  # [1, T, V]


class StreamsLM(LayerLoopLM):
    """A :class:`LayerLoopLM` over ``streams`` copies of the residual stream (hyper-connections:
    GLM-5-Next, Qwen4-Exp, DeepSeek-V4); the subclass's :meth:`~LayerLoopLM.run_layers` spreads the
    embedding over them and reads them back."""

    def __init__(self, *, streams: int, config: DecoderConfig, parts: DecoderParts,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(config=config, parts=parts, device=device, dtype=dtype)
        self.streams = check_int(streams, "streams", type(self).__name__)

    def extra_repr(self) -> str:
        return f"streams={self.streams}"
