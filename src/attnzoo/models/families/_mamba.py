"""The Mamba-2 mixer of the Hugging Face hybrid families (Bamba, Granite 4.0-H, Nemotron-H, pure
Mamba-2) as an attnzoo :class:`~attnzoo.nn.mamba2.Mamba2`.

transformers keeps one fused ``in_proj`` (rows ``[z | x | B | C | dt]``) and one depthwise
``conv1d`` over ``[x | B | C]``; attnzoo's mixer holds the same rows as separate projections
(``z_proj``, ``v_proj`` = x, ``k_proj`` = B, ``q_proj`` = C, ``dt_proj``) and convolutions
(``x_conv``, ``B_conv``, ``C_conv``), so the weight map is a split by rows. The gated RMSNorm
``norm(y * silu(z))`` per group of heads, ``A_log``, ``D`` and ``dt_bias`` map one to one.

Each family names the sizes with its own config keys: :class:`MambaKeys`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.mamba2 import GatedRMSNorm, Mamba2

__all__ = ["BAMBA_KEYS", "MambaKeys", "in_proj_widths", "mamba_factory", "put_mamba"]


@dataclass(frozen=True)
class MambaKeys:
    """The config keys of a family's Mamba-2 sizes. ``head_dim`` may hold ``"auto"``: the inner
    width over the heads, the inner width being the ``inner`` key where the family has one
    (Falcon-H1's ``mamba_d_ssm``) and set, else ``expand * hidden_size``."""

    heads: str
    head_dim: str
    state: str
    groups: str
    conv: str
    expand: str
    conv_bias: str
    proj_bias: str
    norm_eps: str
    activation: str = "hidden_act"
    inner: str | None = None


BAMBA_KEYS = MambaKeys("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv",
                       "mamba_expand", "mamba_conv_bias", "mamba_proj_bias", "rms_norm_eps")


def _head_dim(hf: HFConfig, keys: MambaKeys, heads: int) -> int:
    """``P``: the head width, given, or ``"auto"``: the inner width over ``heads`` (which must
    divide it). A given width is the checkpoint's to match (a wrong one is a shape mismatch
    naming the tensor when the weights load)."""
    if hf.raw(keys.head_dim, "auto") != "auto":
        return int(hf.req(keys.head_dim))
    inner = hf.get(keys.inner, None) if keys.inner else None
    inner = inner or hf.get(keys.expand, 2) * hf.req("hidden_size")
    if inner % heads:
        raise CheckpointFormatError(f"{hf.source}: {keys.heads} ({heads}) must divide the Mamba-2 inner width "
                                    f"({inner}) when {keys.head_dim} is 'auto'")
    return int(inner // heads)


def _number(value: Any) -> float:
    """A config number as JSON holds it: a number, ``"Infinity"``, or transformers' encoding of a
    non-finite float (``{"__float__": "Infinity"}``); ``nan`` for anything else."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _dt_limit_is_open(value: Any) -> bool:
    """``time_step_limit`` leaves ``dt = softplus(.) > 0`` unclamped: absent, or ``(<= 0, inf)``."""
    if value is None:
        return True
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return False
    lo, hi = _number(value[0]), _number(value[1])
    return lo <= 0 and hi == math.inf


def mamba_factory(hf: HFConfig, keys: MambaKeys, *, gate_norm: str = "after_gate", device: Any = None,
                  dtype: Any = None) -> Callable[[], Mamba2]:
    """A factory of one layer's :class:`Mamba2` from the config (``H`` heads of ``P`` channels,
    ``ngroups`` groups of ``state`` for ``B``/``C``, the convolution's kernel and bias, the gated
    norm's epsilon and place, ``gate_norm``). Refused by name: biased projections, a clamped
    ``time_step_limit``, a convolution activation other than SiLU."""
    heads = hf.req(keys.heads)
    if hf.get(keys.proj_bias, False, bool):
        raise hf.unsupported(f"{keys.proj_bias}=True")
    if not _dt_limit_is_open(hf.raw("time_step_limit")):
        raise hf.unsupported(f"time_step_limit={hf.raw('time_step_limit')!r} (only (0, inf): no clamp)")
    act = hf.get(keys.activation, "silu", str)
    if act not in ("silu", "swish"):
        raise hf.unsupported(f"{keys.activation}={act!r} in the Mamba-2 mixer (supported: 'silu')")
    sizes = {"head_dim": _head_dim(hf, keys, heads), "expand": 1, "state_size": hf.req(keys.state),
             "ngroups": hf.get(keys.groups, 1), "conv_size": hf.get(keys.conv, 4)}
    return functools.partial(_mamba2, hf.req("hidden_size"), heads, sizes, place=gate_norm,
                             eps=hf.get(keys.norm_eps, 1e-5, float), conv_bias=hf.get(keys.conv_bias, True, bool),
                             device=device, dtype=dtype)


def _mamba2(dim: int, heads: int, sizes: dict[str, int], *, place: str, eps: float, conv_bias: bool,
            device: Any, dtype: Any) -> Mamba2:
    """A :class:`Mamba2` with the checkpoint's parts: its gated norm (``place``, ``eps``) and, where
    the checkpoint has none, convolutions without biases."""
    mixer = Mamba2(dim, heads, **sizes, device=device, dtype=dtype)
    groups = mixer.ngroups
    mixer.norm = GatedRMSNorm(groups, heads * mixer.inner_head_dim // groups, place=place, eps=eps,
                              device=device, dtype=dtype)
    if not conv_bias:
        for name in mixer.conv_channels:
            getattr(mixer, f"{name}_conv").bias = None
    return mixer


def in_proj_widths(hf: HFConfig, keys: MambaKeys) -> tuple[int, int, int, int, int]:
    """The widths of the ``[z | x | B | C | dt]`` row blocks of transformers' fused ``in_proj``."""
    heads = hf.req(keys.heads)
    inner, gs = heads * _head_dim(hf, keys, heads), hf.get(keys.groups, 1) * hf.req(keys.state)
    return inner, inner, gs, gs, heads


def _rows(lo: int, hi: int) -> Callable[[Tensor], Tensor]:
    return lambda t: t[lo:hi]


def put_mamba(plan: Plan, ours: str, theirs: str, mixer: Mamba2) -> None:
    """Plan ``mixer`` (at ``ours``, e.g. ``"blocks.0.attn."``) from transformers' mixer at ``theirs``
    (``in_proj``, ``conv1d``, ``A_log``, ``D``, ``dt_bias``, ``norm`` unless the mixer has none,
    ``out_proj``)."""
    inner, gs, heads = mixer.num_heads * mixer.inner_head_dim, mixer.ngroups * mixer.state_size, mixer.num_heads
    starts = {"z_proj": 0, "v_proj": inner, "k_proj": 2 * inner, "q_proj": 2 * inner + gs, "dt_proj": 2 * inner + 2 * gs}
    widths = {"z_proj": inner, "v_proj": inner, "k_proj": gs, "q_proj": gs, "dt_proj": heads}
    for name, lo in starts.items():
        plan.put(f"{ours}{name}.weight", f"{theirs}in_proj.weight", _rows(lo, lo + widths[name]))
    lo = 0
    for name, width in mixer.conv_channels.items():  # x, B, C: the rows of the fused convolution
        plan.put(f"{ours}{name}_conv.weight", f"{theirs}conv1d.weight", _rows(lo, lo + width))
        if getattr(mixer, f"{name}_conv").bias is not None:
            plan.put(f"{ours}{name}_conv.bias", f"{theirs}conv1d.bias", _rows(lo, lo + width))
        lo += width
    for name in ("A_log", "D", "dt_bias"):
        plan.put(f"{ours}{name}", f"{theirs}{name}")
    if mixer.norm.weight is not None:
        plan.put(f"{ours}norm.weight", f"{theirs}norm.weight", lambda t: t.reshape(mixer.ngroups, -1))
    plan.put(f"{ours}out_proj.weight", f"{theirs}out_proj.weight")
