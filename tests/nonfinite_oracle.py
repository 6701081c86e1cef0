"""What attention must return when q, k or v hold NaN/inf (``docs/conventions.md``), from the math.

A row is NaN when it sees a key whose key or value vector is non-finite, or when its own query is
non-finite and it sees any key; every other row equals the float64 oracle run on the inputs with
those vectors replaced by zeros (a row never reads a key it cannot see, so the replacement cannot
matter to it). Sinks and sigmoid attention are written here from their definitions:

* sinks (gpt-oss): ``lse' = logaddexp(lse, z_h)``, ``out' = out * exp(lse - lse')``;
* sigmoid: ``out_i = sum_{j visible} sigmoid(s_ij + b) v_j`` (``b`` defaults to ``-log Nk``).

Used by ``tests/functional/core/test_nonfinite.py`` (a grid) and ``tests/functional/test_fuzz.py`` (properties): :func:`check` runs a
call and compares it with :func:`expected`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from attnzoo import masks as M
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


B, HQ, HKV, N, D = 2, 4, 2, 7, 4
KINDS = ("causal", "window", "bool_padding", "float_padding", "mask_padding", "float_bias", "empty_row",
         "unmasked")


def make_case(kind: str, where: str, value: float, dtype: torch.dtype, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """``q, k, v`` with one non-finite entry that the mask ``kind`` hides from most rows, and the
    attention keywords."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, N, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    real = torch.ones(B, N, dtype=torch.bool)
    real[1, 2] = False  # a padding slot of row 1, hidden from every query
    neg = torch.zeros(B, 1, 1, N, dtype=torch.float64).masked_fill(~real[:, None, None], float("-inf"))
    kw: dict = {
        "causal": {"causal": True},
        "window": {"causal": True, "window": 2},
        "bool_padding": {"mask": real[:, None, None, :]},
        "float_padding": {"mask": neg},
        "mask_padding": {"mask": M.key_padding(real)},
        "float_bias": {"mask": torch.randn(B, 1, N, N, generator=g, dtype=torch.float64) + neg, "causal": True},
        "empty_row": {"mask": torch.ones(B, 1, N, N, dtype=torch.bool).index_fill(2, torch.tensor([0]), False)},
        "unmasked": {},  # every row sees every key: a bad key spoils its batch row, a bad query its own row
    }[kind]
    # the hidden slot: the newest key under causality, the oldest under a window, the padding slot
    b, j = {"causal": (0, N - 1), "window": (0, 0), "float_bias": (1, 2)}.get(kind, (1, 2))
    if where == "q":
        q[b, 1, 0 if kind == "empty_row" else 3, 1] = value  # row 0 of "empty_row" sees no key: zeros
    else:
        (k if where == "k" else v)[b, 0, j, 1] = value
    cast = [t.to(dtype) for t in (q, k, v)]
    kw = {n: (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    return cast[0], cast[1], cast[2], kw


def check(run, q, k, v, kw: dict, *, score: str = "softmax", sinks: torch.Tensor | None = None,
          grads: bool = True) -> None:
    """``run(q, k, v)`` against the oracle: NaN rows, the other rows' values and their gradients."""
    dtype = q.dtype
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    z = None if sinks is None else sinks.detach().clone().to(dtype).requires_grad_(grads)
    out = run(*leaves, z)
    ok = visible(q, k, **kw)
    bad = nan_rows(q, k, v, ok)  # [B, Hq, Nq]
    assert torch.equal(torch.isnan(out).any(-1), bad), (
        f"NaN rows {torch.isnan(out).any(-1).nonzero().tolist()} != expected {bad.nonzero().tolist()}")
    ref_in = [t.requires_grad_(grads) for t in cleaned(q, k, v)]
    z_ref = None if z is None else z.detach().double().requires_grad_(grads)
    ref = expected(*ref_in, score=score, sinks=z_ref, **{n: (t.double() if isinstance(t, torch.Tensor)
                                                             and t.is_floating_point() else t)
                                                         for n, t in kw.items()})
    good = ~bad
    diff = (out.double() - ref).abs()[good]
    err = diff.max().item() if diff.numel() else 0.0
    assert err <= tol, f"rows that see no bad entry are off by {err:.2e}"
    if not grads:
        return
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    w = w.masked_fill(bad.unsqueeze(-1), 0.0)  # a loss over the clean rows only
    (out.double().masked_fill(bad.unsqueeze(-1), 0.0) * w).sum().backward()
    (ref.masked_fill(bad.unsqueeze(-1), 0.0) * w).sum().backward()
    names = ("dq", "dk", "dv")
    bad_query = not bool(torch.isfinite(q).all())
    for name, mine, theirs in zip(names, leaves, ref_in, strict=True):
        if bad_query and name != "dq":
            continue  # a NaN query row sends NaN to the keys it sees (the oracle's too): only dq is defined
        gm, gr = mine.grad.double(), theirs.grad
        if name == "dq":  # the rows that see no bad entry, a bad query's own row aside
            rows = good & torch.isfinite(q).all(-1)
            gm, gr = gm[rows], gr[rows]
        assert torch.isfinite(gm).all(), f"{name}: non-finite entries where the oracle has none"
        gerr = (gm - gr).abs().max().item() if gm.numel() else 0.0
        assert gerr <= tol * 10, f"{name} off by {gerr:.2e}"
    if z is not None and not bad_query:
        assert (z.grad.double() - z_ref.grad).abs().max().item() <= tol * 10, "d sinks"
