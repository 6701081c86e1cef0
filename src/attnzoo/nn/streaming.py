"""StreamingLLM (Xiao et al., 2023) pieces of :class:`~attnzoo.nn.attention.SlidingWindowAttention`.

With ``sink_tokens = n`` and ``window = w`` the query at position ``p`` sees the keys of::

    S(p) = {j <= p : p - j <= w  or  j < n}  =  causal() & (sliding_window(w, 0) | global_tokens(range(n)))

Two position conventions (``position_mode``), drawn in ``docs/softmax-frontier.md``:

* ``"absolute"``: RoPE at the tokens' absolute positions (keys cached after RoPE);
* ``"cache"`` (the StreamingLLM paper's): positions counted inside the cache. The cache holds
  ``S(p)`` in position order; key ``j`` is rotated at its rank ``r(j)`` in ``S(p)`` and the query at
  ``|S(p)| - 1 = min(p, n + w)``; keys are stored before RoPE and re-rotated at every step.
  Since RoPE scores depend only on the rank difference, a window key ``j >= n`` sits at distance
  ``p - j`` (as absolute), and a sink ``s < n`` at ``min(p, n + w) - s``: a full forward is the
  LSE merge of a window part at absolute positions and a sink part with the query at
  ``min(p, n + w)`` (:func:`sink_query_positions`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo.masks import Mask, global_tokens, sliding_window
from attnzoo.masks import causal as causal_mask

__all__ = ["POSITION_MODES", "mask_at", "sink_query_positions", "streaming_pattern"]

POSITION_MODES = ("absolute", "cache")


def streaming_pattern(window: int, sink_tokens: int) -> Mask:
    """``causal() & (sliding_window(window, 0) | global_tokens(range(sink_tokens)))``."""
    return causal_mask() & (sliding_window(window, 0) | global_tokens(list(range(sink_tokens))))


def sink_query_positions(q_pos: Tensor, window: int, sink_tokens: int) -> Tensor:
    """Where StreamingLLM's convention puts a query facing the sinks: ``min(p, n + w)``."""
    return q_pos.clamp(max=sink_tokens + window)


def mask_at(mask: Tensor | Mask | None, k_pos: Tensor, total: int, batch: int, heads: int,
            q_pos: Tensor) -> Tensor | None:
    """A user mask over absolute keys ``0 .. total - 1`` restricted to the keys at ``k_pos [Nk]``
    (a tensor's columns are gathered; a :class:`Mask` is evaluated at ``q_pos x k_pos``)."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        b = torch.arange(batch, device=k_pos.device).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=k_pos.device).view(1, -1, 1, 1)
        return mask(b, h, q_pos.view(1, 1, -1, 1), k_pos.view(1, 1, 1, -1))
    return mask.index_select(-1, k_pos.to(mask.device)) if mask.shape[-1] == total else mask
