"""Retention (Sun et al. 2023, "Retentive Network"): linear attention with a fixed decay per head.

Recurrence (the definition; q scaled by ``scale``)::

    S_t = gamma S_{t-1} + k_t v_t^T        # [Dk, Dv], gamma in (0, 1) per head
    o_t = q_t^T S_t

Parallel (quadratic) form: ``O = (Q K^T * D) V + (Q * gamma^t) S_0`` with the decay mask
``D[t, s] = gamma^(t - s)`` for ``s <= t``, 0 above. Chunked form: the same inside a chunk of ``C``
tokens, plus the state carried between chunks, ``S_next = gamma^C S + sum_s gamma^(C - s) k_s v_s^T``.

Retention is gated linear attention with the constant scalar log decay ``log(gamma)`` per token,
and runs on :func:`attnzoo.functional.recurrent.gla.run_gla` (decays in log space, exponents never positive).
RetNet's group norm, swish gate and xPos rotation belong to the module, not to this function.
"""

from __future__ import annotations

from torch import Tensor

from attnzoo.functional.recurrent._chunked_scan import (
    check_gate,
    check_recurrent_inputs,
    compute_dtype,
    finish,
    resolve_form,
)
from attnzoo.functional.recurrent.gla import run_gla

__all__ = ["retention"]


def retention(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, *, scale: float | None = None,
              initial_state: Tensor | None = None, return_state: bool = False, form: str = "auto",
              chunk_size: int | None = None, cu_seqlens: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Causal retention: ``S_t = gamma S_{t-1} + k_t v_t^T``, ``o_t = scale q_t^T S_t``.

    Args:
        q, k: ``[B, Hk, N, Dk]``; v: ``[B, Hv, N, Dv]`` (one dtype, one device), ``Hv`` a multiple of
            ``Hk`` (value head ``j`` reads key head ``j // (Hv // Hk)``).
        gamma: ``[Hv]`` decay per (value) head, in (0, 1) (RetNet: ``1 - 2**(-5 - arange(H))``).
        scale, initial_state, return_state, chunk_size, cu_seqlens: as in
            :func:`attnzoo.gated_linear_attention` (``scale`` multiplies q, default ``1/sqrt(Dk)``; states
            ``[B, Hv, Dk, Dv]``, or ``[S, Hv, Dk, Dv]`` for packed sequences; default zeros).
        form: ``"recurrent"``, ``"chunked"``, ``"quadratic"`` (``[N, N]`` decay mask) or ``"auto"``
            (recurrent for N = 1, quadratic for N <= chunk_size, chunked beyond).

    Returns:
        ``out [B, Hv, N, Dv]`` in q's dtype, or ``(out, state)`` with the state in float32 (float64 for
        float64 inputs).

    Raises:
        ValueError / TypeError naming the argument: shapes, dtypes, devices, head ratio, gamma outside
        (0, 1) (checked in eager mode), bad form, chunk_size or cu_seqlens.
    """
    fn = "retention"
    scale_f, chunk, bounds = check_recurrent_inputs(fn, q, k, v, scale, initial_state, return_state, form,
                                                    chunk_size, cu_seqlens)
    b, hv, n, _ = v.shape
    check_gate(fn, "gamma", gamma, [(hv,)], q.device, 0.0, 1.0, open_low=True, open_high=True)
    g = gamma.to(compute_dtype(q.dtype)).log()  # [Hv]
    out, state = run_gla(q, k, v, g[None, :, None].expand(b, hv, n), scale=scale_f, initial_state=initial_state,
                         form=resolve_form(form, n, chunk), chunk=chunk, bounds=bounds)
    return finish(out, state, q.dtype, return_state)
