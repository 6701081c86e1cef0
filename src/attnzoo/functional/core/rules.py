"""The vocabulary of attention semantics, said once (``docs/conventions.md``).

* :func:`visible`: the causal/window rule over absolute positions (defined beside the mask
  algebra, :func:`attnzoo.masks.visible`, and re-exported here);
* :func:`key_bounds`: the same rule as the interval of keys one query sees;
* :func:`alibi_bias`: ``-slope * |q_pos - k_pos|``;
* :func:`compute_dtype`: softmax/accumulation dtype (float64 stays float64, everything else float32);
* :func:`output_like_v` / :func:`stored_like_v`: the memory layout of the compiled operators' outputs.

Every backend, the ring attention and the mask algebra use these instead of re-deriving them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo._validate import Window
from attnzoo.masks import visible

__all__ = ["alibi_bias", "compute_dtype", "key_bounds", "output_like_v", "stored_like_v", "visible"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax/accumulation dtype for an input dtype: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def output_like_v(q: Tensor, v: Tensor, *, otherwise_like: Tensor | None = None) -> Tensor:
    """An empty attention output ``[B, Hq, Nq, Dv]`` (``q``'s dtype) stored in ``v``'s memory layout when
    the shapes agree (self-attention without GQA), else as ``otherwise_like`` (a tensor of the output's
    shape, e.g. the kernel's own output), else contiguous.

    A module's ``v`` is usually a ``[B, N, H, D]`` view of its projection; an output stored that way
    makes the module's ``[B, N, H * D]`` head merge a view, so a compiled graph needs no transpose-copy
    kernel after an attention operator (the operator copies instead; the same bytes move either way).
    """
    B, Hq, Nq, _ = q.shape
    if v.shape == (B, Hq, Nq, v.shape[-1]):
        return torch.empty_like(v, dtype=q.dtype)
    if otherwise_like is not None:
        return torch.empty_like(otherwise_like)
    return q.new_empty(B, Hq, Nq, v.shape[-1])


def stored_like_v(out: Tensor, q: Tensor, v: Tensor, *, otherwise_like: Tensor | None = None) -> Tensor:
    """A kernel's output ``out`` stored as :func:`output_like_v` says (an operator's fake returns
    :func:`output_like_v`, its real implementation this): ``out`` itself when it is already, else a copy."""
    buf = output_like_v(q, v, otherwise_like=otherwise_like)
    return out if out.stride() == buf.stride() else buf.copy_(out)


def key_bounds(causal: bool, window: Window | None) -> Window:
    """``(left, right)`` reach of one query under ``causal``/``window``: the query at ``p`` sees
    keys ``p - left .. p + right`` (``None`` = unbounded side); causality cuts the right side to 0."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """ALiBi's additive bias ``-slope * |q_pos - k_pos|`` (broadcast of the three arguments; the
    caller shapes ``slopes`` onto its head axis). Computed in ``slopes``' dtype."""
    return -slopes * (q_pos - k_pos).abs().to(slopes.dtype)
