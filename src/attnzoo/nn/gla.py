"""Gated linear attention (Yang et al. 2024) as a mixer: ``[B, N, C] -> [B, N, C]``.

``q, k, v = x W_q, x W_k, x W_v`` (optionally through short causal convolutions + SiLU), a
data-dependent decay per key dimension from a low-rank projection
``log alpha_t = logsigmoid(x_t W_1 W_2 + b) / tau`` (rank 16, ``tau = 16``), the kernel
:func:`attnzoo.gated_linear_attention` (``S_t = diag(alpha_t) S_{t-1} + k_t v_t^T``), a per-head
RMSNorm, the output gate ``silu(x W_r)`` and the output projection.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._validate import check_int, check_positive_float
from attnzoo.functional.recurrent.gla import MATMUL_SUB_CHUNK, gated_linear_attention
from attnzoo.nn.recurrent import (
    RecurrentMixer,
    recurrent_cost,
    register_recurrent,
    wide,
)
from attnzoo.nn.spec import Cost, CostShape, VariantConfig

__all__ = ["GatedLinearAttention"]

#: rank of the decay projection and temperature of the published GLA
GATE_RANK, GATE_TEMPERATURE = 16, 16.0


class GatedLinearAttention(RecurrentMixer):
    """GLA: data-dependent decays per key dimension, per-head RMSNorm, swish output gate.

    Args:
        dim, num_heads: model width ``C`` and heads ``H``.
        head_dim: ``D`` (default ``C // H``); the state is ``D x D`` per head.
        bias: biases in the q/k/v/output projections.
        gate_rank: rank of the decay projection ``W_1 [C, r] W_2 [r, H D]``.
        gate_temperature: ``tau`` in ``log alpha = logsigmoid(...) / tau``.
        conv_size: kernel of the short causal convolutions on q, k, v (0 = none, GLA's default).
        output_gate: the swish gate ``silu(x W_r)`` on the normalised output.
        chunk_size: chunk of the kernel's chunked form.
        num_v_heads: value heads ``Hv`` (default ``num_heads``; a multiple of it): grouped value heads,
            each with its own decay (``gk_proj`` gives ``Hv * D``), norm and gate; state ``[Hv, D, D]``.
        device, dtype: of the parameters.

    Decode cache: :class:`~attnzoo.nn.recurrent.RecurrentCache` (state ``[B, Hv, D, D]``).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, bias: bool = False,
                 gate_rank: int = GATE_RANK, gate_temperature: float = GATE_TEMPERATURE, conv_size: int = 0,
                 output_gate: bool = True, chunk_size: int = 64, num_v_heads: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(dim, num_heads, head_dim=head_dim, bias=bias, layout="q_k_v", factory=fk)
        cls = type(self).__name__
        self.set_gate_and_chunk(output_gate, chunk_size)
        self.gate_temperature = check_positive_float(gate_temperature, "gate_temperature", cls)
        hv = self.set_value_heads(num_v_heads, self.head_dim, bias, fk)
        self.gk_proj = nn.Sequential(nn.Linear(dim, check_int(gate_rank, "gate_rank", owner=cls), bias=False, **fk),
                                     nn.Linear(gate_rank, hv * self.head_dim, bias=True, **fk))
        self.gate_norm_convs(conv_size, bias, fk)

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        new: dict[str, Tensor] = {}
        q, k, v = (wide(self.heads(self.short_conv(n, p(x), pad, conv, new, silu=False, cu=cu)))
                   for n, p in (("q", self.q_proj), ("k", self.k_proj), ("v", self.v_proj)))  # [B, H(v), N, D]
        log_decay = self.heads(F.logsigmoid(wide(self.gk_proj(x))) / self.gate_temperature)  # [B, Hv, N, D], <= 0
        if pad is not None:  # a padded token neither writes (k = 0) nor decays the state
            keep = pad[:, None, :, None].to(q.dtype)
            k, log_decay = k * keep, log_decay * keep
            if v.shape[1] != k.shape[1]:  # grouped value heads: no write through v instead of k
                v = v * keep
        o, state = gated_linear_attention(q, k, v, log_decay, initial_state=state, return_state=True,
                                          chunk_size=self.chunk_size, cu_seqlens=cu)
        return self.head_output(x, o), state, new



# --------------------------------------------------------------------------- variant spec
def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    inner, C = cfg.num_heads * cfg.head_dim, cfg.dim
    est = recurrent_cost(cfg, shape, in_width=4 * inner, inner=inner, dk=cfg.head_dim, dv=cfg.head_dim,
                         conv_channels=0, conv_size=0, kernel="vector", extra_params=inner + GATE_RANK * inner + inner)
    gate_flops = 2 * shape.batch * shape.seq_len * GATE_RANK * (C + inner)
    # the per-channel decay sums of a chunk as matmuls: prefix and suffix (2 c D each) and, in the fast plan of
    # weak decays (chunks of two blocks or more, attnzoo.functional.recurrent.gla), the whole chunk's midpoint sums (2 c D)
    c = min(cfg.chunk_size or 64, shape.seq_len)
    sums = shape.batch * cfg.num_heads * shape.seq_len * 6 * c * cfg.head_dim if c >= 2 * MATMUL_SUB_CHUNK else 0
    return replace(est, flops_projections=est.flops_projections + gate_flops, flops_attention=est.flops_attention + sums,
                   flops_useful=est.flops_useful + sums, flops_backward=est.flops_backward + 2 * gate_flops + 2 * sums,
                   params=est.params + C * GATE_RANK)


register_recurrent("gla", GatedLinearAttention, _cost, "state S [D, D] per head", order=21)
