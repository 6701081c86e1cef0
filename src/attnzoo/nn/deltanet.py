"""DeltaNet (Yang et al. 2024) and Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024) as mixers.

Both: ``q, k, v = x W_q, x W_k, x W_v`` through short causal depthwise convolutions (kernel 4)
and SiLU, q and k L2-normalised per head, the write strength ``beta_t = sigmoid(x_t W_beta)`` per
head, the kernel :func:`attnzoo.delta_rule`, a per-head RMSNorm, optionally the output gate
``silu(x W_g)``, and the output projection. Gated DeltaNet adds the decay per head and token
``a_t = exp(-softplus(x_t W_a + dt_bias) * exp(A_log))`` (Mamba-2's parametrisation) and has the
output gate on by default::

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = q_t^T S_t / sqrt(D)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import check_bool, check_int
from attnzoo.functional.core.rules import compute_dtype
from attnzoo.functional.recurrent.delta_rule import delta_rule
from attnzoo.nn.recurrent import (
    RecurrentMixer,
    recurrent_cost,
    register_recurrent,
    wide,
)
from attnzoo.nn.spec import Cost, CostShape, VariantConfig

__all__ = ["DeltaNet", "GatedDeltaNet", "init_decay_parameters"]


@torch.no_grad()
def init_decay_parameters(a_log: Tensor, dt_bias: Tensor, a_range: tuple[float, float] = (1.0, 16.0),
                          dt_range: tuple[float, float] = (1e-3, 1e-1)) -> None:
    """Mamba-2's initialisation: ``A ~ U(a_range)``, ``A_log = log A``; ``dt`` log-uniform in
    ``dt_range`` and ``dt_bias = softplus^-1(dt)`` (so ``softplus(0 + dt_bias) = dt``)."""
    a_log.copy_(torch.empty_like(a_log).uniform_(*a_range).log())
    lo, hi = math.log(dt_range[0]), math.log(dt_range[1])
    dt = torch.empty_like(dt_bias).uniform_(lo, hi).exp().clamp_min(1e-4)
    dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))



def l2_normalize(t: Tensor, eps: float = 0.0) -> Tensor:
    """``t / |t|`` over the last dim (``eps > 0``: ``t / sqrt(|t|^2 + eps)``), computed in float32 for
    half inputs: ``F.normalize``'s floor of 1e-12 is 0 in float16, so a zero head (a padded token, a
    zero input) became 0/0 = NaN and spread through the recurrent state."""
    x = t.to(compute_dtype(t.dtype))
    y = F.normalize(x, dim=-1) if not eps else x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)
    return y.to(t.dtype)

class DeltaNet(RecurrentMixer):
    """DeltaNet: the delta rule with L2-normalised q, k and ``beta = sigmoid(x W_beta)``.

    Args:
        dim: model width ``C``.
        num_heads: heads ``H``.
        head_dim: ``D`` (default ``C // H``); the state is ``D x D`` per head.
        bias: biases in the q/k/v/output projections.
        conv_size: kernel of the short causal convolutions on q, k, v (0 = none; default 4).
        output_gate: the swish gate ``silu(x W_g)`` on the normalised output (DeltaNet: off).
        chunk_size: chunk of the kernel's chunked (WY) form.
        num_v_heads: value heads ``Hv`` (default ``num_heads``; a multiple of it: grouped value heads,
            Qwen3-Next's 16 key / 32 value heads). ``beta``, the decay, the norm and the output gate are
            per value head; the state is ``[Hv, D, D]``; q and k are never expanded.
        allow_neg_eigval: ``beta = 2 sigmoid(x W_beta)`` in [0, 2] instead of [0, 1] (Grazzi et al. 2025,
            "Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues": the transition
            ``I - beta k k^T`` then has eigenvalues in [-1, 1]).
        device, dtype: of the parameters.

    Decode cache: :class:`~attnzoo.nn.recurrent.RecurrentCache`: the state ``[B, Hv, D, D]`` and the
    last ``conv_size - 1`` inputs of the three convolutions.
    """

    gated = False

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, bias: bool = False,
                 conv_size: int = 4, output_gate: bool | None = None, chunk_size: int = 64,
                 num_v_heads: int | None = None, allow_neg_eigval: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(dim, num_heads, head_dim=head_dim, bias=bias, layout="q_k_v", factory=fk)
        cls = type(self).__name__
        gate = self.gated if output_gate is None else output_gate
        self.output_gate = check_bool(gate, "output_gate", cls)
        self.allow_neg_eigval = check_bool(allow_neg_eigval, "allow_neg_eigval", cls)
        self.chunk_size = check_int(chunk_size, "chunk_size")
        hv = self.set_value_heads(num_v_heads, self.head_dim, bias, fk)
        self.b_proj = nn.Linear(dim, hv, bias=False, **fk)
        self.gate_norm_convs(conv_size, bias, fk)

    def _log_decay(self, x: Tensor) -> Tensor | None:
        return None

    def _l2(self, t: Tensor) -> Tensor:
        """The L2 normalisation of the query/key heads ``[B, H, N, D]`` (over ``D``)."""
        return l2_normalize(t)

    def _beta(self, x: Tensor) -> Tensor:
        """``[B, Hv, N]`` in [0, 1] (or [0, 2] with ``allow_neg_eigval``)."""
        beta = torch.sigmoid(self.b_proj(x)).transpose(1, 2)
        return 2 * beta if self.allow_neg_eigval else beta

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        new: dict[str, Tensor] = {}
        q, k, v = (self.heads(self.short_conv(n, p(x), pad, conv, new, cu=cu))
                   for n, p in (("q", self.q_proj), ("k", self.k_proj), ("v", self.v_proj)))  # [B, H(v), N, D]
        q, k = self._l2(q), self._l2(k)
        beta = self._beta(x)  # [B, Hv, N]
        log_decay = self._log_decay(x)  # [B, Hv, N(, D)] or None
        if pad is not None:  # a padded token neither writes (beta = 0) nor decays the state
            keep = pad[:, None, :].to(x.dtype)
            beta = beta * keep
            log_decay = None if log_decay is None else log_decay * keep.view(*keep.shape, *[1] * (log_decay.dim() - 3))
        o, state = self.kernel(q, k, v, beta, log_decay, state, cu)
        return self.head_output(x, o), state, new

    def kernel(self, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor | None,
               state: Tensor | None, cu: Tensor | None) -> tuple[Tensor, Tensor]:
        """The delta rule on the heads, in float32 for half modules (``o`` stays float32)."""
        q, k, v, beta = (wide(t) for t in (q, k, v, beta))
        return delta_rule(q, k, v, beta, log_decay=None if log_decay is None else wide(log_decay),
                          initial_state=state, return_state=True, chunk_size=self.chunk_size, cu_seqlens=cu,
                          allow_neg_eigval=self.allow_neg_eigval)  # type: ignore[return-value]



class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet: DeltaNet plus the decay ``a_t = exp(-softplus(x_t W_a + dt_bias) exp(A_log))``
    per head and token, output gate on by default. Arguments as :class:`DeltaNet`; parameters
    ``a_proj [H, C]``, ``A_log [H]``, ``dt_bias [H]`` (Mamba-2's initialisation)."""

    gated = True

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, bias: bool = False,
                 conv_size: int = 4, output_gate: bool | None = None, chunk_size: int = 64,
                 num_v_heads: int | None = None, allow_neg_eigval: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, num_heads, head_dim=head_dim, bias=bias, conv_size=conv_size, output_gate=output_gate,
                         chunk_size=chunk_size, num_v_heads=num_v_heads, allow_neg_eigval=allow_neg_eigval,
                         device=device, dtype=dtype)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        hv = self.num_v_heads
        self.a_proj = nn.Linear(dim, hv, bias=False, **fk)
        self.A_log = nn.Parameter(torch.empty(hv, **fk))
        self.dt_bias = nn.Parameter(torch.empty(hv, **fk))
        init_decay_parameters(self.A_log, self.dt_bias)

    def _log_decay(self, x: Tensor) -> Tensor:
        dt = F.softplus(wide(self.a_proj(x)) + wide(self.dt_bias))  # [B, N, Hv]
        return (-wide(self.A_log).exp() * dt).transpose(1, 2)  # [B, Hv, N], <= 0


# --------------------------------------------------------------------------- variant specs
def _cost(cfg: VariantConfig, shape: CostShape, gated: bool) -> Cost:
    inner, H = cfg.num_heads * cfg.head_dim, cfg.num_heads
    gate = inner if gated else 0
    extra = 2 * H if gated else 0
    return recurrent_cost(cfg, shape, in_width=3 * inner + H * (2 if gated else 1) + gate, inner=inner,
                          dk=cfg.head_dim, dv=cfg.head_dim, conv_channels=3 * inner, conv_size=4, kernel="delta",
                          extra_params=inner + extra)


def _deltanet_cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    return _cost(cfg, shape, gated=False)


def _gated_cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    return _cost(cfg, shape, gated=True)


register_recurrent("deltanet", DeltaNet, _deltanet_cost, "state S [D, D] per head + conv inputs", order=22)
register_recurrent("gated_deltanet", GatedDeltaNet, _gated_cost, "state S [D, D] per head + conv inputs", order=23)
