"""Mamba-2's SSD mixer (Dao & Gu 2024) as a mixer: ``[B, N, C] -> [B, N, C]``.

Projections of ``x`` give ``z`` (gate), ``x`` (values, ``H`` heads of ``P = expand * D``), ``B``
and ``C`` (``ngroups`` groups of ``state_size``, shared by the heads of a group) and ``dt`` (one per
head); ``x, B, C`` go through short causal depthwise convolutions and SiLU. Then, per head::

    dt_t = softplus(dt_t + dt_bias),   A = -exp(A_log)
    h_t  = exp(dt_t A) h_{t-1} + B_t (dt_t x_t)^T        # [state_size, P]
    y_t  = C_t^T h_t + D x_t

computed by :func:`attnzoo.gated_linear_attention` with one decay per token
(``q = C, k = B, v = x dt, log_decay = dt A``, scale 1; chunked scan in plain PyTorch, recurrent
decode), then the gated RMSNorm ``norm(y * silu(z))`` (per group: :class:`GatedRMSNorm`, a part
a family replaces for ``norm(y) * silu(z)`` or no norm) and the output projection. The
separate projections equal Mamba-2's fused ``in_proj`` (and the per-channel convolutions its
fused ``conv1d``) split by rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import check_choice, check_int, check_nonnegative_float
from attnzoo.functional.recurrent.gla import gated_linear_attention
from attnzoo.nn.deltanet import init_decay_parameters
from attnzoo.nn.recurrent import (
    HeadNorm,
    RecurrentMixer,
    recurrent_cost,
    register_recurrent,
    wide,
)
from attnzoo.nn.spec import Cost, CostShape, VariantConfig

__all__ = ["GATE_NORMS", "GatedRMSNorm", "Mamba2"]

#: defaults the cost model assumes (they are not cost-model options)
EXPAND, STATE_SIZE, CONV_SIZE = 2, 64, 4
#: where the gated RMSNorm sits: ``norm(y * silu(z))`` (Mamba-2), ``norm(y) * silu(z)``, or no norm
#: (``y * silu(z)``; Falcon-H1's ``mamba_rms_norm=False``)
GATE_NORMS = ("after_gate", "before_gate", "none")


class GatedRMSNorm(HeadNorm):
    """Mamba-2's output norm: an RMSNorm per group of heads (weight ``[G, W]``) with the output
    gate ``silu(z)``: ``norm(y * gate)`` (``place="after_gate"``, Mamba-2), ``norm(y) * gate``
    (``"before_gate"``), or ``y * gate`` and no norm weights (``"none"``). Without a gate (a mixer
    built with ``output_gate=False``) it is the plain norm.

    ``forward(y [B, N, G * W], gate [B, N, G * W] | None) -> [B, N, G * W]`` (float32 for half
    inputs, as :class:`~attnzoo.nn.recurrent.HeadNorm`).
    """

    def __init__(self, groups: int, width: int, *, place: str = "after_gate", eps: float = 1e-5,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(check_int(groups, "groups", owner="GatedRMSNorm"), check_int(width, "width", owner="GatedRMSNorm"),
                         "rms", check_nonnegative_float(eps, "eps", "GatedRMSNorm"), {"device": device, "dtype": dtype})
        self.place = check_choice(place, "place", "GatedRMSNorm", choices=GATE_NORMS)
        if self.place == "none":
            self.weight = None  # type: ignore[assignment]

    def forward(self, y: Tensor, gate: Tensor | None = None) -> Tensor:  # type: ignore[override]
        width = None if self.weight is None else self.weight.numel()
        if y.dim() != 3 or (width is not None and y.shape[-1] != width):
            raise ValueError(f"GatedRMSNorm: y must be [B, N, {width or 'G * W'}], got {tuple(y.shape)}")
        if gate is not None and gate.shape != y.shape:
            raise ValueError(f"GatedRMSNorm: gate must have y's shape {tuple(y.shape)}, got {tuple(gate.shape)}")
        if gate is not None and self.place != "before_gate":
            y = y * gate
        if self.weight is not None:
            b, n, _ = y.shape
            y = super().forward(y.reshape(b, n, self.weight.shape[0], -1).transpose(1, 2)).transpose(1, 2).reshape(b, n, -1)
        if gate is not None and self.place == "before_gate":
            y = y * gate
        return y

    def extra_repr(self) -> str:
        return f"place={self.place!r}" + ("" if self.weight is None else f", groups={self.weight.shape[0]}, eps={self.eps}")


class Mamba2(RecurrentMixer):
    """The Mamba-2 (SSD) mixer.

    Args:
        dim: model width ``C``.
        num_heads: SSM heads ``H``.
        head_dim: ``D`` (default ``C // H``); each head carries ``P = expand * D`` value channels.
        expand: inner width ``H * P = expand * H * D`` (Mamba-2: 2).
        state_size: ``N_s`` of ``B``, ``C`` (the state is ``N_s x P`` per head).
        ngroups: groups of heads sharing ``B`` and ``C`` (divides ``H``).
        conv_size: kernel of the short causal convolutions on ``x, B, C`` (0 = none; default 4).
        output_gate: the gate ``silu(z)`` before the RMSNorm (off: a plain RMSNorm, no ``z``).
        bias: biases in the input/output projections (Mamba-2: none; the convolutions have one).
        chunk_size: chunk of the SSD's chunked form.
        device, dtype: of the parameters.

    Parts: ``norm`` (a :class:`GatedRMSNorm`, ``place="after_gate"``, ``eps=1e-5``) and the
    convolutions ``x_conv``, ``B_conv``, ``C_conv`` (:class:`~attnzoo.nn.recurrent.ShortConv`, with
    biases) are modules a family replaces or changes after building (the Hugging Face builders set
    the norm's place and epsilon, and drop the convolutions' biases where a checkpoint has none).

    Decode cache: :class:`~attnzoo.nn.recurrent.RecurrentCache`: the state ``[B, H, N_s, P]`` and the
    last ``conv_size - 1`` inputs of the ``x, B, C`` convolutions.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, expand: int = EXPAND,
                 state_size: int = STATE_SIZE, ngroups: int = 1, conv_size: int = CONV_SIZE,
                 output_gate: bool = True, bias: bool = False, chunk_size: int = 64,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(dim, num_heads, head_dim=head_dim, bias=bias, layout="q_k_v", factory=fk)
        cls = type(self).__name__
        H = self.num_heads
        self.expand, self.state_size = check_int(expand, "expand", owner=cls), check_int(state_size, "state_size",
                                                                                         owner=cls)
        self.ngroups = check_int(ngroups, "ngroups", owner=cls)
        if H % self.ngroups:
            raise ValueError(f"{cls}: num_heads ({H}) must be divisible by ngroups ({self.ngroups})")
        self.set_gate_and_chunk(output_gate, chunk_size)
        self.inner_head_dim = P = self.expand * self.head_dim
        gs = self.ngroups * self.state_size
        # the rows of Mamba-2's in_proj, one Linear each: C (queries), B (keys), x (values), z, dt
        self.q_proj = nn.Linear(dim, gs, bias=bias, **fk)
        self.k_proj = nn.Linear(dim, gs, bias=bias, **fk)
        self.v_proj = nn.Linear(dim, H * P, bias=bias, **fk)
        self.z_proj = nn.Linear(dim, H * P, bias=bias, **fk) if self.output_gate else None
        self.dt_proj = nn.Linear(dim, H, bias=False, **fk)
        self.out_proj = nn.Linear(H * P, dim, bias=bias, **fk)
        self.A_log = nn.Parameter(torch.empty(H, **fk))
        self.dt_bias = nn.Parameter(torch.empty(H, **fk))
        init_decay_parameters(self.A_log, self.dt_bias)
        self.D = nn.Parameter(torch.ones(H, **fk))
        self.norm = GatedRMSNorm(self.ngroups, H * P // self.ngroups, **fk)
        self.make_convs({"x": H * P, "B": gs, "C": gs}, conv_size, True, fk)
        self.state_shape = (H, self.state_size, P)

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        new: dict[str, Tensor] = {}
        xs = wide(self.heads(self.short_conv("x", self.v_proj(x), pad, conv, new, cu=cu),
                             self.inner_head_dim))  # [B, H, N, P]
        # B and C per group [B, G, N, N_s]: the kernel's grouped value heads (head h reads group h // (H / G))
        k = wide(self.heads(self.short_conv("B", self.k_proj(x), pad, conv, new, cu=cu), self.state_size))
        q = wide(self.heads(self.short_conv("C", self.q_proj(x), pad, conv, new, cu=cu), self.state_size))
        dt = F.softplus(wide(self.dt_proj(x)) + wide(self.dt_bias)).transpose(1, 2)  # [B, H, N]
        if pad is not None:  # a padded token neither writes (v = 0) nor decays the state
            dt = dt * pad[:, None, :].to(dt.dtype)
        log_decay = -wide(self.A_log).exp()[:, None] * dt  # [B, H, N], <= 0
        y, state = gated_linear_attention(q, k, xs * dt[..., None], log_decay, scale=1.0, initial_state=state,
                                          return_state=True, chunk_size=self.chunk_size, cu_seqlens=cu)
        y = (y + wide(self.D)[:, None, None] * xs).transpose(1, 2).flatten(2)  # [B, N, H * P], float32 for half
        y = self.norm(y, None if self.z_proj is None else F.silu(wide(self.z_proj(x))))
        return self.out_proj(y.to(x.dtype)), state, new

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, inner_head_dim={self.inner_head_dim}, "
                f"state_size={self.state_size}, ngroups={self.ngroups}, conv_size={self.conv_size}, "
                f"output_gate={self.output_gate}, chunk_size={self.chunk_size}")


# --------------------------------------------------------------------------- variant spec
def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """Assumes Mamba-2's defaults ``expand=2``, ``state_size=64``, ``ngroups=1``, ``conv_size=4``."""
    H, P, ns = cfg.num_heads, EXPAND * cfg.head_dim, STATE_SIZE
    inner = H * P
    return recurrent_cost(cfg, shape, in_width=2 * ns + 2 * inner + H, inner=inner, dk=ns, dv=P,
                          conv_channels=inner + 2 * ns, conv_size=CONV_SIZE, kernel="scalar",
                          extra_params=3 * H + inner + inner + 2 * ns, key_heads=1)


register_recurrent("mamba2", Mamba2, _cost, "state h [N_s, P] per head + conv inputs", order=24,
                   check={"chunk_size": 8, "state_size": 16})
