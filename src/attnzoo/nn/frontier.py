"""The softmax-frontier pieces shared by the attention modules: QK-norm, output gates, learnable
sink logits, packed (varlen) inputs. See ``docs/softmax-frontier.md``.

* :class:`FrontierParts`: the parameters the options of :class:`~attnzoo.nn.attention.AttentionOptions`
  add to a module (``sinks``: ``[H]`` sink logits; ``qk_norm``: RMSNorm weights of q and k;
  ``output_gate``: ``gate_proj``) and the maths that uses them.
* :func:`check_cu_seqlens` / :func:`packed_positions`: packed input ``[1, T, C]`` with int32
  cumulative lengths ``cu_seqlens [S+1]``; positions restart at 0 in every sequence.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import check_cu_seqlens_tensor

__all__ = [
    "OUTPUT_GATES",
    "QK_NORMS",
    "QK_NORM_EPS",
    "SCORES",
    "FrontierParts",
    "check_cu_seqlens",
    "packed_positions",
    "rms_norm_heads",
]

QK_NORMS = (None, "head", "all")
OUTPUT_GATES = (None, "head", "element")
SCORES = ("softmax", "sigmoid")

#: default RMSNorm epsilon of the QK-norm (option ``qk_norm_eps``; Qwen3, Gemma3, OLMo2 use 1e-6)
QK_NORM_EPS = 1e-6


def _rms(t: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis; half-precision inputs are normalised in float32 and cast back
    before the weight (as Hugging Face's ``q_norm``/``k_norm``)."""
    if t.dtype in (torch.float32, torch.float64):
        return F.rms_norm(t, (t.shape[-1],), weight.to(t.dtype), eps)
    t32 = t.float()
    return weight * (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)


def rms_norm_heads(t: Tensor, weight: Tensor, eps: float, over_heads: bool) -> Tensor:
    """RMSNorm of ``t [B, h, N, D]`` with a learnable ``weight``: per head over ``D``
    (``weight [D]``) or, ``over_heads``, over all heads of a token flattened (``weight [h*D]``)."""
    if not over_heads:
        return _rms(t, weight, eps)
    B, h, N, D = t.shape
    flat = t.transpose(1, 2).reshape(B, N, h * D)  # [B, N, h*D]
    return _rms(flat, weight, eps).view(B, N, h, D).transpose(1, 2)


class FrontierParts(nn.Module):
    """Parameters of the frontier options of one module, and where they act.

    Args:
        dim: model width ``C`` (the gate reads ``x [B, N, C]``).
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv``, ``D``.
        sinks: a learnable ``[H]`` sink logit per query head (gpt-oss), initialised to 0.
        qk_norm: ``None``, ``"head"`` (RMSNorm of every head's q and k over ``D``, weights ``[D]``:
            Qwen3/Gemma3) or ``"all"`` (over all heads of a token, weights ``[H*D]`` / ``[Hkv*D]``: OLMo2).
        qk_norm_eps: the epsilon of that RMSNorm.
        output_gate: ``None``, ``"head"`` (one sigmoid gate per head) or ``"element"`` (one per output
            channel): ``out * sigmoid(gate_proj(x))`` before ``out_proj`` (gated attention, Qwen3-Next).
        factory: ``{"device", "dtype"}`` of the parameters.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, sinks: bool,
                 qk_norm: str | None, output_gate: str | None, factory: dict[str, Any],
                 qk_norm_eps: float = QK_NORM_EPS) -> None:
        super().__init__()
        H, Hkv, D = num_heads, num_kv_heads, head_dim
        self.qk_norm, self.qk_norm_eps, self.output_gate = qk_norm, qk_norm_eps, output_gate
        self.sinks = nn.Parameter(torch.zeros(H, **factory)) if sinks else None
        if qk_norm is not None:
            wide = qk_norm == "all"
            self.q_norm_weight = nn.Parameter(torch.ones(H * D if wide else D, **factory))
            self.k_norm_weight = nn.Parameter(torch.ones(Hkv * D if wide else D, **factory))
        if output_gate is not None:
            self.gate_proj = nn.Linear(dim, H if output_gate == "head" else H * D, bias=False, **factory)

    def norm_q(self, q: Tensor) -> Tensor:
        """QK-norm of ``q [B, H, N, D]`` (identity without ``qk_norm``)."""
        if self.qk_norm is None:
            return q
        return rms_norm_heads(q, self.q_norm_weight, self.qk_norm_eps, self.qk_norm == "all")

    def norm_k(self, k: Tensor) -> Tensor:
        """QK-norm of ``k [B, Hkv, M, D]`` (identity without ``qk_norm``)."""
        if self.qk_norm is None:
            return k
        return rms_norm_heads(k, self.k_norm_weight, self.qk_norm_eps, self.qk_norm == "all")

    def gate(self, out: Tensor, x: Tensor) -> Tensor:
        """``out [B, H, N, Dv] * sigmoid(gate_proj(x))`` (head-wise ``[B, H, N, 1]`` or element-wise
        ``[B, H, N, Dv]``); identity without ``output_gate``."""
        if self.output_gate is None:
            return out
        B, H, N, Dv = out.shape
        g = torch.sigmoid(self.gate_proj(x))  # [B, N, H] or [B, N, H*Dv]
        g = g.view(B, N, H, 1 if self.output_gate == "head" else Dv).transpose(1, 2)
        return out * g.to(out.dtype)

    def extra_repr(self) -> str:
        eps = f", qk_norm_eps={self.qk_norm_eps}" if self.qk_norm is not None else ""
        return f"sinks={self.sinks is not None}, qk_norm={self.qk_norm!r}{eps}, output_gate={self.output_gate!r}"


def check_cu_seqlens(cu_seqlens: object, x: Tensor, owner: str) -> Tensor:
    """``cu_seqlens`` for a packed ``x [1, T, C]``: int32 ``[S+1]``, from 0, non-decreasing, to ``T``."""
    if x.shape[0] != 1:
        raise ValueError(f"{owner}: packed input (cu_seqlens given) must have batch size 1, [1, T, C]; "
                         f"got x {tuple(x.shape)}")
    cu = check_cu_seqlens_tensor(owner, cu_seqlens)
    values = cu.tolist()
    if values[0] != 0 or values[-1] != x.shape[1] or any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"{owner}: cu_seqlens must start at 0, never decrease and end at T = {x.shape[1]} "
                         f"tokens, got {values}")
    return cu.to(x.device)


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Positions ``[T]`` (int64) restarting at 0 in every packed sequence: ``t - cu_seqlens[seq(t)]``."""
    cu = cu_seqlens.long()
    t = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], t, right=True)  # [T]
    return t - cu[seq]
