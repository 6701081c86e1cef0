"""A mixture-of-experts feed-forward: a top-k router over ``E`` gated experts, an optional
shared expert (with an optional sigmoid gate).

Each token ``x [C]`` gets router logits ``l = W_r x (+ b_r)`` ``[E]``, picks ``k`` experts and
weights ``w``, and its output is ``sum_e w_e * expert_e(x)`` (or, with ``weight_inputs``,
``sum_e expert_e(w_e * x)``) plus the shared expert. The routings of the open families:

* ``"softmax_topk"`` (Qwen2/3-MoE, Qwen3-Next, Mixtral, OLMoE): ``p = softmax(l)`` in float32
  over all ``E`` experts, the ``k`` largest kept; ``norm_topk_prob`` renormalises them to sum to 1.
* ``"topk_softmax"`` (gpt-oss): the ``k`` largest logits, then a softmax over those ``k``.
* ``"topk_sigmoid"`` (Llama-4): the ``k`` largest logits, each through a sigmoid (float32).

``routed_scaling`` multiplies the routed weights (DeepSeek's ``routed_scaling_factor``).
Experts: ``"swiglu"`` ``down(silu(gate(x)) * up(x))``; ``"clamped_swiglu"`` (gpt-oss):
``g = min(gate(x), limit)``, ``u = clamp(up(x), -limit, limit)``,
``down((u + 1) * g * sigmoid(alpha * g))``. The shared expert is any module ``[.., C] -> [.., C]``
(e.g. a :class:`~attnzoo.FeedForward`); ``shared_gate`` multiplies it by ``sigmoid(w_s . x)``
(Qwen2-MoE, Qwen3-Next).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["EXPERT_ACTIVATIONS", "ROUTINGS", "MixtureOfExperts"]

ROUTINGS = ("softmax_topk", "topk_softmax", "topk_sigmoid")
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


def _pos_int(x: object, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"MixtureOfExperts: {name} must be an int, got {type(x).__name__} ({x!r})")
    if x <= 0:
        raise ValueError(f"MixtureOfExperts: {name} must be > 0, got {x}")
    return x


def _flag(x: object, name: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"MixtureOfExperts: {name} must be a bool, got {type(x).__name__} ({x!r})")
    return x


def _finite(x: object, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise ValueError(f"MixtureOfExperts: {name} must be a finite float > 0, got {x!r}")
    return float(x)


class MixtureOfExperts(nn.Module):
    """Top-k routed gated experts plus an optional shared expert (see the module docstring).

    Args:
        dim: model width ``C``.
        hidden: each expert's hidden width ``F``.
        num_experts: ``E``.
        top_k: experts per token ``k`` (``<= E``).
        routing: ``"softmax_topk"``, ``"topk_softmax"`` or ``"topk_sigmoid"``.
        norm_topk_prob: renormalise the kept softmax probabilities (``"softmax_topk"`` only).
        routed_scaling: a factor on the routed weights.
        activation: ``"swiglu"`` or ``"clamped_swiglu"`` (with ``swiglu_limit`` and ``swiglu_alpha``).
        bias: biases on the experts' projections.
        router_bias: a bias on the router.
        weight_inputs: scale each expert's input by its weight instead of its output (Llama-4).
        shared_expert: a module added to every token's output, or ``None``.
        shared_gate: gate the shared expert by ``sigmoid(shared_gate(x))`` (a ``[1, C]`` linear).

    Weights: ``router`` (``[E, C]``, bias ``[E]``), ``gate_proj``/``up_proj`` ``[E, F, C]``,
    ``down_proj`` ``[E, C, F]`` (biases ``gate_bias``/``up_bias`` ``[E, F]``, ``down_bias``
    ``[E, C]``), ``shared_expert``, ``shared_gate``.
    Shapes: ``x [..., C] -> [..., C]``.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, routing: str = "softmax_topk",
                 norm_topk_prob: bool = False, routed_scaling: float = 1.0, activation: str = "swiglu",
                 swiglu_limit: float | None = None, swiglu_alpha: float | None = None, bias: bool = False,
                 router_bias: bool = False, weight_inputs: bool = False, shared_expert: nn.Module | None = None,
                 shared_gate: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim, self.hidden = _pos_int(dim, "dim"), _pos_int(hidden, "hidden")
        self.num_experts, self.top_k = _pos_int(num_experts, "num_experts"), _pos_int(top_k, "top_k")
        if top_k > num_experts:
            raise ValueError(f"MixtureOfExperts: top_k ({top_k}) must be <= num_experts ({num_experts})")
        if routing not in ROUTINGS:
            raise ValueError(f"MixtureOfExperts: routing must be one of {list(ROUTINGS)}, got {routing!r}")
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"MixtureOfExperts: activation must be one of {list(EXPERT_ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.routing, self.activation = routing, activation
        self.norm_topk_prob = _flag(norm_topk_prob, "norm_topk_prob")
        if norm_topk_prob and routing != "softmax_topk":
            raise ValueError(f"MixtureOfExperts: norm_topk_prob applies to routing='softmax_topk', got {routing!r}")
        self.routed_scaling = _finite(routed_scaling, "routed_scaling")
        clamped = activation == "clamped_swiglu"
        if clamped != (swiglu_limit is not None and swiglu_alpha is not None):
            raise ValueError("MixtureOfExperts: activation='clamped_swiglu' needs swiglu_limit and swiglu_alpha "
                             f"(and only it takes them), got activation={activation!r}, "
                             f"swiglu_limit={swiglu_limit!r}, swiglu_alpha={swiglu_alpha!r}")
        self.swiglu_limit = None if swiglu_limit is None else _finite(swiglu_limit, "swiglu_limit")
        self.swiglu_alpha = None if swiglu_alpha is None else _finite(swiglu_alpha, "swiglu_alpha")
        self.weight_inputs = _flag(weight_inputs, "weight_inputs")
        if shared_expert is not None and not isinstance(shared_expert, nn.Module):
            raise TypeError(f"MixtureOfExperts: shared_expert must be an nn.Module or None, "
                            f"got {type(shared_expert).__name__}")
        if _flag(shared_gate, "shared_gate") and shared_expert is None:
            raise ValueError("MixtureOfExperts: shared_gate=True needs a shared_expert")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        E, F_, C = num_experts, hidden, dim
        self.router = nn.Linear(C, E, bias=_flag(router_bias, "router_bias"), **kw)
        self.gate_proj = nn.Parameter(torch.empty(E, F_, C, **kw))
        self.up_proj = nn.Parameter(torch.empty(E, F_, C, **kw))
        self.down_proj = nn.Parameter(torch.empty(E, C, F_, **kw))
        self.bias = _flag(bias, "bias")
        self.gate_bias = nn.Parameter(torch.zeros(E, F_, **kw)) if bias else None
        self.up_bias = nn.Parameter(torch.zeros(E, F_, **kw)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(E, C, **kw)) if bias else None
        self.shared_expert = shared_expert
        self.shared_gate = nn.Linear(C, 1, bias=False, **kw) if shared_gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Expert weights uniform in ``+-1/sqrt(fan_in)`` (``nn.Linear``'s bound); biases zero."""
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router of ``x [T, C]``: ``(weights [T, k], experts [T, k] long, logits [T, E])``; the
        softmax/sigmoid run in at least float32, the weights come back in ``x``'s dtype."""
        logits = self.router(x)  # [T, E]
        wide = torch.promote_types(logits.dtype, torch.float32)  # half precision routes in float32
        if self.routing == "softmax_topk":
            probs = torch.softmax(logits, dim=-1, dtype=wide)  # [T, E]
            weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            top, experts = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
            weights = (torch.softmax(top, dim=-1) if self.routing == "topk_softmax"
                       else torch.sigmoid(top.to(wide)))
        if self.routed_scaling != 1.0:
            weights = weights * self.routed_scaling
        return weights.to(x.dtype), experts, logits

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on ``x [T, C]`` -> ``[T, C]``."""
        g = F.linear(x, self.gate_proj[e], None if self.gate_bias is None else self.gate_bias[e])  # [T, F]
        u = F.linear(x, self.up_proj[e], None if self.up_bias is None else self.up_bias[e])  # [T, F]
        if self.activation == "swiglu":
            h = F.silu(g) * u
        else:
            assert self.swiglu_limit is not None and self.swiglu_alpha is not None
            g = g.clamp(max=self.swiglu_limit)
            u = u.clamp(-self.swiglu_limit, self.swiglu_limit)
            h = (u + 1) * (g * torch.sigmoid(self.swiglu_alpha * g))
        return F.linear(h, self.down_proj[e], None if self.down_bias is None else self.down_bias[e])  # [T, C]

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"MixtureOfExperts: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"MixtureOfExperts: x must have shape [..., {self.dim}], got {tuple(x.shape)}")
        shape = x.shape
        flat = x.reshape(-1, self.dim)  # [T, C]
        weights, experts, _ = self.route(flat)  # [T, k]
        out = torch.zeros_like(flat)
        for e in torch.unique(experts).tolist():
            token, slot = torch.nonzero(experts == e, as_tuple=True)  # which tokens chose e, in which slot
            w = weights[token, slot, None]  # [n, 1]
            if self.weight_inputs:
                y = self.expert(e, flat[token] * w)
            else:
                y = self.expert(e, flat[token]) * w
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)  # [T, C]
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view(shape)

    def extra_repr(self) -> str:
        return (f"{self.dim}, hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"routing={self.routing!r}, activation={self.activation!r}")
