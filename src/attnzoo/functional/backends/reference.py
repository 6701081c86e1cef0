"""The reference backend: plain softmax attention, the oracle every fast path is tested against.

It materialises the full ``[B, Hq, Nq, Nk]`` score matrix, so it is only for testing, small
inputs and attention maps (it is the only backend that returns weights). It runs in float64 for
float64 inputs and in float32 otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnzoo.functional.core._request import AttnRequest, Capabilities
from attnzoo.functional.core.rules import compute_dtype

#: The reference serves every request.
CAPABILITIES = Capabilities("reference", frozenset())


def masked_scores(r: AttnRequest, q: Tensor, k: Tensor, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> Tensor:
    """Scores of a tile after scale, softcap, score_mod, bias and masks; ``-inf`` where a key is hidden.

    q ``[B, Hq, bq, D]`` and k ``[B, Hq, bk, D]`` in the compute dtype -> ``[B, Hq, bq, bk]``.
    """
    s = torch.matmul(q, k.transpose(-1, -2)) * r.scale  # [B, Hq, bq, bk]
    if r.softcap is not None:
        s = torch.tanh(s / r.softcap) * r.softcap
    s = r.modify(s, q_lo, q_hi, k_lo, k_hi)  # the user's score_mod, if any
    bias = r.bias(q_lo, q_hi, k_lo, k_hi)
    if bias is not None:
        s = s + bias.to(s.dtype)
    allowed = r.allowed(q_lo, q_hi, k_lo, k_hi)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def safe_softmax(s: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim and its log-sum-exp, with rows of all ``-inf`` -> zeros, LSE ``-inf``.

    Gradients stay finite on such rows (no ``inf - inf``).
    """
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    p = e / safe
    # log(0) would send an infinite gradient into an empty row (inf * 0 = NaN under a sink correction)
    lse = torch.where(denom > 0, torch.log(safe) + m, torch.full_like(denom, float("-inf"))).squeeze(-1)
    return p, lse


def reference_attention(r: AttnRequest, *, weights_in_compute_dtype: bool = False,
                        ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Exact attention by definition. Returns ``(out [B,Hq,Nq,Dv], lse [B,Hq,Nq] | None, weights | None)``;
    the weights in q's dtype, or in the compute dtype (float32/float64) if ``weights_in_compute_dtype``."""
    cdt = compute_dtype(r.q.dtype)
    q = r.q.to(cdt)
    k = r.k.to(cdt)
    v = r.v.to(cdt)
    if r.group > 1:  # the oracle may expand K/V; fast paths never do
        k = k.repeat_interleave(r.group, dim=1)  # [B, Hq, Nk, D]
        v = v.repeat_interleave(r.group, dim=1)  # [B, Hq, Nk, Dv]
    s = masked_scores(r, q, k, 0, r.nq, 0, r.nk)  # [B, Hq, Nq, Nk]
    p, lse = safe_softmax(s)
    weights = p
    if r.dropout_p > 0:
        p = torch.nn.functional.dropout(p, r.dropout_p, training=True)
    out = torch.matmul(p, v).to(r.q.dtype)  # [B, Hq, Nq, Dv]
    return (out,
            lse if r.return_lse else None,  # already float32 (float64 for float64 inputs)
            (weights if weights_in_compute_dtype else weights.to(r.q.dtype)) if r.return_weights else None)
