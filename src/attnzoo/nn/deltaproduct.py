"""Gated DeltaProduct (Siems et al. 2025) as a mixer: Gated DeltaNet with ``n_h`` delta steps per token.

As :class:`~attnzoo.nn.deltanet.GatedDeltaNet`, except that ``k_proj``, ``v_proj`` (and their short
convolutions) and ``b_proj`` give ``n_h`` keys, values and betas per token (``[B, N, n_h H D]``, read
as ``n_h`` consecutive micro-tokens, fla's layout), and the kernel is
:func:`attnzoo.functional.recurrent.delta_product.delta_product`: per token one decay ``a_t``, then ``n_h``
delta-rule steps, then the read-out with ``q_t``. ``allow_neg_eigval`` (beta in [0, 2]) is the
setting DeltaProduct's paper trains with for state tracking.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_int
from attnzoo.functional.recurrent.delta_product import delta_product
from attnzoo.nn.deltanet import GatedDeltaNet, l2_normalize
from attnzoo.nn.recurrent import ShortConv, recurrent_cost, register_recurrent, wide
from attnzoo.nn.spec import Cost, CostShape, VariantConfig

__all__ = ["GatedDeltaProduct"]


class GatedDeltaProduct(GatedDeltaNet):
    """Gated DeltaProduct: ``num_householder`` delta steps per token (1 = Gated DeltaNet's rule).

    Args:
        num_householder: ``n_h`` steps per token (default 2).
        the rest: as :class:`~attnzoo.nn.deltanet.GatedDeltaNet` (``num_v_heads``, ``allow_neg_eigval``, ...).

    Decode cache: :class:`~attnzoo.nn.recurrent.RecurrentCache`: the state ``[B, Hv, D, D]`` and the
    last ``conv_size - 1`` inputs of the q, k, v convolutions (k and v ``n_h`` times wider).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, bias: bool = False,
                 conv_size: int = 4, output_gate: bool | None = None, chunk_size: int = 64,
                 num_v_heads: int | None = None, allow_neg_eigval: bool = False, num_householder: int = 2,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, num_heads, head_dim=head_dim, bias=bias, conv_size=conv_size, output_gate=output_gate,
                         chunk_size=chunk_size, num_v_heads=num_v_heads, allow_neg_eigval=allow_neg_eigval,
                         device=device, dtype=dtype)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        nh = self.num_householder = check_int(num_householder, "num_householder", owner=type(self).__name__)
        inner, v_inner = self.num_heads * self.head_dim, self.num_v_heads * self.head_dim
        self.k_proj = nn.Linear(dim, nh * inner, bias=bias, **fk)
        self.v_proj = nn.Linear(dim, nh * v_inner, bias=bias, **fk)
        self.b_proj = nn.Linear(dim, nh * self.num_v_heads, bias=False, **fk)
        if self.conv_size:
            for name, ch in (("k", nh * inner), ("v", nh * v_inner)):
                self.conv_channels[name] = ch
                setattr(self, f"{name}_conv", ShortConv(ch, self.conv_size, False, fk))

    def _micro(self, t: Tensor) -> Tensor:
        """``[B, N, n_h H' D] -> [B, H', N n_h, D]`` (token t's j-th entry at micro-token ``t n_h + j``)."""
        b, n = t.shape[:2]
        return self.heads(t.reshape(b, n * self.num_householder, -1))

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        new: dict[str, Tensor] = {}
        nh = self.num_householder
        q = self.heads(self.short_conv("q", self.q_proj(x), pad, conv, new, cu=cu))  # [B, Hk, N, D]
        k = self._micro(self.short_conv("k", self.k_proj(x), pad, conv, new, cu=cu))  # [B, Hk, N n_h, D]
        v = self._micro(self.short_conv("v", self.v_proj(x), pad, conv, new, cu=cu))  # [B, Hv, N n_h, D]
        q, k = l2_normalize(q), l2_normalize(k)
        beta = torch.sigmoid(self.b_proj(x)).reshape(x.shape[0], -1, self.num_v_heads).transpose(1, 2)
        beta = 2 * beta if self.allow_neg_eigval else beta  # [B, Hv, N n_h]
        log_decay = self._log_decay(x)  # [B, Hv, N]
        if pad is not None:  # a padded token neither writes nor decays the state
            keep = pad[:, None, :].to(log_decay.dtype)
            beta, log_decay = beta * keep.repeat_interleave(nh, dim=-1).to(beta.dtype), log_decay * keep
        o, state = delta_product(wide(q), wide(k), wide(v), wide(beta), num_householder=nh, log_decay=log_decay,
                                 initial_state=state, return_state=True, chunk_size=self.chunk_size,
                                 cu_seqlens=cu, allow_neg_eigval=self.allow_neg_eigval)  # type: ignore[misc]
        return self.head_output(x, o), state, new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_householder={self.num_householder}"


# --------------------------------------------------------------------------- variant spec
NUM_HOUSEHOLDER = 2  # the default the cost model assumes


def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """Gated DeltaNet's cost with ``n_h = 2`` keys/values/betas per token: the k/v/beta projections and
    convolutions are ``n_h`` times wider and the kernel runs on ``n_h N`` micro-tokens."""
    inner, H, nh = cfg.num_heads * cfg.head_dim, cfg.num_heads, NUM_HOUSEHOLDER
    kw: dict[str, Any] = {"in_width": inner + 2 * nh * inner + nh * H + H + inner, "inner": inner, "dk": cfg.head_dim,
                          "dv": cfg.head_dim, "conv_channels": (1 + 2 * nh) * inner, "conv_size": 4, "kernel": "delta",
                          "extra_params": inner + 2 * H}
    est = recurrent_cost(cfg, shape, **kw)
    micro = recurrent_cost(cfg, replace(shape, seq_len=nh * shape.seq_len), **kw)
    return replace(est, flops_attention=micro.flops_attention, flops_useful=micro.flops_useful,
                   flops_backward=est.flops_backward - 2 * est.flops_attention + 2 * micro.flops_attention)


register_recurrent("gated_deltaproduct", GatedDeltaProduct, _cost,
                   "state S [D, D] per value head + conv inputs", order=26)
