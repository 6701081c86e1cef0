r"""Learnable attention sinks (gpt-oss semantics) on top of any softmax backend.

Each query head ``h`` owns one sink logit :math:`z_h`. A query row's softmax runs over its visible
scores **and** the sink, and the sink's column is then dropped (it carries no value), so a row can
put probability mass "nowhere":

.. math::

    p_{ij} = \frac{e^{s_{ij}}}{e^{z_h} + \sum_{j' \text{ visible}} e^{s_{ij'}}}, \qquad
    o_i = \sum_j p_{ij} v_j .

Given a backend's exact ``(out, lse)`` over the visible keys, the sink is an exact correction:

.. math::

    \text{lse}' = \log(e^{\text{lse}} + e^{z_h}), \qquad
    \text{out}' = \text{out} \cdot e^{\text{lse} - \text{lse}'} .

It is differentiable for ``sinks`` (:math:`\partial \text{lse}' / \partial z_h = e^{z_h - \text{lse}'}`)
and for q, k, v as long as the backend's LSE carries its gradient
(:math:`\partial \text{lse} / \partial s_{ij} = p_{ij}`): ``reference`` (autograd) and ``tiled``
(its backward folds the LSE gradient into :math:`\delta`) do. ``sdpa`` returns no LSE: there the
sink becomes one extra key with zero key and value vectors and the sink logit as its additive
bias, which is the same softmax. A row with no visible key returns zeros and LSE :math:`z_h`.
Semantics drawn for small N: ``docs/softmax-frontier.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo.functional.backends.sdpa import dense_mask
from attnzoo.functional.core._edge import guard_nonfinite
from attnzoo.functional.core._request import AttnRequest

__all__ = ["apply_sinks", "check_sinks", "sink_attention"]

#: Backends whose returned LSE carries a gradient to q and k (needed for the correction's backward).
#: flash-attn's LSE has none; FlexAttention has no CPU backward, so its LSE gradient is unverified.
LSE_GRADIENT_BACKENDS = frozenset({"reference", "tiled"})
#: What the sdpa form (one extra zero key) cannot do.
_SDPA_UNSUPPORTED = frozenset({"return_lse", "return_weights", "softcap", "float64", "score_mod"})


def check_sinks(sinks: object, hq: int, device: torch.device) -> Tensor:
    """``sinks`` as a floating ``[Hq]`` tensor on ``device`` with no NaN/inf (values checked in eager mode)."""
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be a float tensor [Hq], got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor [Hq], got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must have shape [Hq] = [{hq}], got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}")
    if not tracing() and not bool(torch.isfinite(sinks).all()):
        raise ValueError(f"sinks must be finite logits, got {sinks.detach().cpu().tolist()}")
    return sinks


def apply_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Fold per-head sink logits into an attention result (plain torch ops: differentiable).

    Args:
        out: ``[B, Hq, Nq, Dv]`` normalised over the visible keys (zeros for empty rows).
        lse: ``[B, Hq, Nq]`` log-sum-exp of the visible scores (``-inf`` for empty rows).
        sinks: ``[Hq]`` finite logits.

    Returns:
        ``(out' [B, Hq, Nq, Dv], lse' [B, Hq, Nq], w [B, Hq, Nq, 1])`` with
        ``lse' = logaddexp(lse, sink)``, ``w = exp(lse - lse')`` (the mass left on real keys)
        and ``out' = w * out`` in ``out``'s dtype; ``lse'`` keeps ``lse``'s dtype.
    """
    z = sinks.to(lse.dtype).view(1, -1, 1)  # [1, Hq, 1]
    new_lse = torch.logaddexp(lse, z)  # finite: the sink is always "visible"
    w = torch.exp(lse - new_lse).unsqueeze(-1)  # [B, Hq, Nq, 1]; 0 for rows with no visible key
    return (out.to(w.dtype) * w).to(out.dtype), new_lse, w


def _sdpa_with_sinks(r: AttnRequest, sinks: Tensor) -> Tensor:
    """Sinks on torch SDPA: one extra key (zero key and value) whose additive bias is the sink logit."""
    missing = r.features() & _SDPA_UNSUPPORTED
    if missing:
        raise ValueError(f"backend 'sdpa' does not support: {', '.join(sorted(missing))} "
                         f"(use backend='auto' or 'reference')")
    B, Hq, Nq, _ = r.q.shape
    m = dense_mask(r)  # bool or float [B|1, Hq|1, Nq, Nk], or None
    if m is None:
        bias = r.q.new_zeros(1, 1, Nq, r.nk)
    elif m.dtype == torch.bool:
        bias = torch.zeros(m.shape, dtype=r.q.dtype, device=r.q.device).masked_fill_(~m, float("-inf"))
    else:
        bias = m.to(r.q.dtype)
    bias = bias.expand(bias.shape[0], Hq, Nq, r.nk)
    sink_col = sinks.to(r.q.dtype).view(1, Hq, 1, 1).expand(bias.shape[0], Hq, Nq, 1)
    attn_mask = torch.cat([bias, sink_col], dim=-1)  # [B|1, Hq, Nq, Nk + 1]
    k_aug = torch.cat([r.k, r.k.new_zeros(B, r.hkv, 1, r.k.shape[-1])], dim=2)  # [B, Hkv, Nk + 1, D]
    v_aug = torch.cat([r.v, r.v.new_zeros(B, r.hkv, 1, r.v.shape[-1])], dim=2)  # [B, Hkv, Nk + 1, Dv]
    return F.scaled_dot_product_attention(r.q, k_aug, v_aug, attn_mask=attn_mask, dropout_p=r.dropout_p,
                                          scale=r.scale, enable_gqa=r.group > 1)


def _needs_grad(r: AttnRequest) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (r.q, r.k, r.v))


def sink_attention(
    r: AttnRequest,
    sinks: object,
    backend: str,
    choose: Callable[[AttnRequest], str],
    run: Callable[[AttnRequest, str], Tensor | tuple[Tensor, ...]],
) -> Tensor | tuple[Tensor, ...]:
    """Run request ``r`` with sink logits (what ``attention(..., sinks=...)`` calls).

    ``choose`` is the ``auto`` policy and ``run`` runs a request on a named backend (both passed
    in by the dispatcher, so this module does not import it). ``auto`` picks the backend for the
    request plus an LSE; when q/k/v need gradients it keeps to a backend whose LSE carries one
    (``reference`` or ``tiled``), or ``sdpa`` for dropout. A named backend that cannot give a
    correct result raises ``ValueError`` naming the reason.
    """
    z = check_sinks(sinks, r.hq, r.q.device)
    # hidden non-finite keys/values never reach a row (the sdpa form adds the mask to the scores)
    return guard_nonfinite(r, lambda clean: _sink_attention(clean, z, backend, choose, run))


def _sink_attention(r: AttnRequest, z: Tensor, backend: str, choose: Callable[[AttnRequest], str],
                    run: Callable[[AttnRequest, str], Tensor | tuple[Tensor, ...]]) -> Tensor | tuple[Tensor, ...]:
    """:func:`sink_attention` once the sink logits ``z`` are checked."""
    with_lse = dataclasses.replace(r, return_lse=True)
    if backend == "auto":
        name = choose(with_lse)
        if name not in LSE_GRADIENT_BACKENDS and name != "sdpa" and _needs_grad(r):
            name = "tiled"
    else:
        name = backend
    if name == "sdpa":
        return _sdpa_with_sinks(r, z)
    if name not in LSE_GRADIENT_BACKENDS and _needs_grad(r):
        raise ValueError(f"backend {name!r} does not support: sinks with gradients (its LSE carries no "
                         f"gradient; use backend='auto', 'tiled', 'reference' or 'sdpa')")
    res = run(with_lse, name)
    assert isinstance(res, tuple)
    out, lse, w = apply_sinks(res[0], res[1], z)
    extras: list[Tensor] = [lse] if r.return_lse else []
    if r.return_weights:
        extras.append(res[2] * w.to(res[2].dtype))
    return (out, *extras) if extras else out
