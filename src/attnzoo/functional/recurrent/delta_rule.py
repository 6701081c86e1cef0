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

from collections.abc import Callable

import torch
from torch import Tensor

from attnzoo._validate import check_bool
from attnzoo.functional.recurrent._chunked_scan import (
    check_gate,
    check_recurrent_inputs,
    chunked_scan,
    compute_dtype,
    finish,
    log_segsum,
    resolve_form,
    run_family,
    suffix_sum,
    token_loop,
    token_prefix_sum,
    token_suffix_sum,
)
from attnzoo.functional.recurrent.gla import SUB_CHUNK, chunk_scores

__all__ = ["delta_rule"]


def _parts(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chunk parts ``(O_intra, Q', A, R)`` for chunks ``[..., C, D]``, beta ``[..., C]``, g ``[..., C]``
    (one decay per token) or ``[..., C, Dk]`` (per key channel, KDA). q and k may broadcast against
    v and the gates (grouped value heads)."""
    c, dk = k.shape[-2:]
    dv = v.shape[-1]
    eye_c = torch.eye(c, dtype=k.dtype, device=k.device)
    if g.dim() == k.dim():  # per key channel: the scores are GLA's vector-decay scores
        b = token_prefix_sum(g)  # [..., C, Dk]: log decay from the chunk start, <= 0
        gam = b.exp()
        shape = torch.broadcast_shapes(k.shape, g.shape)
        qx, kx = q.expand(shape), k.expand(shape)  # one chunk group's tiles, not a full-length copy
        # [2, ..., C, C]: sum_d x_td k_id exp(b_td - b_id), i <= t, for x = k and x = q (the decays computed once)
        kk, p = chunk_scores(torch.stack([kx, qx]), kx, g, SUB_CHUNK).unbind(0)
        lower = (beta.unsqueeze(-1) * kk).tril(-1)  # L
        k_gam = k * gam  # [..., C, Dk]: K Gamma
        k_hat = k * token_suffix_sum(g).exp()  # decayed to the chunk end
        a_diag = torch.diag_embed(b[..., -1, :].exp())  # [..., Dk, Dk]
    else:
        b = g.cumsum(dim=-1)  # [..., C]
        gam = b.unsqueeze(-1).exp()  # [..., C, 1]
        decay = log_segsum(g).exp_()  # [..., C, C]: exp(b_t - b_i), i <= t
        lower = (beta.unsqueeze(-1) * torch.matmul(k, k.transpose(-1, -2)) * decay).tril(-1)  # L
        p = torch.matmul(q, k.transpose(-1, -2)) * decay  # [..., C, C]
        k_gam = k * gam
        k_hat = k * suffix_sum(g, -1).exp().unsqueeze(-1)  # [..., C, Dk]
        a_diag = gam[..., -1, :, None] * torch.eye(dk, dtype=k.dtype, device=k.device)  # [..., Dk, Dk]
    bv = beta.unsqueeze(-1) * v  # [..., C, Dv]
    bk = beta.unsqueeze(-1) * k_gam
    rhs = torch.cat([bv, bk.expand(*bv.shape[:-1], dk)], dim=-1)  # [..., C, Dv + Dk]
    x = torch.linalg.solve_triangular(eye_c + lower, rhs, upper=False, unitriangular=True)
    u_tilde, w = x.split([dv, dk], dim=-1)  # [..., C, Dv], [..., C, Dk] (backward: one cat, no zero fill)
    o_intra = torch.matmul(p, u_tilde)
    q_state = q * gam - torch.matmul(p, w)  # [..., C, Dk]
    a = a_diag - torch.matmul(k_hat.transpose(-1, -2), w)  # [..., Dk, Dk]
    r = torch.matmul(k_hat.transpose(-1, -2), u_tilde)  # [..., Dk, Dv]
    return o_intra, q_state, a, r


def _recurrent(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """The definition, one token at a time (tokens on dim -2; q, k may broadcast against v)."""
    outs = []
    per_channel = g.dim() == v.dim()
    for t in range(v.shape[-2]):
        kt = k[..., t, :]  # [..., Dk]
        decay = g[..., t, :].exp().unsqueeze(-1) if per_channel else g[..., t].exp()[..., None, None]
        s = decay * s  # S'_{t-1} = A_t S_{t-1}
        err = v[..., t, :] - torch.matmul(kt.unsqueeze(-2), s).squeeze(-2)  # v_t - S'^T k_t  [..., Dv]
        s = s + beta[..., t, None, None] * kt.unsqueeze(-1) * err.unsqueeze(-2)
        outs.append(torch.matmul(q[..., t, :].unsqueeze(-2), s).squeeze(-2))  # [..., Dv]
    return torch.stack(outs, dim=-2), s


def _recurrent_shapes(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    return s.new_empty(*s.shape[:-2], v.shape[-2], v.shape[-1]), s.new_empty(s.shape)


_recurrent_op = token_loop("delta_rule_recurrent", _recurrent, _recurrent_shapes)


def _forms(scale: float) -> dict[str, Callable[..., tuple[Tensor, Tensor]]]:
    """The delta rule's forms for :func:`run_family` (inputs in any float dtype, ``s0`` in the compute dtype)."""

    def recurrent(q: Tensor, k: Tensor, v: Tensor, gates: list[Tensor], s0: Tensor, chunk: int,
                  segments: object) -> tuple[Tensor, Tensor]:
        cdt = s0.dtype
        return _recurrent_op(q.to(cdt) * scale, k.to(cdt), v.to(cdt), *(t.to(cdt) for t in gates), s0)

    def chunked(q: Tensor, k: Tensor, v: Tensor, gates: list[Tensor], s0: Tensor, chunk: int,
                segments: list[tuple[int, int]] | None) -> tuple[Tensor, Tensor]:
        c, dk, dv = min(chunk, v.shape[-2]), k.shape[-1], v.shape[-1]
        # the two vector-decay score calls' temporaries: per halving level O(C Dk), diagonal blocks [sub, sub, Dk]
        vec = 2 * c * dk * (3 * min(SUB_CHUNK, c) + 6) if gates[1].dim() == v.dim() else 0
        per_chunk = v[..., 0, 0].numel() * s0.element_size() * (6 * c * c + 6 * c * (dk + dv)
                                                                + 3 * dk * (dk + dv) + vec)
        return chunked_scan(_parts, q, k, v, gates, s0, c, per_chunk, scale, segments)

    def quadratic(q: Tensor, k: Tensor, v: Tensor, gates: list[Tensor], s0: Tensor, chunk: int,
                  segments: object) -> tuple[Tensor, Tensor]:
        return chunked(q, k, v, gates, s0, v.shape[-2], None)

    return {"recurrent": recurrent, "chunked": chunked, "quadratic": quadratic}


def delta_rule(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, log_decay: Tensor | None = None,
               scale: float | None = None, initial_state: Tensor | None = None, return_state: bool = False,
               form: str = "auto", chunk_size: int | None = None, cu_seqlens: Tensor | None = None,
               allow_neg_eigval: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Causal (gated) delta rule, per-channel decays (KDA) included::

        S'_{t-1} = A_t S_{t-1},  A_t = diag(exp(log_decay_t)) (a_t I for one decay per head)
        S_t = S'_{t-1} + beta_t k_t (v_t - S'_{t-1}^T k_t)^T,   o_t = scale * S_t^T q_t

    Args:
        q, k: ``[B, Hk, N, Dk]``; v: ``[B, Hv, N, Dv]`` (one dtype, one device), ``Hv`` a multiple of
            ``Hk`` (grouped value heads: value head ``j`` reads key head ``j // (Hv // Hk)``, q and k
            are never expanded). k is used as given (normalise it yourself; the modules
            L2-normalise q and k).
        beta: ``[B, Hv, N]`` write strength in [0, 1] ([0, 2] with ``allow_neg_eigval``).
        log_decay: ``None`` (DeltaNet, ``A_t = I``), ``[B, Hv, N]`` (one decay per head: Gated DeltaNet)
            or ``[B, Hv, N, Dk]`` (a decay per key channel: Kimi Delta Attention), finite, ``<= 0``.
        scale, initial_state, return_state, chunk_size: as in :func:`attnzoo.gated_linear_attention`
            (``scale`` multiplies q, default ``1/sqrt(Dk)``; states ``[B, Hv, Dk, Dv]``, default zeros).
        form: ``"recurrent"``, ``"chunked"`` (WY representation), ``"quadratic"`` (the chunked form with
            one chunk of N tokens: an ``N x N`` triangular solve) or ``"auto"`` (recurrent for N = 1,
            quadratic for N <= chunk_size with one decay per head, chunked otherwise).
        cu_seqlens: packed sequences, int32 ``[S+1]`` with ``B == 1``: the tokens ``[cu[i], cu[i+1])``
            form sequence i, run independently from ``initial_state[i]`` (``[S, Hv, Dk, Dv]``, default
            zeros); the returned state is ``[S, Hv, Dk, Dv]``. Empty sequences are allowed.
        allow_neg_eigval: accept ``beta`` in [0, 2]: the transition ``I - beta_t k_t k_t^T`` (unit k) then
            has the eigenvalue ``1 - beta_t`` in [-1, 1] (Grazzi et al. 2025; fla's ``allow_neg_eigval``).

    Returns:
        ``out [B, Hv, N, Dv]`` in q's dtype, or ``(out, state)`` with the state in float32 (float64 for
        float64 inputs). Half inputs compute in float32.

    Raises:
        ValueError / TypeError naming the argument: shapes, dtypes, devices, head ratio, beta outside
        [0, 1] or log_decay > 0 (checked in eager mode), bad form, chunk_size or cu_seqlens.
    """
    fn = "delta_rule"
    scale_f, chunk, bounds = check_recurrent_inputs(fn, q, k, v, scale, initial_state, return_state, form,
                                                    chunk_size, cu_seqlens)
    b, hv, n, dv = v.shape
    dk = q.shape[-1]
    check_bool(allow_neg_eigval, "allow_neg_eigval", fn)
    check_gate(fn, "beta", beta, [(b, hv, n)], q.device, 0.0, 2.0 if allow_neg_eigval else 1.0)
    if log_decay is not None:
        check_gate(fn, "log_decay", log_decay, [(b, hv, n), (b, hv, n, dk)], q.device, float("-inf"), 0.0,
                   open_low=True)
    cdt = compute_dtype(q.dtype)
    g = beta.new_zeros((), dtype=cdt).expand(b, hv, n) if log_decay is None else log_decay
    states = b if bounds is None else len(bounds) - 1
    s0 = q.new_zeros(states, hv, dk, dv, dtype=cdt) if initial_state is None else initial_state.to(cdt)
    resolved = resolve_form(form, n, chunk)
    if form == "auto" and resolved == "quadratic" and g.dim() == 4:
        resolved = "chunked"
    out, state = run_family(_forms(scale_f), q, k, v, [beta, g], s0, form=resolved, chunk=chunk, bounds=bounds)
    return finish(out, state, q.dtype, return_state)
