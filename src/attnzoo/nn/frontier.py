"""The softmax-frontier helpers shared by the attention modules: the QK RMSNorm maths, packed
(varlen) inputs. See ``docs/softmax-frontier.md``; the parts built on them (QK-norm, output gate,
sink logits) are injected modules, :mod:`attnzoo.nn.parts`.

* :func:`rms_norm_heads`: RMSNorm of ``[B, h, N, D]`` heads, per head or over all heads of a token.
* :func:`packed_cu_seqlens` / :func:`packed_positions`: packed input ``[1, T, C]`` with int32
  cumulative lengths ``cu_seqlens [S+1]``; positions restart at 0 in every sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._validate import check_cu_seqlens

__all__ = [
    "QK_NORM_EPS",
    "packed_cu_seqlens",
    "packed_positions",
    "rms_norm_heads",
]

#: default RMSNorm epsilon of the QK-norm (option ``qk_norm_eps``; Qwen3, Gemma3, OLMo2 use 1e-6)
QK_NORM_EPS = 1e-6


def _rms(t: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis; half-precision inputs are normalised in float32 and cast back
    before the weight (as Hugging Face's ``q_norm``/``k_norm``). The result has ``t``'s dtype: under
    ``torch.autocast`` a float32 weight would have made q and k float32 next to a half v."""
    if t.dtype in (torch.float32, torch.float64):
        return F.rms_norm(t, (t.shape[-1],), weight.to(t.dtype), eps)
    t32 = t.float()
    return (weight * (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)).to(t.dtype)


def rms_norm_heads(t: Tensor, weight: Tensor, eps: float, over_heads: bool) -> Tensor:
    """RMSNorm of ``t [B, h, N, D]`` with a learnable ``weight``: per head over ``D``
    (``weight [D]``) or, ``over_heads``, over all heads of a token flattened (``weight [h*D]``)."""
    if not over_heads:
        return _rms(t, weight, eps)
    B, h, N, D = t.shape
    flat = t.transpose(1, 2).reshape(B, N, h * D)  # [B, N, h*D]
    return _rms(flat, weight, eps).view(B, N, h, D).transpose(1, 2)


def packed_cu_seqlens(cu_seqlens: object, x: Tensor, owner: str) -> Tensor:
    """``cu_seqlens`` for a packed ``x [1, T, C]`` (:func:`attnzoo._validate.check_cu_seqlens` with
    ``total=T``), on x's device."""
    if x.shape[0] != 1:
        raise ValueError(f"{owner}: packed input (cu_seqlens given) must have batch size 1, [1, T, C]; "
                         f"got x {tuple(x.shape)}")
    return check_cu_seqlens(cu_seqlens, owner=owner, total=x.shape[1]).to(x.device)


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Positions ``[T]`` (int64) restarting at 0 in every packed sequence: ``t - cu_seqlens[seq(t)]``."""
    cu = cu_seqlens.long()
    t = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], t, right=True)  # [T]
    return t - cu[seq]
