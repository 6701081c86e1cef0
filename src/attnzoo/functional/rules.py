"""The vocabulary of attention semantics, said once (``docs/conventions.md``).

* :func:`visible`: the causal/window rule over absolute positions (defined beside the mask
  algebra, :func:`attnzoo.masks.visible`, and re-exported here);
* :func:`key_bounds`: the same rule as the interval of keys one query sees;
* :func:`alibi_bias`: ``-slope * |q_pos - k_pos|``;
* :func:`compute_dtype`: softmax/accumulation dtype (float64 stays float64, everything else float32).

Every backend, the ring attention and the mask algebra use these instead of re-deriving them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo._validate import Window
from attnzoo.masks import visible

__all__ = ["alibi_bias", "compute_dtype", "key_bounds", "visible"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax/accumulation dtype for an input dtype: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
