"""The delta rule: DeltaNet (Schlag et al. 2021; Yang et al. 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length") and Gated DeltaNet (Yang et al. 2025).

Recurrence (the definition; ``a_t = exp(log_decay_t)``, 1 without decay; q scaled by ``scale``)::

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T     # [Dk, Dv]
        = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = q_t^T S_t

Chunked form (the WY / UT representation). Inside a chunk starting from state ``S``, with
``b_t = log a_1 + ... + log a_t`` and ``gamma_t = exp(b_t)``, write
``S_t = gamma_t S + sum_{i <= t} exp(b_t - b_i) k_i u_i^T``. Putting this in the recurrence gives
the pseudo-values ``u`` by one unit-lower-triangular solve::

    (I + L) U = diag(beta) V - diag(beta gamma) K S,   L[t, i] = beta_t exp(b_t - b_i) k_t . k_i  (i < t)
    U = U~ - W S,   [U~ | W] = (I + L)^{-1} [diag(beta) V | diag(beta gamma) K]

and then, with ``P = (Q K^T) * exp(b_t - b_i)`` (``i <= t``) and ``K^ = K * exp(b_C - b)``::

    O      = P U + diag(gamma) Q S      = P U~ + (diag(gamma) Q - P W) S
    S_next = gamma_C S + K^^T U         = (gamma_C I - K^^T W) S + K^^T U~

so each chunk is affine in ``S`` (``_chunked_scan``). The quadratic form is one chunk of N tokens
(an ``N x N`` triangular solve); the recurrent form is the loop above. No normalisation of k here
(the modules L2-normalise q and k; with ``|k| <= 1`` and ``beta`` in [0, 1] the state stays bounded).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo.functional._chunked_scan import (
    check_gate,
    check_recurrent_inputs,
    chunked_scan,
    compute_dtype,
    finish,
    log_segsum,
    resolve_form,
    suffix_sum,
    token_loop,
)

__all__ = ["delta_rule"]


def _parts(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chunk parts ``(O_intra, Q', A, R)`` for chunks ``[..., C, D]``, beta and g ``[..., C]``."""
    c, dk = k.shape[-2:]
    dv = v.shape[-1]
    b = g.cumsum(dim=-1)  # [..., C]
    gam = b.exp()
    decay = log_segsum(g).exp_()  # [..., C, C]: exp(b_t - b_i), i <= t
    lower = (beta.unsqueeze(-1) * torch.matmul(k, k.transpose(-1, -2)) * decay).tril(-1)  # L
    eye_c = torch.eye(c, dtype=k.dtype, device=k.device)
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * gam).unsqueeze(-1) * k], dim=-1)  # [..., C, Dv + Dk]
    x = torch.linalg.solve_triangular(eye_c + lower, rhs, upper=False, unitriangular=True)
    u_tilde, w = x[..., :dv], x[..., dv:]  # [..., C, Dv], [..., C, Dk]
    p = torch.matmul(q, k.transpose(-1, -2)) * decay  # [..., C, C]
    o_intra = torch.matmul(p, u_tilde)
    q_state = gam.unsqueeze(-1) * q - torch.matmul(p, w)  # [..., C, Dk]
    k_hat = k * suffix_sum(g, -1).exp().unsqueeze(-1)  # [..., C, Dk]: decayed to the chunk end
    eye_k = torch.eye(dk, dtype=k.dtype, device=k.device)
    a = gam[..., -1, None, None] * eye_k - torch.matmul(k_hat.transpose(-1, -2), w)  # [..., Dk, Dk]
    r = torch.matmul(k_hat.transpose(-1, -2), u_tilde)  # [..., Dk, Dv]
    return o_intra, q_state, a, r


def _recurrent(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """The definition, one token at a time."""
    outs = []
    for t in range(q.shape[2]):
        kt = k[:, :, t]  # [B, H, Dk]
        s = g[:, :, t].exp()[..., None, None] * s  # a_t S_{t-1}
        err = v[:, :, t] - torch.matmul(kt.unsqueeze(-2), s).squeeze(-2)  # v_t - a_t S^T k_t  [B, H, Dv]
        s = s + beta[:, :, t, None, None] * kt.unsqueeze(-1) * err.unsqueeze(-2)
        outs.append(torch.matmul(q[:, :, t].unsqueeze(-2), s).squeeze(-2))  # [B, H, Dv]
    return torch.stack(outs, dim=2), s


def _recurrent_shapes(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    return s.new_empty(*q.shape[:3], v.shape[-1]), s.new_empty(s.shape)


_recurrent_op = token_loop("delta_rule_recurrent", _recurrent, _recurrent_shapes)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, log_decay: Tensor | None = None,
               scale: float | None = None, initial_state: Tensor | None = None, return_state: bool = False,
               form: str = "auto", chunk_size: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Causal (gated) delta rule: ``S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T``, ``o_t = scale q_t^T S_t``.

    Args:
        q, k: ``[B, H, N, Dk]``; v: ``[B, H, N, Dv]`` (one dtype, one device). k is used as given
            (normalise it yourself; the modules L2-normalise q and k).
        beta: ``[B, H, N]`` write strength in [0, 1].
        log_decay: ``None`` (DeltaNet, ``a_t = 1``) or ``[B, H, N]`` finite, ``<= 0``: ``a_t = exp(log_decay_t)``
            (Gated DeltaNet).
        scale, initial_state, return_state, chunk_size: as in :func:`attnzoo.gated_linear_attention`
            (``scale`` multiplies q, default ``1/sqrt(Dk)``; states ``[B, H, Dk, Dv]``, default zeros).
        form: ``"recurrent"``, ``"chunked"`` (WY representation), ``"quadratic"`` (the chunked form with
            one chunk of N tokens: an ``N x N`` triangular solve) or ``"auto"`` (recurrent for N = 1,
            quadratic for N <= chunk_size, chunked beyond).

    Returns:
        ``out [B, H, N, Dv]`` in q's dtype, or ``(out, state)`` with the state in float32 (float64 for
        float64 inputs).

    Raises:
        ValueError / TypeError naming the argument: shapes, dtypes, devices, beta outside [0, 1] or
        log_decay > 0 (checked in eager mode), bad form or chunk_size.
    """
    fn = "delta_rule"
    scale_f, chunk = check_recurrent_inputs(fn, q, k, v, scale, initial_state, return_state, form, chunk_size)
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    check_gate(fn, "beta", beta, [(b, h, n)], q.device, 0.0, 1.0)
    if log_decay is not None:
        check_gate(fn, "log_decay", log_decay, [(b, h, n)], q.device, float("-inf"), 0.0, open_low=True)
    cdt = compute_dtype(q.dtype)
    g = beta.new_zeros((), dtype=cdt).expand(b, h, n) if log_decay is None else log_decay
    s0 = q.new_zeros(b, h, dk, dv, dtype=cdt) if initial_state is None else initial_state.to(cdt)
    form = resolve_form(form, n, chunk)
    if form == "recurrent":
        out, state = _recurrent_op(q.to(cdt) * scale_f, k.to(cdt), v.to(cdt), beta.to(cdt), g.to(cdt), s0)
    else:
        c = n if form == "quadratic" else min(chunk, n)
        per_chunk = b * h * s0.element_size() * (6 * c * c + 6 * c * (dk + dv) + 3 * dk * (dk + dv))
        out, state = chunked_scan(_parts, q, k, v, [beta, g], s0, c, per_chunk, scale_f)
    return finish(out, state, q.dtype, return_state)
