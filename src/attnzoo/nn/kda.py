"""Kimi Delta Attention (KDA; Kimi Linear, Moonshot AI 2025) as a mixer: ``[B, N, C] -> [B, N, C]``.

The gated delta rule with a decay per key channel (:func:`attnzoo.delta_rule` with
``log_decay [B, Hv, N, D]``). The layer, as in Kimi Linear (parameter names follow transformers'
``KimiLinearDeltaAttention`` so that a converter maps weights by name; its ``o_proj`` is ``out_proj``
here and its fused ``conv1d`` is split by rows into ``q_conv``, ``k_conv``, ``v_conv``)::

    q, k, v = silu(conv(x W_q)), silu(conv(x W_k)), silu(conv(x W_v))       # short causal convolutions
    q, k    = l2norm(q), l2norm(k)            # per head; x / sqrt(|x|^2 + qk_norm_eps)
    g_t     = -exp(A_log) * softplus(x_t W_fa W_fb + dt_bias)               # [Hv, D] per token, <= 0
    beta_t  = sigmoid(x_t W_b)                                              # [Hv]
    o       = delta_rule(q, k, v, beta, log_decay=g)                        # scale 1/sqrt(D)
    y       = out_proj(rmsnorm(o) * w_norm * sigmoid(x W_ga W_gb))          # gated RMSNorm per head

``W_fa [C, D]``, ``W_fb [D, Hv D]`` (``f_a_proj``, ``f_b_proj``) and ``W_ga, W_gb`` (``g_a_proj``,
``g_b_proj``) are low-rank (rank ``D``); ``A_log [Hv]`` and ``dt_bias [Hv D]`` take Mamba-2's
initialisation; the norm's scale ``o_norm.weight [D]`` is shared by the heads.

:meth:`KimiDeltaAttention.keep_in_float32` keeps ``dt_bias``, ``A_log`` and / or the short
convolutions in float32 whatever the module's dtype, through later casts too, as transformers keeps
them (``_keep_in_fp32_modules_strict``: Kimi Linear's ``dt_bias``, Ling's hybrids' and GLM-5-Next's
``dt_bias``, ``A_log`` and ``conv1d``); the decay is computed in float32 anyway, and a float32
convolution on half-precision inputs convolves and applies SiLU in float32, then rounds once (as
transformers' ``causal_conv1d_fn``). A float32 module is unchanged by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._devices import KeepsFloat32
from attnzoo._validate import check_positive_float, check_probability
from attnzoo.functional.recurrent.gla import MATMUL_SUB_CHUNK, SUB_CHUNK
from attnzoo.nn.deltanet import DeltaNet, init_decay_parameters, l2_normalize
from attnzoo.nn.recurrent import recurrent_cost, register_recurrent, wide
from attnzoo.nn.spec import Cost, CostShape, VariantConfig

__all__ = ["FLOAT32_GROUPS", "GatedRMSNorm", "KimiDeltaAttention"]

#: what :meth:`KimiDeltaAttention.keep_in_float32` can keep in float32 (``"conv"``: the three short
#: convolutions' weights and biases)
FLOAT32_GROUPS = ("dt_bias", "A_log", "conv")


class GatedRMSNorm(nn.Module):
    """``rmsnorm(o) * weight * sigmoid(gate)`` over the last dim (``weight [D]`` shared by the heads),
    computed in float32 (or float64) and returned in that dtype."""

    def __init__(self, head_dim: int, eps: float, factory: dict[str, Any]) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim, **factory))

    def forward(self, o: Tensor, gate: Tensor) -> Tensor:
        o = wide(o)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(o.dtype)
        return o * torch.sigmoid(gate.to(o.dtype))


class KimiDeltaAttention(KeepsFloat32, DeltaNet):
    """KDA: the delta rule with per-channel decays from a low-rank gate, Kimi Linear's layer.

    Args:
        dim: model width ``C``.
        num_heads: key heads ``H`` (``q, k [B, H, N, D]``).
        head_dim: ``D`` (default ``C // H``); also the rank of the gate projections.
        bias: biases in the q/k/v/output projections (Kimi Linear: none).
        conv_size: kernel of the short causal convolutions on q, k, v (0 = none; default 4).
        chunk_size: chunk of the kernel's chunked form.
        num_v_heads: value heads (default ``num_heads``; a multiple of it): grouped value heads, each with
            its own decay, ``beta`` and gate.
        allow_neg_eigval: ``beta`` in [0, 2] (see :class:`~attnzoo.nn.deltanet.DeltaNet`).
        norm_eps: epsilon of the gated RMSNorm (Kimi Linear's ``rms_norm_eps``).
        qk_norm_eps: an epsilon inside the L2 norm of ``q`` and ``k``: ``x / sqrt(|x|^2 + eps)``
            (Kimi Linear's checkpoints, as transformers and fla: ``1e-6``); ``0`` (default): the
            exact ``x / |x|``.
        device, dtype: of the parameters.

    Decode cache: :class:`~attnzoo.nn.recurrent.RecurrentCache`: the state ``[B, Hv, D, D]`` and the
    last ``conv_size - 1`` inputs of the three convolutions.

    ``float32_params``: the parameters :meth:`keep_in_float32` keeps in float32 (none by default).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, bias: bool = False,
                 conv_size: int = 4, chunk_size: int = 64, num_v_heads: int | None = None,
                 allow_neg_eigval: bool = False, norm_eps: float = 1e-6, *, qk_norm_eps: float = 0.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, num_heads, head_dim=head_dim, bias=bias, conv_size=conv_size, output_gate=False,
                         chunk_size=chunk_size, num_v_heads=num_v_heads, allow_neg_eigval=allow_neg_eigval,
                         device=device, dtype=dtype)
        check_probability(qk_norm_eps, "qk_norm_eps", "KimiDeltaAttention")
        check_positive_float(norm_eps, "norm_eps", "KimiDeltaAttention")
        self.qk_norm_eps = float(qk_norm_eps)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        d, v_inner = self.head_dim, self.num_v_heads * self.head_dim
        del self.norm  # the gated norm below replaces DeltaNet's per-head RMSNorm
        self.f_a_proj = nn.Linear(dim, d, bias=False, **fk)
        self.f_b_proj = nn.Linear(d, v_inner, bias=False, **fk)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, **fk))
        self.dt_bias = nn.Parameter(torch.empty(v_inner, **fk))
        init_decay_parameters(self.A_log, self.dt_bias)
        self.g_a_proj = nn.Linear(dim, d, bias=False, **fk)
        self.g_b_proj = nn.Linear(d, v_inner, bias=False, **fk)
        self.o_norm = GatedRMSNorm(d, norm_eps, fk)
        self.float32_params: tuple[str, ...] = ()

    def keep_in_float32(self, *groups: str) -> KimiDeltaAttention:
        """Keep ``groups`` (of :data:`FLOAT32_GROUPS`: ``"dt_bias"``, ``"A_log"``, ``"conv"``) in
        float32 from now on: cast to float32 now if 16-bit, and put back in float32 after every half
        cast (``.to``, ``.half()``, ``.bfloat16()``). Call it before loading weights, so that a
        float32 checkpoint's values load exactly. Returns ``self``."""
        for group in groups:
            if group not in FLOAT32_GROUPS:
                raise ValueError(f"{type(self).__name__}.keep_in_float32: groups must be among {FLOAT32_GROUPS}, "
                                 f"got {group!r}")
        convs = [f"{n}_conv" for n in ("q", "k", "v") if "conv" in groups and hasattr(self, f"{n}_conv")]
        names = [n for n in ("dt_bias", "A_log") if n in groups]
        names += [f"{c}.{n}" for c in convs for n, _ in self.get_submodule(c).named_parameters()]
        for name in names:
            p = self.get_parameter(name)
            if p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.float()
        self.float32_params = tuple(dict.fromkeys((*self.float32_params, *names)))
        return self

    def short_conv(self, name: str, t: Tensor, pad: Tensor | None, conv: Mapping[str, Tensor],
                   out: dict[str, Tensor], *, silu: bool = True, cu: Tensor | None = None) -> Tensor:
        """As the base class's; a float32 convolution (:meth:`keep_in_float32`) on half-precision
        ``t [B, N, Ch]`` convolves and applies SiLU in float32 and rounds once to ``t``'s dtype (the
        inputs kept for the cache stay in ``t``'s dtype)."""
        if (f"{name}_conv.weight" not in self.float32_params or t.dtype not in (torch.float16, torch.bfloat16)
                or self.get_parameter(f"{name}_conv.weight").dtype == t.dtype):
            return super().short_conv(name, t, pad, conv, out, silu=silu, cu=cu)
        y = super().short_conv(name, wide(t), pad, conv, out, silu=silu, cu=cu)
        out[name] = out[name].to(t.dtype)
        return y.to(t.dtype)

    def _l2(self, t: Tensor) -> Tensor:
        """``t / sqrt(|t|^2 + qk_norm_eps)`` over the head width (``F.normalize`` when 0)."""
        return l2_normalize(t, self.qk_norm_eps)

    def _log_decay(self, x: Tensor) -> Tensor:
        """``[B, Hv, N, D]``, ``<= 0``: ``-exp(A_log) * softplus(x W_fa W_fb + dt_bias)``."""
        f = self.heads(wide(self.f_b_proj(self.f_a_proj(x))) + wide(self.dt_bias))  # [B, Hv, N, D]
        return -wide(self.A_log).exp()[:, None, None] * F.softplus(f)

    def head_output(self, x: Tensor, o: Tensor) -> Tensor:
        """``out_proj(gated_rmsnorm(o, x W_ga W_gb))``: ``o [B, Hv, N, D] -> [B, N, C]``."""
        y = self.o_norm(o, self.heads(self.g_b_proj(self.g_a_proj(x))))  # [B, Hv, N, D]
        return self.out_proj(y.to(x.dtype).transpose(1, 2).flatten(2))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, "
                f"head_dim={self.head_dim}, conv_size={self.conv_size}, chunk_size={self.chunk_size}")


# --------------------------------------------------------------------------- variant spec
def _decay_sum_flops(c: int, d: int) -> int:
    """Per token and head, the matmuls that sum the per-channel log decays in a chunk of ``c`` tokens
    (``attnzoo.functional.recurrent.gla``): the prefix and suffix sums over the chunk (``2 c d`` each), those of
    every halving level over its halves (``2 (c' - sub) d`` in all, ``c'`` the chunk padded to
    ``sub 2^levels``) and, in the fast plan (chunks of at least two diagonal blocks), each diagonal
    block's midpoint sums and its two score matmuls (``6 sub d``)."""
    fast = c >= 2 * MATMUL_SUB_CHUNK
    sub = MATMUL_SUB_CHUNK if fast else SUB_CHUNK
    padded = sub
    while padded < c:
        padded *= 2
    return 4 * c * d + 2 * (padded - sub) * d + (6 * sub * d if fast else 0)


def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """Like Gated DeltaNet's, with the low-rank (rank ``D``) gate and output-gate projections instead of
    Gated DeltaNet's full output gate; the per-channel scores ``Q K^T`` and ``K K^T`` are computed by
    halving (``attnzoo.functional.recurrent.gla``), whose matmuls cover only the blocks below the diagonal."""
    inner, H, D = cfg.num_heads * cfg.head_dim, cfg.num_heads, cfg.head_dim
    in_width = 3 * inner + H + 2 * D  # q, k, v, beta and the two rank-D down projections
    est = recurrent_cost(cfg, shape, in_width=in_width, inner=inner, dk=D, dv=D, conv_channels=3 * inner,
                         conv_size=4, kernel="delta", extra_params=D + H + inner + 2 * D * inner)
    up = 2 * shape.batch * shape.seq_len * D * inner * 2  # f_b_proj and g_b_proj
    c = min(cfg.chunk_size or 64, shape.seq_len)
    halving = shape.batch * H * shape.seq_len * 2 * c * D  # Q K^T and K K^T by halving: the lower half only
    halving -= shape.batch * H * shape.seq_len * _decay_sum_flops(c, D)
    return replace(est, flops_projections=est.flops_projections + up, flops_backward=est.flops_backward + 2 * up,
                   flops_attention=est.flops_attention - halving, flops_useful=est.flops_useful - halving)


register_recurrent("kda", KimiDeltaAttention, _cost, "state S [D, D] per value head + conv inputs", order=25)
