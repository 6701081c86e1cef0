"""A mixture-of-experts feed-forward: a top-k router over ``E`` experts (gated, or relu^2 without
a gate), an optional shared expert (with an optional sigmoid gate).

Each token ``x [C]`` gets router logits ``l = W_r x (+ b_r)`` ``[E]``, picks ``k`` experts and
weights ``w``, and its output is ``sum_e w_e * expert_e(x)`` (or, with ``weight_inputs``,
``sum_e expert_e(w_e * x)``) plus the shared expert. The routings of the open families:

* ``"softmax_topk"`` (Qwen2/3-MoE, Qwen3-Next, Mixtral, OLMoE): ``p = softmax(l)`` in float32
  over all ``E`` experts, the ``k`` largest kept; ``norm_topk_prob`` renormalises them to sum to 1.
* ``"topk_softmax"`` (gpt-oss): the ``k`` largest logits, then a softmax over those ``k``.
* ``"topk_sigmoid"`` (Llama-4): the ``k`` largest logits, each through a sigmoid (float32).
* ``"sigmoid_topk"`` (DeepSeek-V3, Kimi Linear, Nemotron-H): ``l`` and ``p = sigmoid(l)`` in
  float32 (the router's matmul too, as transformers computes it); the ``k`` experts
  of largest ``p + score_bias`` (``score_bias [E]``, a buffer: transformers'
  ``e_score_correction_bias``, which picks but does not weight) keep their ``p``;
  ``norm_topk_prob`` divides them by their sum plus ``Routing.norm_eps`` (``1e-20``, DeepSeek-V3's;
  LFM2-MoE adds ``1e-6``). With ``groups = G > 1``
  (group-limited routing, DeepSeek-V3's ``n_group`` / ``topk_group``) the ``E`` experts form
  ``G`` consecutive groups, each scored by the sum of its two largest ``p + score_bias``; only the
  ``topk_groups`` best groups' experts can be picked.

The routing settings come as one :class:`Routing`, the experts' as one :class:`Experts`.
``Routing.scaling`` multiplies the routed weights (DeepSeek's ``routed_scaling_factor``).
Experts: ``"swiglu"`` ``down(silu(gate(x)) * up(x))``; ``"clamped_swiglu"`` (gpt-oss):
``g = min(gate(x), limit)``, ``u = clamp(up(x), -limit, limit)``,
``down((u + 1) * g * sigmoid(alpha * g))``; ``"limited_swiglu"`` (Ling's linear hybrids,
``bailing_hybrid``: SwiGLU clipped after the activation)
``down(min(silu(gate(x)), limit) * clamp(up(x), -limit, limit))``; ``"relu2"`` (Nemotron-H, no
gate: the experts have no ``gate_proj`` at all) ``down(relu(up(x)) ** 2)``. The shared expert is any module ``[.., C] -> [.., C]``
(e.g. a :class:`~attnzoo.FeedForward`); ``shared_gate`` multiplies it by ``sigmoid(w_s . x)``
(Qwen2-MoE, Qwen3-Next).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._devices import float32_snapshot, restore_float32, restore_float32_params
from attnzoo._validate import (
    check_bool,
    check_choice,
    check_int,
    check_nonnegative_float,
    check_positive_float,
)

__all__ = ["EXPERT_ACTIVATIONS", "GATED_EXPERTS", "NORM_EPS", "ROUTINGS", "Experts", "MixtureOfExperts", "Routing"]

ROUTINGS = ("softmax_topk", "topk_softmax", "topk_sigmoid", "sigmoid_topk")
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu", "limited_swiglu", "relu2")
#: the expert activations with a ``gate_proj`` (the others have none)
GATED_EXPERTS = ("swiglu", "clamped_swiglu", "limited_swiglu")
#: ``Routing.norm_eps``'s default: DeepSeek-V3's ``sum + 1e-20`` (a sigmoid sum is never 0)
NORM_EPS = 1e-20


@dataclass(frozen=True)
class Routing:
    """How :class:`MixtureOfExperts` weights its experts (validated on construction).

    Args:
        kind: ``"softmax_topk"``, ``"topk_softmax"``, ``"topk_sigmoid"`` or ``"sigmoid_topk"``
            (module docstring).
        norm_topk_prob: renormalise the kept probabilities (``kind="softmax_topk"`` or
            ``"sigmoid_topk"`` only).
        scaling: a factor on the routed weights (DeepSeek's ``routed_scaling_factor``).
        bias: a bias on the router (``router.bias [E]``).
        weight_inputs: scale each expert's input by its weight instead of its output (Llama-4).
        groups: expert groups ``G`` of group-limited routing (``kind="sigmoid_topk"`` only; 1: none).
        topk_groups: the groups a token's experts may come from (``1 <= topk_groups <= groups``).
        norm_eps: added to the kept weights' sum before ``norm_topk_prob`` divides by it
            (``kind="sigmoid_topk"`` only, finite and ``>= 0``; unused without ``norm_topk_prob``):
            ``1e-20`` as DeepSeek-V3 / Kimi Linear / Nemotron-H, ``1e-6`` as LFM2-MoE.
    """

    kind: str = "softmax_topk"
    norm_topk_prob: bool = False
    scaling: float = 1.0
    bias: bool = False
    weight_inputs: bool = False
    groups: int = 1
    topk_groups: int = 1
    norm_eps: float = NORM_EPS

    def __post_init__(self) -> None:
        check_choice(self.kind, "kind", "Routing", choices=ROUTINGS)
        for name in ("norm_topk_prob", "bias", "weight_inputs"):
            check_bool(getattr(self, name), name, "Routing")
        if self.norm_topk_prob and self.kind not in ("softmax_topk", "sigmoid_topk"):
            raise ValueError(f"Routing: norm_topk_prob applies to kind='softmax_topk' or 'sigmoid_topk', "
                             f"got {self.kind!r}")
        object.__setattr__(self, "scaling", check_positive_float(self.scaling, "scaling", "Routing"))
        groups, topk_groups = check_int(self.groups, "groups", "Routing"), check_int(self.topk_groups, "topk_groups", "Routing")
        if topk_groups > groups:
            raise ValueError(f"Routing: topk_groups must be <= groups={groups}, got {topk_groups}")
        if groups > 1 and self.kind != "sigmoid_topk":
            raise ValueError(f"Routing: groups > 1 (group-limited routing) applies to kind='sigmoid_topk', "
                             f"got {self.kind!r}")
        norm_eps = check_nonnegative_float(self.norm_eps, "norm_eps", "Routing")
        if norm_eps != NORM_EPS and self.kind != "sigmoid_topk":  # softmax_topk renormalises without one
            raise ValueError(f"Routing: norm_eps applies to kind='sigmoid_topk', got {self.kind!r}")
        object.__setattr__(self, "norm_eps", norm_eps)


@dataclass(frozen=True)
class Experts:
    """The experts of :class:`MixtureOfExperts` (validated on construction).

    Args:
        activation: ``"swiglu"``, ``"clamped_swiglu"`` (which needs ``swiglu_limit`` and
            ``swiglu_alpha``, and only it takes them), ``"limited_swiglu"`` (which needs
            ``swiglu_limit`` alone) or ``"relu2"`` (ungated: no ``gate_proj``).
        swiglu_limit: the clamp ``limit`` of ``"clamped_swiglu"`` / ``"limited_swiglu"``.
        swiglu_alpha: the sigmoid slope ``alpha`` of ``"clamped_swiglu"``.
        bias: biases on the experts' projections.
    """

    activation: str = "swiglu"
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    bias: bool = False

    def __post_init__(self) -> None:
        check_choice(self.activation, "activation", "Experts", choices=EXPERT_ACTIVATIONS)
        clamped = self.activation == "clamped_swiglu"
        given = (self.swiglu_limit is not None, self.swiglu_alpha is not None)
        if self.activation == "limited_swiglu" and given != (True, False):
            raise ValueError("Experts: activation='limited_swiglu' needs swiglu_limit and takes no swiglu_alpha, "
                             f"got swiglu_limit={self.swiglu_limit!r}, swiglu_alpha={self.swiglu_alpha!r}")
        if self.activation != "limited_swiglu" and given != (clamped, clamped):
            raise ValueError("Experts: activation='clamped_swiglu' needs swiglu_limit and swiglu_alpha "
                             f"(and only it takes them), got activation={self.activation!r}, "
                             f"swiglu_limit={self.swiglu_limit!r}, swiglu_alpha={self.swiglu_alpha!r}")
        for name in ("swiglu_limit", "swiglu_alpha"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_positive_float(getattr(self, name), name, "Experts"))
        check_bool(self.bias, "bias", "Experts")

    @property
    def gated(self) -> bool:
        """Whether the experts have a ``gate_proj`` (``"swiglu"``, ``"clamped_swiglu"``)."""
        return self.activation in GATED_EXPERTS


class MixtureOfExperts(nn.Module):
    """Top-k routed experts plus an optional shared expert (see the module docstring).

    Args:
        dim: model width ``C``.
        hidden: each expert's hidden width ``F``.
        num_experts: ``E``.
        top_k: experts per token ``k`` (``<= E``).
        routing: a :class:`Routing` (default ``Routing()``: ``"softmax_topk"``, unnormalised).
        experts: an :class:`Experts` (default ``Experts()``: SwiGLU without biases; ``Experts("relu2")``:
            ungated).
        shared_expert: a module added to every token's output, or ``None``.
        shared_gate: gate the shared expert by ``sigmoid(shared_gate(x))`` (a ``[1, C]`` linear).
        keep_router_float32: the router's weight (and bias) in float32 whatever ``dtype``, kept so
            through later casts (``.to``, ``.half()``, ``.bfloat16()``; see
            :meth:`keep_router_in_float32`), as transformers keeps ``gate.weight`` of DeepSeek-V3-style
            routers (``_keep_in_fp32_modules_strict``). A float32 model is unchanged by it.

    Weights: ``router`` (``[E, C]``, bias ``[E]``), ``gate_proj``/``up_proj`` ``[E, F, C]``,
    ``down_proj`` ``[E, C, F]`` (biases ``gate_bias``/``up_bias`` ``[E, F]``, ``down_bias``
    ``[E, C]``), ``shared_expert``, ``shared_gate``; buffer ``score_bias [E]`` (float32) with
    ``"sigmoid_topk"``. Ungated experts (``"relu2"``) have no ``gate_proj`` / ``gate_bias``
    (both ``None``, absent from the state dict).
    Shapes: ``x [..., C] -> [..., C]``.

    Example: gpt-oss's layer is ``MixtureOfExperts(C, F, E, k, routing=Routing("topk_softmax",
    bias=True), experts=Experts("clamped_swiglu", swiglu_limit=7.0, swiglu_alpha=1.702, bias=True))``;
    Nemotron-H's ``MixtureOfExperts(C, F, E, k, routing=Routing("sigmoid_topk", norm_topk_prob=True,
    scaling=s, groups=G, topk_groups=g), experts=Experts("relu2"), shared_expert=FeedForward(C, F_s,
    "relu2", bias=False))``.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, routing: Routing | None = None,
                 experts: Experts | None = None, shared_expert: nn.Module | None = None, shared_gate: bool = False,
                 keep_router_float32: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim, self.hidden = check_int(dim, "dim", "MixtureOfExperts"), check_int(hidden, "hidden", "MixtureOfExperts")
        self.num_experts, self.top_k = check_int(num_experts, "num_experts", "MixtureOfExperts"), check_int(top_k, "top_k", "MixtureOfExperts")
        if top_k > num_experts:
            raise ValueError(f"MixtureOfExperts: top_k ({top_k}) must be <= num_experts ({num_experts})")
        routing = Routing() if routing is None else routing
        experts = Experts() if experts is None else experts
        if not isinstance(routing, Routing):
            raise TypeError(f"MixtureOfExperts: routing must be a Routing or None, got {type(routing).__name__} "
                            f"({routing!r})")
        if not isinstance(experts, Experts):
            raise TypeError(f"MixtureOfExperts: experts must be an Experts or None, got {type(experts).__name__} "
                            f"({experts!r})")
        self.routing, self.norm_topk_prob, self.routed_scaling = routing.kind, routing.norm_topk_prob, routing.scaling
        self.weight_inputs, self.norm_eps = routing.weight_inputs, routing.norm_eps
        self.activation, self.swiglu_limit, self.swiglu_alpha = (experts.activation, experts.swiglu_limit,
                                                                 experts.swiglu_alpha)
        if shared_expert is not None and not isinstance(shared_expert, nn.Module):
            raise TypeError(f"MixtureOfExperts: shared_expert must be an nn.Module or None, "
                            f"got {type(shared_expert).__name__}")
        if check_bool(shared_gate, "shared_gate", "MixtureOfExperts") and shared_expert is None:
            raise ValueError("MixtureOfExperts: shared_gate=True needs a shared_expert")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        E, F_, C = num_experts, hidden, dim
        self.router = nn.Linear(C, E, bias=routing.bias, **kw)
        self.score_bias: Tensor | None
        self.groups, self.topk_groups = routing.groups, routing.topk_groups
        if routing.groups > 1 and (E % routing.groups or E // routing.groups < 2
                                   or top_k > routing.topk_groups * (E // routing.groups)):
            raise ValueError(f"MixtureOfExperts: group-limited routing needs num_experts={E} divisible by "
                             f"groups={routing.groups} into groups of >= 2 and top_k={top_k} <= topk_groups * "
                             f"experts per group ({routing.topk_groups} * {E // routing.groups})")
        if routing.kind == "sigmoid_topk":
            self.register_buffer("score_bias", torch.zeros(E, device=device, dtype=torch.float32))
        else:
            self.score_bias = None
        self.gated = gated = experts.gated
        self.gate_proj = nn.Parameter(torch.empty(E, F_, C, **kw)) if gated else None
        self.up_proj = nn.Parameter(torch.empty(E, F_, C, **kw))
        self.down_proj = nn.Parameter(torch.empty(E, C, F_, **kw))
        self.bias = bias = experts.bias
        self.gate_bias = nn.Parameter(torch.zeros(E, F_, **kw)) if bias and gated else None
        self.up_bias = nn.Parameter(torch.zeros(E, F_, **kw)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(E, C, **kw)) if bias else None
        self.shared_expert = shared_expert
        self.shared_gate = nn.Linear(C, 1, bias=False, **kw) if shared_gate else None
        self.keep_router_float32 = False
        if check_bool(keep_router_float32, "keep_router_float32", "MixtureOfExperts"):
            self.keep_router_in_float32()
        self.reset_parameters()

    def keep_router_in_float32(self) -> MixtureOfExperts:
        """From now on the router's weight (and bias) stays float32: cast to float32 now if 16-bit,
        and put back in float32 after every half cast (``keep_router_float32=True`` does this on
        construction; for a factory that does not take it). Call it before loading weights, so that
        a float32 checkpoint's router loads exactly. Returns ``self``."""
        self.keep_router_float32 = True
        for p in self.router.parameters():
            if p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.float()
        return self

    def reset_parameters(self) -> None:
        """Expert weights uniform in ``+-1/sqrt(fan_in)`` (``nn.Linear``'s bound); biases zero."""
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            if w is None:  # ungated experts
                continue
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def _apply(self, fn: Any, recurse: bool = True) -> MixtureOfExperts:
        """Half casts leave ``score_bias`` in float32 (transformers keeps DeepSeek-V3's and Kimi's
        correction bias in float32 too): a bias rounded to 16 bits picks other experts near ties;
        with ``keep_router_float32`` the router's weight (and bias) too."""
        before = self.score_bias
        names = tuple(f"router.{n}" for n, _ in self.router.named_parameters()) if self.keep_router_float32 else ()
        router = float32_snapshot(self, names)
        super()._apply(fn, recurse)
        restore_float32(self, "score_bias", before)
        restore_float32_params(self, router)
        return self

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router of ``x [T, C]``: ``(weights [T, k], experts [T, k] long, logits [T, E])``; the
        softmax/sigmoid run in at least float32 (``"sigmoid_topk"``'s router matmul too, as
        transformers' DeepSeek-V3 / Kimi / Nemotron-H routers compute it; and any routing with a
        float32 router on half-precision ``x``: ``keep_router_float32``), the weights come back in
        ``x``'s dtype."""
        wide = torch.promote_types(x.dtype, torch.float32)  # half precision routes in float32
        r = self.router
        if self.score_bias is not None or (self.keep_router_float32 and r.weight.dtype != x.dtype):
            # float32 logits from half-precision inputs
            logits = F.linear(x.to(wide), r.weight.to(wide), None if r.bias is None else r.bias.to(wide))
        else:
            logits = self.router(x)  # [T, E]
        if self.routing == "softmax_topk":
            probs = torch.softmax(logits, dim=-1, dtype=wide)  # [T, E]
            weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        elif self.score_bias is not None:  # sigmoid_topk: the bias picks, the sigmoid weights
            probs = torch.sigmoid(logits.to(wide))  # [T, E]
            experts = torch.topk(self._in_best_groups(probs + self.score_bias.to(wide)), self.top_k, dim=-1)[1]
            weights = probs.gather(-1, experts)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        else:
            top, experts = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
            weights = (torch.softmax(top, dim=-1) if self.routing == "topk_softmax"
                       else torch.sigmoid(top.to(wide)))
        if self.routed_scaling != 1.0:
            weights = weights * self.routed_scaling
        return weights.to(x.dtype), experts, logits

    def _in_best_groups(self, choice: Tensor) -> Tensor:
        """``choice [T, E]`` with the experts outside each token's ``topk_groups`` best groups (a
        group's score: the sum of its two largest choices) set to ``-inf``; unchanged for 1 group."""
        if self.groups == 1:
            return choice
        by_group = choice.unflatten(-1, (self.groups, -1))  # [T, G, E / G]
        best = by_group.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices  # [T, topk_groups]
        keep = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter_(-1, best, True)  # [T, G]
        return by_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on ``x [T, C]`` -> ``[T, C]``."""
        u = F.linear(x, self.up_proj[e], None if self.up_bias is None else self.up_bias[e])  # [T, F]
        if self.gate_proj is None:  # relu2: no gate
            h = torch.square(F.relu(u))
            return F.linear(h, self.down_proj[e], None if self.down_bias is None else self.down_bias[e])  # [T, C]
        g = F.linear(x, self.gate_proj[e], None if self.gate_bias is None else self.gate_bias[e])  # [T, F]
        if self.activation == "swiglu":
            h = F.silu(g) * u
        elif self.activation == "limited_swiglu":
            assert self.swiglu_limit is not None
            h = F.silu(g).clamp(max=self.swiglu_limit) * u.clamp(-self.swiglu_limit, self.swiglu_limit)
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
