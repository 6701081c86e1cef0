"""Edge cases every backend shares, handled once around the backend call (``docs/conventions.md``):

* empty inputs: no keys (``Nk = 0``) gives zeros and LSE ``-inf``; no queries or no batch gives
  empty outputs; no backend kernel sees a zero-size tensor;
* non-finite keys/values: a key a row cannot see never changes that row, forward or backward.
  Fused kernels add the mask to the scores (``NaN + -inf = NaN``) and multiply hidden values by a
  zero weight (``0 * NaN = NaN``), and every backward multiplies a hidden key by its zero score
  gradient (``dq = dS K``), so a NaN or inf in one hidden key would spoil every row. When K or V
  hold a non-finite entry (checked eagerly: for masked requests whose output is not finite, and
  before the run when q, k or v need gradients), the kernel runs on K/V with those entries
  replaced by zeros (``masked_fill``: their gradient is 0, never ``0 * NaN``) and the rows that
  *see* such a key are set to NaN;
* non-finite queries: a row whose query holds a NaN or inf is NaN when it sees any key (zeros
  when it sees none), and no other row changes. torch's fused CPU kernel returns such a row
  finite (its running maximum skips NaN); on masked requests the guard restores the NaN. An
  unmasked request (every row sees every key, nothing is hidden) gets no host-side check (the
  one-token decode call is unmasked and a sync on q would cost it ~50% at small Nk): a fused
  kernel's result there gets ``0 * sum_d(q) [B, Hq, Nq, 1]`` added (one reduction and one add,
  no sync), which is ``+0`` on a finite row (bitwise the kernel's result) and NaN on a row whose
  query holds a NaN or inf.

Both guards run in eager mode only (under ``torch.compile`` the request goes straight to the
kernel). :func:`guard_nonfinite` serves :func:`attnzoo.attention` (with or without ``sinks``)
and :func:`attnzoo.sigmoid_attention`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextvars import ContextVar

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo.functional.core._request import AttnRequest
from attnzoo.functional.core.rules import compute_dtype

__all__ = ["empty_result", "guard_nonfinite", "is_empty", "vouch_finite"]

#: the address of an output whose every value the kernel that wrote it found finite, during the run
#: :func:`guard_nonfinite` wraps (0: none)
_VOUCHED: ContextVar[int] = ContextVar("attnzoo_vouched_finite", default=0)


def vouch_finite(out: Tensor) -> None:
    """Tells the :func:`guard_nonfinite` around the current run that every value of ``out`` is finite
    (checked by the kernel that wrote it, e.g. the compiled window kernel): the guard then skips its
    own pass over the output and q (at N = 65,536 a tenth of the windowed call's time). A result
    that is not this very tensor (a copy, a cast) is checked as usual."""
    _VOUCHED.set(out.data_ptr())

#: Query rows per step when finding the rows that see a non-finite key (bounds the bool table).
_ROWS_PER_STEP = 1024


def is_empty(r: AttnRequest) -> bool:
    """Whether the request has no keys, no queries or no batch."""
    return r.nk == 0 or r.nq == 0 or r.batch == 0


def empty_result(r: AttnRequest) -> tuple[Tensor, Tensor, Tensor]:
    """``(out [B, Hq, Nq, Dv] zeros, lse [B, Hq, Nq] -inf, weights [B, Hq, Nq, Nk] zeros)``.

    ``out`` is ``0 @ v`` so gradients reach ``v`` (as zeros)."""
    B, Hq, Nq, Nk = r.batch, r.hq, r.nq, r.nk
    v = r.v.repeat_interleave(r.group, dim=1) if r.group > 1 else r.v  # [B, Hq, Nk, Dv]
    weights = torch.zeros(B, Hq, Nq, Nk, dtype=r.q.dtype, device=r.q.device)
    out = torch.matmul(weights, v)  # [B, Hq, Nq, Dv] zeros, differentiable in v
    lse = torch.full((B, Hq, Nq), float("-inf"), dtype=compute_dtype(r.q.dtype), device=r.q.device)
    return out, lse, weights


def _hides_keys(r: AttnRequest) -> bool:
    return r.structure is not None or r.mask_tensor is not None


def _rows_seeing(r: AttnRequest, bad: Tensor) -> Tensor:
    """Bool ``[B, Hq, Nq]``: rows that see a key flagged in ``bad [B, Hkv, Nk]``."""
    bad_q = bad.repeat_interleave(r.group, dim=1).unsqueeze(2)  # [B, Hq, 1, Nk]
    parts = []
    fm = r.float_mask
    for lo in range(0, r.nq, _ROWS_PER_STEP):
        hi = min(r.nq, lo + _ROWS_PER_STEP)
        seen = bad_q
        allowed = r.allowed(lo, hi, 0, r.nk)
        if allowed is not None:
            seen = seen & allowed
        if fm is not None:
            seen = seen & ((fm[:, :, lo:hi] if fm.shape[2] > 1 else fm) > float("-inf"))
        parts.append(seen.expand(r.batch, r.hq, hi - lo, r.nk).any(dim=-1))
    return torch.cat(parts, dim=-1)


def _needs_grad(r: AttnRequest) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (r.q, r.k, r.v))


def _bad_keys(r: AttnRequest) -> Tensor:
    """Bool ``[B, Hkv, Nk]``: keys whose key or value vector holds a NaN or inf."""
    return ~torch.isfinite(r.k).all(dim=-1) | ~torch.isfinite(r.v).all(dim=-1)


def _maybe_non_finite(*tensors: Tensor) -> bool:
    """Whether one of ``tensors`` may hold a NaN or inf: one reduction each (a NaN/inf anywhere makes
    the sum non-finite; ~10x cheaper than ``isfinite().all()`` on CPU). A sum that merely overflows
    answers ``True`` and only costs the exact inspection that follows."""
    total = tensors[0].sum()
    for t in tensors[1:]:
        total = total + t.sum()
    return not bool(torch.isfinite(total))


def _nan_rows(result: Tensor | tuple[Tensor, ...], rows: Tensor, value: float = float("nan"),
              lse_value: float = float("nan")) -> Tensor | tuple[Tensor, ...]:
    """``result`` (``out`` or ``(out, lse?, weights?)``) with ``value`` on the query rows ``rows [B, Hq, Nq]``
    (``lse_value`` in the LSE)."""
    parts = list(result) if isinstance(result, tuple) else [result]
    # out [B, Hq, Nq, Dv], lse [B, Hq, Nq], weights [B, Hq, Nq, Nk]
    parts = [t.masked_fill(rows, lse_value) if t.dim() == 3 else t.masked_fill(rows.unsqueeze(-1), value)
             for t in parts]
    return tuple(parts) if isinstance(result, tuple) else parts[0]


def _clean_run(r: AttnRequest, bad: Tensor, run: Callable[[AttnRequest], Tensor | tuple[Tensor, ...]]
               ) -> Tensor | tuple[Tensor, ...]:
    """``run`` on K/V with the ``bad [B, Hkv, Nk]`` keys zeroed; NaN on the rows that see one."""
    keep = bad.unsqueeze(-1)  # [B, Hkv, Nk, 1]
    clean = dataclasses.replace(r, k=r.k.masked_fill(keep, 0), v=r.v.masked_fill(keep, 0))
    return _nan_rows(run(clean), _rows_seeing(r, bad))


def guard_nonfinite(r: AttnRequest, run: Callable[[AttnRequest], Tensor | tuple[Tensor, ...]], *,
                    fused: bool = True) -> Tensor | tuple[Tensor, ...]:
    """``run(r)`` (``out`` or ``(out, lse?, weights?)``, the layout of :func:`attnzoo.attention`'s
    result), except that non-finite keys/values change only the rows that see them and a
    non-finite query only its own row (those rows become NaN), forward and backward.

    ``fused=False`` says that ``run`` spreads a non-finite query into its row by itself (the plain
    PyTorch backends): an unmasked request then goes straight to ``run`` (no extra pass)."""
    hides = _hides_keys(r)
    if is_empty(r) or tracing():
        return run(r)
    if not hides:
        # unmasked: every row sees every key, so nothing hidden can leak; a non-finite query row is NaN
        # on reference/tiled by their math, and made NaN without a host sync on fused kernels (torch's
        # fused CPU kernel returns it finite). A sync on q would cost every decode step ~50% on small Nk.
        return _spread_queries(r, run(r)) if fused else run(r)
    if _needs_grad(r) and _maybe_non_finite(r.k, r.v):  # a finite forward can hide a NaN key from autograd
        bad = _bad_keys(r)
        if bool(bad.any()):
            result = _clean_run(r, bad, run)
            return _fix_queries(r, result) if fused else result
    token = _VOUCHED.set(0)
    try:
        result = run(r)
        vouched = _VOUCHED.get()
    finally:
        _VOUCHED.reset(token)
    # A leak can only show as a non-finite output: one reduction of the output decides whether K and
    # V are inspected at all (none when the kernel vouched for this output).
    out = result[0] if isinstance(result, tuple) else result
    if (vouched and vouched == out.data_ptr()) or not _maybe_non_finite(out, r.q):
        return result
    bad = _bad_keys(r)
    if bool(bad.any()):  # else the non-finite output comes from q or the mask, not from hidden keys
        result = _clean_run(r, bad, run)
    return _fix_queries(r, result) if fused else result


def _spread_queries(r: AttnRequest, result: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """``result`` plus ``0 * sum_d(q)`` on every row (``torch.add(.., alpha=0)``: one kernel, no host
    sync): ``+0`` where the query is finite, NaN where it holds a NaN or inf. For unmasked requests
    (every row sees a key). A float16 sum is taken in float32 and zeroed before the cast back (a
    finite row whose sum would overflow float16 stays finite)."""
    if r.q.dtype == torch.float16:
        row = r.q.sum(dim=-1, keepdim=True, dtype=torch.float32).mul_(0).to(r.q.dtype)  # [B, Hq, Nq, 1]
    else:
        row = r.q.sum(dim=-1, keepdim=True)  # [B, Hq, Nq, 1]; bfloat16 has float32's range
    if isinstance(result, Tensor):
        return torch.add(result, row, alpha=0)
    # out [B, Hq, Nq, Dv], lse [B, Hq, Nq], weights [B, Hq, Nq, Nk]
    return tuple(torch.add(t, row.squeeze(-1) if t.dim() == 3 else row, alpha=0) for t in result)


def _fix_queries(r: AttnRequest, result: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """NaN on the rows whose query is non-finite and that see a key; zeros (LSE ``-inf``) on such rows
    that see none (a fused kernel returns the first finite and may return NaN for the second)."""
    bad_q = ~torch.isfinite(r.q).all(dim=-1)  # [B, Hq, Nq]
    if not bool(bad_q.any()):
        return result
    sees = _rows_seeing(r, torch.ones(r.batch, r.hkv, r.nk, dtype=torch.bool, device=r.q.device))
    result = _nan_rows(result, bad_q & ~sees, 0.0, float("-inf"))
    return _nan_rows(result, bad_q & sees)
