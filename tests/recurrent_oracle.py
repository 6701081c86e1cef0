"""Float64 token loops written from the recurrences (docs/recurrent.md), independent of the library.

One head, one token at a time, plain Python over heads and sequences: the slowest and most literal
form of each rule. Grouped value heads: value head ``j`` reads key head ``j // (Hv // Hk)``.
Packed sequences: each sequence ``[cu[i], cu[i+1])`` runs alone from ``s0[i]``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _step(kind: str, s: Tensor, q: Tensor, k: Tensor, v: Tensor, gate: Tensor, beta: Tensor | None) -> Tensor:
    """One token of one head: returns the new state; ``gate`` is the log decay (scalar or ``[Dk]``)."""
    decay = gate.exp()
    a = torch.diag(decay) if decay.dim() == 1 else decay * torch.eye(k.shape[0], dtype=k.dtype)
    s = a @ s  # S' = A_t S_{t-1}
    if kind == "delta":
        assert beta is not None
        return s + beta * torch.outer(k, v - s.T @ k)
    return s + torch.outer(k, v)


def token_loop(kind: str, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor | None = None,
               scale: float | None = None, s0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``kind`` "gla" (also retention: a constant scalar log decay) or "delta".

    q, k ``[B, Hk, N, Dk]``; v ``[B, Hv, N, Dv]``; log_decay ``[B, Hv, N]`` or ``[B, Hv, N, Dk]``;
    beta ``[B, Hv, N]``; s0 ``[B, Hv, Dk, Dv]``. Returns ``(out [B, Hv, N, Dv], S_N)`` in float64.
    """
    q, k, v, log_decay = (t.double() for t in (q, k, v, log_decay))
    b, hk, n, dk = q.shape
    hv, dv = v.shape[1], v.shape[3]
    scale = dk ** -0.5 if scale is None else scale
    out = torch.zeros(b, hv, n, dv, dtype=torch.float64)
    states = torch.zeros(b, hv, dk, dv, dtype=torch.float64)
    for bi in range(b):
        for j in range(hv):
            h = j // (hv // hk)
            s = torch.zeros(dk, dv, dtype=torch.float64) if s0 is None else s0[bi, j].double()
            for t in range(n):
                bt = None if beta is None else beta[bi, j, t].double()
                s = _step(kind, s, q[bi, h, t], k[bi, h, t], v[bi, j, t], log_decay[bi, j, t], bt)
                out[bi, j, t] = scale * (s.T @ q[bi, h, t])
            states[bi, j] = s
    return out, states


def packed_loop(kind: str, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, cu: list[int],
                beta: Tensor | None = None, scale: float | None = None,
                s0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`token_loop` on each packed sequence alone (``B == 1``); states ``[S, Hv, Dk, Dv]``."""
    outs, states = [], []
    for i, (lo, hi) in enumerate(zip(cu, cu[1:])):
        def part(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[:, :, lo:hi]
        o, s = token_loop(kind, part(q), part(k), part(v), part(log_decay), part(beta), scale,
                          None if s0 is None else s0[i:i + 1])
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=2), torch.cat(states, dim=0)
