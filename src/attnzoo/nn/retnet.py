"""RetNet's multi-scale retention (Sun et al. 2023) as a mixer: ``[B, N, C] -> [B, N, C]``.

Per head ``h`` a fixed decay ``gamma_h = 1 - 2^(-5 - h)``; the heads run
:func:`attnzoo.retention` (``S_t = gamma S_{t-1} + k_t v_t^T``, ``o_t = q_t^T S_t / sqrt(D)``), each
head's output goes through a group norm (LayerNorm per head), then a swish gate
``silu(x W_G) * norm(o)`` and the output projection. xPos (RetNet's rotation of q and k) is not
applied: position enters only through the decay and causality.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.functional.recurrent.gla import gated_linear_attention
from attnzoo.functional.recurrent.retention import retention
from attnzoo.nn.recurrent import (
    HeadNorm,
    RecurrentMixer,
    recurrent_cost,
    register_recurrent,
    wide,
)
from attnzoo.nn.spec import Cost, CostShape, VariantConfig

__all__ = ["MultiScaleRetention", "retnet_gammas"]


def retnet_gammas(num_heads: int) -> Tensor:
    """RetNet's per-head decays ``1 - 2^(-5 - arange(H))`` (float64 ``[H]``)."""
    return 1 - 2.0 ** (-5 - torch.arange(num_heads, dtype=torch.float64))


class MultiScaleRetention(RecurrentMixer):
    """Multi-scale retention: retention per head, group norm, swish gate, output projection.

    Args:
        dim: model width ``C``.
        num_heads: heads ``H`` (decays ``gamma_h = 1 - 2^(-5 - h)``).
        head_dim: ``D`` (default ``C // H``); the state is ``D x D`` per head.
        bias: biases in the projections.
        output_gate: the swish gate ``silu(x W_G)`` (RetNet: on).
        chunk_size: chunk of :func:`attnzoo.retention`'s chunked form.
        device, dtype: of the parameters.

    Decode cache: :class:`~attnzoo.nn.recurrent.RecurrentCache` with the state ``[B, H, D, D]``.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, bias: bool = False,
                 output_gate: bool = True, chunk_size: int = 64, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(dim, num_heads, head_dim=head_dim, bias=bias, layout="q_k_v", factory=fk)
        self.set_gate_and_chunk(output_gate, chunk_size)
        inner = self.num_heads * self.head_dim
        self.g_proj = nn.Linear(dim, inner, bias=bias, **fk) if self.output_gate else None
        self.norm = HeadNorm(self.num_heads, self.head_dim, "layer", 1e-5, fk)
        self.state_shape = (self.num_heads, self.head_dim, self.head_dim)
        self.conv_channels, self.conv_size = {}, 0

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        q, k, v = (wide(t) for t in self.project_qkv(x))  # [B, H, N, D]
        kw: dict[str, Any] = {"initial_state": state, "return_state": True, "chunk_size": self.chunk_size}
        gamma = retnet_gammas(self.num_heads).to(device=x.device)
        if pad is None:
            o, state = retention(q, k, v, gamma.to(q.dtype), cu_seqlens=cu, **kw)
        else:  # skip padded tokens: no write (k = 0) and no decay (log decay 0)
            keep = pad[:, None, :, None].to(q.dtype)  # [B, 1, N, 1]
            g = gamma.log().to(q.dtype)[None, :, None] * keep[..., 0]  # [B, H, N]
            o, state = gated_linear_attention(q, k * keep, v, g.expand(-1, -1, x.shape[1]), **kw)
        return self.head_output(x, o), state, {}



# --------------------------------------------------------------------------- variant spec
def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    inner = cfg.num_heads * cfg.head_dim
    return recurrent_cost(cfg, shape, in_width=4 * inner, inner=inner, dk=cfg.head_dim, dv=cfg.head_dim,
                          conv_channels=0, conv_size=0, kernel="scalar", extra_params=2 * inner)


register_recurrent("retnet", MultiScaleRetention, _cost, "state S [D, D] per head", order=20)
