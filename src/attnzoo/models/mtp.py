"""Multi-token prediction (MTP): the extra layers DeepSeek-V3, GLM-4.5, ERNIE-4.5 and their kin ship beside
the model, each predicting one token further ahead, used to train and to draft (self-speculative decoding).

Depth ``i`` (0-based) at row ``j`` reads the model's final hidden state at position ``j`` (depth 0) or
depth ``i - 1``'s output at row ``j``, and the embedding of token ``j + i + 1``; it runs a
decoder block of the model's own kind at position ``j + i + 1`` and predicts token ``j + i + 2``
through the model's head (DeepSeek-V3 technical report, section 2.2; transformers' ``MtpLayer``)::

    x = eh_proj([enorm(embed(t[j + i + 1])); hnorm(h[j])])    # hidden_first: [hnorm(h); enorm(e)]
    h'[j] = post_norm(block(x, position j + i + 1))            # -> head(h'[j]) predicts t[j + i + 2]

The embedding and the head are the model's (not held here). :meth:`DecoderLM.mtp_logits
<attnzoo.DecoderLM.mtp_logits>` runs every depth over a sequence (training, checks), and
``DecoderLM.generate(..., use_mtp=True)`` drafts one token per depth each round
(:mod:`attnzoo.models.speculative`).

Shapes: ``B`` rows, ``N`` tokens, ``C`` width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_bool, check_int
from attnzoo.models._common import LayerCaches

__all__ = ["MTPLayer", "MultiTokenPredictor", "head_logits"]


class MTPLayer(nn.Module):
    """One depth of multi-token prediction: ``enorm`` / ``hnorm`` (built by ``norm()``), the
    projection ``eh_proj`` (``2C -> C``, no bias), a decoder ``block`` (called as the model calls
    its blocks: ``block(x, None, key_padding=, cache=, positions=)``) and its output norm
    ``post_norm`` (DeepSeek-V3's ``shared_head.norm``; ``post_norm=False``: none).
    ``hidden_first``: the projection reads ``[hnorm(h); enorm(e)]`` (transformers'
    ``mtp_hidden_states_first``) instead of ``[enorm(e); hnorm(h)]``.

    Weights: ``enorm``, ``hnorm``, ``eh_proj.weight [C, 2C]``, ``block``, ``post_norm``.
    """

    def __init__(self, dim: int, block: nn.Module, norm: Callable[[], nn.Module], *, post_norm: bool = True,
                 hidden_first: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        owner = "MTPLayer"
        self.dim = check_int(dim, "dim", owner)
        if not isinstance(block, nn.Module) or not callable(getattr(block, "init_cache", None)):
            raise TypeError(f"{owner}: block must be a decoder block (an nn.Module with init_cache), "
                            f"got {type(block).__name__}")
        width = getattr(block, "dim", None)
        if isinstance(width, int) and width != dim:
            raise ValueError(f"{owner}: block has width {width}, the layer's dim is {dim}")
        if isinstance(norm, nn.Module) or not callable(norm):
            raise TypeError(f"{owner}: norm must be a callable () -> nn.Module that builds each norm (e.g. "
                            f"lambda: nn.RMSNorm(dim)), got {type(norm).__name__}")
        self.hidden_first = check_bool(hidden_first, "hidden_first", owner)
        self.enorm, self.hnorm = norm(), norm()
        if not isinstance(self.enorm, nn.Module):
            raise TypeError(f"{owner}: norm() must return an nn.Module, got {type(self.enorm).__name__}")
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False, device=device, dtype=dtype)
        self.block = block
        self.post_norm = norm() if check_bool(post_norm, "post_norm", owner) else None

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Any:
        """The block's decode cache."""
        return self.block.init_cache(batch_size, max_len, device=device, dtype=dtype)

    def forward(self, embeds: Tensor, hidden: Tensor, *, cache: Any = None, positions: Tensor | None = None,
                key_padding: Tensor | None = None) -> Tensor:
        """``embeds [B, N, C]`` (of the tokens one ahead), ``hidden [B, N, C]`` (the rows' hidden
        states), ``positions [B, N]`` (where the block runs), ``key_padding [B, cache + N]`` bool
        -> ``[B, N, C]`` in the layer's dtype (its inputs cast to it)."""
        own = self.eh_proj.weight.dtype  # the layers may be kept in another dtype than the model's
        e, h = self.enorm(embeds.to(own)), self.hnorm(hidden.to(own))
        x = self.eh_proj(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1))  # [B, N, C]
        x = self.block(x, None, key_padding=key_padding, cache=cache, positions=positions)  # [B, N, C]
        return x if self.post_norm is None else self.post_norm(x)


class MultiTokenPredictor(nn.Module):
    """The depths of multi-token prediction: ``layers[i]`` predicts token ``j + i + 2`` at row
    ``j``. Given to a :class:`~attnzoo.DecoderLM` as ``DecoderParts(mtp=...)``; weights
    ``mtp.layers.{i}.*``.
    """

    def __init__(self, layers: Sequence[MTPLayer]) -> None:
        super().__init__()
        if (not isinstance(layers, Sequence | nn.ModuleList) or not len(layers)
                or not all(isinstance(m, MTPLayer) for m in layers)):
            raise TypeError(f"MultiTokenPredictor: layers must be a non-empty list of MTPLayer, got {layers!r}")
        self.layers = nn.ModuleList(layers)

    @property
    def depth(self) -> int:
        """The depths: tokens drafted a round."""
        return len(self.layers)

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LayerCaches:
        """One decode cache per depth (depth ``i``'s rows start at position ``i + 1``)."""
        return LayerCaches([m.init_cache(batch_size, max_len, device=device, dtype=dtype) for m in self.layers])


def head_logits(head: nn.Module, out: Tensor) -> Tensor:
    """``head(out)`` with ``out [B, N, C]`` (an MTP layer's output, in its own dtype) cast to the
    head's parameters' dtype -> ``[B, N, V]``."""
    weight = next(head.parameters(), None)
    return head(out if weight is None else out.to(weight.dtype))
