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

Padding (batched generation with left padding): a key that a key-only bool mask
``[B|1, 1, 1, Nk]`` hides from every query is padding, and the sink tokens of a row are the ``n``
tokens from its first real one, ``P_b .. P_b + n - 1`` (:func:`padding_offsets`), as they are for
that row alone (its positions start at its first real token). The window needs nothing: under
causality only the left padding lies before a row's tokens, and it is hidden. In a cached call the
sinks sit in the cache's sink slots per row (``SinkWindowKVCache.update(..., sink_offsets=P)``) and
the ring keys of a padded row that are its sinks (or padding) are hidden in the window part
(:func:`padded_parts`). ``position_mode="cache"`` takes no padding (its ranks would differ per row).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo.masks import Mask, global_tokens, sliding_window
from attnzoo.masks import causal as causal_mask

__all__ = ["POSITION_MODES", "mask_at", "padded_parts", "padding_offsets", "rows_from_first_real",
           "sink_query_positions", "streaming_pattern"]

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


def padding_offsets(mask: object, total: int) -> Tensor | None:
    """``P [B]``: the index of each row's first real key under a key-only bool mask ``[B|1, 1, 1, total]``
    (``total`` for a row with none), or ``None`` when the mask is not one or no row starts with padding
    (then the sinks are the first ``n`` positions, as without a mask)."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1) \
            or mask.shape[-1] != total or total == 0:
        return None
    real = mask[:, 0, 0]  # [B|1, total]
    if tracing() or bool(real[:, 0].all()):
        return None
    return torch.where(real.any(dim=-1), real.int().argmax(dim=-1), torch.full_like(real[:, 0], total, dtype=torch.long))


def padded_parts(mask: Tensor, offsets: Tensor, sink_tokens: int, q_pos: Tensor, sink_count: int,
                 window_pos: Tensor) -> tuple[Tensor, Tensor]:
    """The bool masks of the two parts of a padded StreamingLLM call (see the module docstring).

    Args:
        mask: the key-only bool mask ``[B|1, 1, 1, total]`` (True = real key).
        offsets: ``P [B]`` from :func:`padding_offsets`.
        sink_tokens: ``n``.
        q_pos: the queries' stream positions ``[N]``.
        sink_count: the sink keys given to the sink part, ``min(total, n)``: row ``b``'s ``i``-th sits
            at ``P_b + i``.
        window_pos: stream positions ``[Nw]`` of the keys given to the window part.

    Returns:
        ``(sink_mask [B, 1, N, sink_count], window_mask [B, 1, 1, Nw])``: a sink is visible once written
        (``P_b + i <= p``) and real; a window key is real and not one of the row's sinks
        (``pos >= P_b + n``; the causal window is the core's).
    """
    real = mask[:, 0, 0].expand(offsets.shape[0], -1)  # [B, total]
    total = real.shape[-1]
    sink_pos = offsets.view(-1, 1) + torch.arange(sink_count, device=offsets.device)  # [B, ns]
    sink_real = real.gather(1, sink_pos.clamp(max=total - 1)) & (sink_pos < total)
    sink_mask = (sink_pos.unsqueeze(1) <= q_pos.view(1, -1, 1)) & sink_real.unsqueeze(1)  # [B, N, ns]
    window_mask = real.index_select(1, window_pos) & (window_pos.view(1, -1) >= offsets.view(-1, 1) + sink_tokens)
    return sink_mask.unsqueeze(1), window_mask[:, None, None, :]


def rows_from_first_real(pattern: Mask, offsets: Tensor) -> Mask:
    """``pattern`` with row ``b``'s positions counted from its first real token ``offsets[b]``: a
    position pattern (global tokens, sinks) of a left-padded row as for that row alone. Relative
    parts (causal, windows) are unchanged by the shift; the padding itself stays the mask's job."""

    def fn(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        shift = offsets[b]  # b's shape: each row's own offset
        return pattern(b, h, q - shift, k - shift)

    return Mask(fn, f"{pattern.name}@first_real", batch=offsets.shape[0])
