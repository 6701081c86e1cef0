"""Issue 33, item 5: a NaN/inf that a row cannot see never reaches that row, forward or backward.

Every backend (``reference``, ``sdpa``, ``tiled``, ``flex`` where it runs), with and without
``sinks=``, and ``sigmoid_attention`` on both of its backends; hidden by causality, a window, bool
/ float / ``Mask`` padding or a float bias; in a key, a value or a query row. Outputs and gradients
are compared with the float64 oracle (``tests/nonfinite_oracle.py``): the rows that see a bad
entry (or own a bad query) are NaN, every other row and every gradient a clean row sends equals
the oracle's.
"""

from __future__ import annotations

import pytest
import torch

import attnzoo as az
from attnzoo import masks as M
from nonfinite_oracle import cleaned, expected, nan_rows, visible

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

B, HQ, HKV, N, D = 2, 4, 2, 7, 4
KINDS = ("causal", "window", "bool_padding", "float_padding", "mask_padding", "float_bias", "empty_row")
SOFTMAX_BACKENDS = [b for b in ("reference", "sdpa", "tiled", "flex") if b in az.functional.available_backends("cpu")]
VALUES = (float("nan"), float("inf"), float("-inf"))


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
    err = (out.double() - ref).abs()[good].max().item()
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


def _dtype(backend: str) -> torch.dtype:
    return torch.float64 if backend in ("reference", "tiled") else torch.float32


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("where", ["k", "v", "q"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", SOFTMAX_BACKENDS)
def test_softmax_backends_keep_non_finite_entries_in_their_rows(backend: str, kind: str, where: str,
                                                                sinks: bool) -> None:
    value = VALUES[(KINDS.index(kind) + "kvq".index(where)) % 3]
    q, k, v, kw = make_case(kind, where, value, _dtype(backend))
    z = torch.linspace(-1.0, 1.0, HQ) if sinks else None

    def run(q, k, v, s):
        return az.attention(q, k, v, backend=backend, sinks=s, **kw)

    check(run, q, k, v, kw, sinks=z, grads=backend != "flex")  # flex has no CPU backward


@pytest.mark.parametrize("where", ["k", "v", "q"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_sigmoid_attention_keeps_non_finite_entries_in_their_rows(backend: str, kind: str, where: str) -> None:
    value = VALUES[(KINDS.index(kind) + "kvq".index(where)) % 3]
    q, k, v, kw = make_case(kind, where, value, torch.float64)
    if backend == "tiled" and isinstance(kw.get("mask"), torch.Tensor) and kw["mask"].is_floating_point():
        kw_run = dict(kw)  # a float mask without gradients is fine on tiled
    else:
        kw_run = kw

    def run(q, k, v, s):
        return az.sigmoid_attention(q, k, v, backend=backend, **kw_run)

    check(run, q, k, v, kw, score="sigmoid")


def test_float_mask_with_a_hidden_nan_key_is_no_internal_error() -> None:
    """The issue's reproducer: a float mask and any NaN in K was ``NotImplementedError:
    "bitwise_and_cpu" not implemented for 'Float'`` (an operator-precedence slip in ``_edge``)."""
    q, k, v, kw = make_case("float_padding", "k", float("nan"), torch.float32)
    out = az.attention(q, k, v, backend="sdpa", **kw)
    assert torch.isfinite(out).all()


def test_nan_query_row_on_sdpa_is_nan_in_that_row_only() -> None:
    """torch's fused CPU kernel returns a NaN query's row finite; attnzoo gives NaN there, as the math."""
    q, k, v, _ = make_case("causal", "q", float("nan"), torch.float32)
    for extra in ({}, {"causal": True}):
        out = az.attention(q, k, v, backend="sdpa", **extra)
        rows = torch.isnan(out).any(-1)
        assert rows.nonzero().tolist() == [[0, 1, 3]], rows.nonzero().tolist()


def test_nan_padding_key_leaves_every_gradient_finite() -> None:
    """A NaN key hidden from every row (a padding slot): the forward was exact but ``dq`` was NaN in
    every row on reference and tiled (``dq = dS K`` multiplies the hidden key by a zero)."""
    for backend in ("reference", "tiled"):
        q, k, v, kw = make_case("bool_padding", "k", float("nan"), torch.float64)
        q.requires_grad_()
        az.attention(q, k, v, backend=backend, **kw).sum().backward()
        assert torch.isfinite(q.grad).all(), backend


def test_finite_inputs_are_unchanged_by_the_guard() -> None:
    """With finite inputs the result is the backend's own (bitwise equal to a direct kernel call)."""
    q, k, v, _ = make_case("causal", "k", 0.5, torch.float32)
    import torch.nn.functional as F

    direct = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert torch.equal(az.attention(q, k, v, backend="sdpa"), direct)
