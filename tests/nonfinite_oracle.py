"""What attention must return when q, k or v hold NaN/inf (``docs/conventions.md``), from the math.

A row is NaN when it sees a key whose key or value vector is non-finite, or when its own query is
non-finite and it sees any key; every other row equals the float64 oracle run on the inputs with
those vectors replaced by zeros (a row never reads a key it cannot see, so the replacement cannot
matter to it). Sinks and sigmoid attention are written here from their definitions:

* sinks (gpt-oss): ``lse' = logaddexp(lse, z_h)``, ``out' = out * exp(lse - lse')``;
* sigmoid: ``out_i = sum_{j visible} sigmoid(s_ij + b) v_j`` (``b`` defaults to ``-log Nk``).

Used by ``tests/test_nonfinite.py`` (a grid) and ``tests/test_fuzz.py`` (properties).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from oracle import oracle_attention, visible_table


def visible(q: Tensor, k: Tensor, *, causal: bool = False, window: object = None, q_offset: int | None = None,
            mask: Tensor | Callable[..., Tensor] | None = None) -> Tensor:
    """Bool ``[B, Hq, Nq, Nk]``: the keys each row sees (a float mask's ``-inf`` hides too)."""
    b, hq, nq, _ = q.shape
    ok = visible_table(b, hq, nq, k.shape[2], causal=causal, window=window, q_offset=q_offset,  # type: ignore[arg-type]
                       mask=mask)
    if isinstance(mask, Tensor) and mask.is_floating_point():
        ok = ok & (mask > float("-inf")).expand_as(ok)
    return ok


def nan_rows(q: Tensor, k: Tensor, v: Tensor, ok: Tensor) -> Tensor:
    """Bool ``[B, Hq, Nq]``: the rows that must be NaN."""
    hq, hkv = q.shape[1], k.shape[1]
    bad_kv = ~torch.isfinite(k).all(-1) | ~torch.isfinite(v).all(-1)  # [B, Hkv, Nk]
    bad_kv = bad_kv[:, torch.arange(hq) // (hq // hkv)].unsqueeze(2)  # [B, Hq, 1, Nk]
    bad_q = ~torch.isfinite(q).all(-1)  # [B, Hq, Nq]
    return (ok & bad_kv).any(-1) | (bad_q & ok.any(-1))


def cleaned(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 copies with every non-finite query row / key-value vector replaced by zeros."""
    bad_kv = (~torch.isfinite(k).all(-1) | ~torch.isfinite(v).all(-1)).unsqueeze(-1)
    q = q.detach().double().masked_fill(~torch.isfinite(q).all(-1, keepdim=True), 0)
    return q, k.detach().double().masked_fill(bad_kv, 0), v.detach().double().masked_fill(bad_kv, 0)


def expected(q: Tensor, k: Tensor, v: Tensor, *, score: str = "softmax", sinks: Tensor | None = None,
             bias: float | None = None, **vis: object) -> Tensor:
    """float64 ``out [B, Hq, Nq, Dv]`` of already-cleaned inputs (differentiable in q, k, v, sinks)."""
    if score == "softmax":
        out, lse = oracle_attention(q, k, v, **vis)  # type: ignore[arg-type]
        if sinks is None:
            return out
        new_lse = torch.logaddexp(lse, sinks.double().view(1, -1, 1))
        return out * torch.exp(lse - new_lse).unsqueeze(-1)
    hq, hkv, nk = q.shape[1], k.shape[1], k.shape[2]
    kv_head = torch.arange(hq) // (hq // hkv)
    s = q @ k[:, kv_head].transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = vis.get("mask")
    if isinstance(mask, Tensor) and mask.is_floating_point():
        s = s + mask.double()
    ok = visible(q, k, **vis)  # type: ignore[arg-type]
    b = -math.log(max(1, nk)) if bias is None else bias
    p = torch.sigmoid(s + b).masked_fill(~ok, 0.0)
    return p @ v[:, kv_head]
