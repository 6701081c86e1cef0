"""Gated DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via
Householder Products"): ``n_h`` delta-rule steps per token.

Recurrence (the definition; ``a_t = exp(log_decay_t)``, 1 without decay; q scaled by ``scale``)::

    S = a_t S_{t-1}
    for j in 1 .. n_h:   S = S + beta_{t,j} k_{t,j} (v_{t,j} - S^T k_{t,j})^T
    S_t = S,   o_t = q_t^T S_t

so the transition of a token is ``a_t prod_j (I - beta_{t,j} k_{t,j} k_{t,j}^T)``, a product of ``n_h``
generalised Householder matrices (rank ``n_h`` plus identity). Layout as in fla's
``gated_delta_product``: the ``n_h`` keys, values and betas of token t sit at positions
``t n_h + j`` of a stream ``n_h`` times longer than q.

Computed by :func:`attnzoo.delta_rule` on that stream ("micro-tokens"): micro-token ``(t, j)`` has
the log decay ``log a_t`` for ``j = 0`` and 0 otherwise, and the query ``q_t`` for ``j = n_h - 1`` and
zero otherwise (whose outputs are dropped). Every form of the delta rule (chunked WY included),
grouped value heads and packed sequences carry over exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo._validate import check_int
from attnzoo.functional.recurrent.delta_rule import delta_rule

__all__ = ["delta_product"]


def delta_product(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, num_householder: int,
                  log_decay: Tensor | None = None, scale: float | None = None,
                  initial_state: Tensor | None = None, return_state: bool = False, form: str = "auto",
                  chunk_size: int | None = None, cu_seqlens: Tensor | None = None,
                  allow_neg_eigval: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Causal (gated) DeltaProduct: ``n_h = num_householder`` delta steps per token (module docstring).

    Args:
        q: ``[B, Hk, N, Dk]``; k: ``[B, Hk, N n_h, Dk]``; v: ``[B, Hv, N n_h, Dv]`` (token t's j-th key at
            ``t n_h + j``), ``Hv`` a multiple of ``Hk``.
        beta: ``[B, Hv, N n_h]`` in [0, 1] ([0, 2] with ``allow_neg_eigval``).
        num_householder: ``n_h >= 1`` (1 is the gated delta rule).
        log_decay: ``None`` or ``[B, Hv, N]`` (one decay per token, applied before its steps), ``<= 0``.
        scale, initial_state, return_state, form, chunk_size, allow_neg_eigval: as in
            :func:`attnzoo.delta_rule` (states ``[B, Hv, Dk, Dv]``).
        cu_seqlens: packed sequences over the N tokens of q (int32 ``[S+1]``, ``B == 1``).

    Returns:
        ``out [B, Hv, N, Dv]`` in q's dtype, or ``(out, state)``.

    Raises:
        ValueError / TypeError naming the argument (shapes against ``num_householder``, and everything
        :func:`attnzoo.delta_rule` checks).
    """
    fn = "delta_product"
    nh = check_int(num_householder, "num_householder", owner=fn)
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise TypeError(f"{fn}: q must be a tensor [B, Hk, N, Dk], got {getattr(q, 'shape', type(q).__name__)}")
    b, hk, n, dk = q.shape
    for name, t, want in (("k", k, n * nh), ("v", v, n * nh)):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[2] != want:
            raise ValueError(f"{fn}: {name} must be [B, H, N * num_householder = {want}, D], got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    g = None
    if log_decay is not None:
        hv = v.shape[1]
        if not isinstance(log_decay, Tensor) or tuple(log_decay.shape) != (b, hv, n):
            raise ValueError(f"{fn}: log_decay must be [B, Hv, N] = {[b, hv, n]} (one decay per token), got "
                             f"{tuple(log_decay.shape) if isinstance(log_decay, Tensor) else type(log_decay).__name__}")
        g = torch.cat([log_decay.unsqueeze(-1), log_decay.new_zeros(b, hv, n, nh - 1)], dim=-1).flatten(2)
    q_micro = torch.cat([q.new_zeros(b, hk, n, nh - 1, dk), q.unsqueeze(3)], dim=3).flatten(2, 3)  # [B, Hk, N n_h, Dk]
    cu = None if cu_seqlens is None else cu_seqlens * nh if isinstance(cu_seqlens, Tensor) else cu_seqlens
    res = delta_rule(q_micro, k, v, beta, log_decay=g, scale=dk ** -0.5 if scale is None else scale,
                     initial_state=initial_state, return_state=True, form=form, chunk_size=chunk_size,
                     cu_seqlens=cu, allow_neg_eigval=allow_neg_eigval)
    out, state = res  # type: ignore[misc]
    out = out.unflatten(2, (n, nh))[:, :, :, -1]  # [B, Hv, N, Dv]: after each token's last step
    return (out, state) if return_state else out
