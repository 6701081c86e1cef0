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
from nonfinite_oracle import HQ, KINDS, B, N, check, make_case

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

SOFTMAX_BACKENDS = [b for b in ("reference", "sdpa", "tiled", "flex") if b in az.functional.available_backends("cpu")]
SOFTMAX_BACKENDS.append("auto")
# tiled in float32: the compiled kernels where they are built (tiled/native.py), else the PyTorch path
SOFTMAX_BACKENDS.append("tiled32")
VALUES = (float("nan"), float("inf"), float("-inf"))


def _value(kind: str, where: str) -> float:
    """The non-finite entry of a case. Unmasked, a key/value is seen by every row and only NaN is
    defined to spread by itself (an inf key gives some rows an IEEE-exact finite result); its query
    rows get inf, the case the fused kernels got wrong."""
    if kind == "unmasked":
        return float("nan") if where != "q" else float("inf")
    return VALUES[(KINDS.index(kind) + "kvq".index(where)) % 3]


def _grads_defined(kind: str, where: str) -> bool:
    """Unmasked, every row of the bad key's batch row and head sees it: no clean row sends its keys a
    gradient, so there is none to compare (the forward is still checked)."""
    return kind != "unmasked" or where == "q"


def _dtype(backend: str) -> torch.dtype:
    return torch.float64 if backend in ("reference", "tiled") else torch.float32


def _name(backend: str) -> str:
    return "tiled" if backend == "tiled32" else backend


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("where", ["k", "v", "q"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", SOFTMAX_BACKENDS)
def test_softmax_backends_keep_non_finite_entries_in_their_rows(backend: str, kind: str, where: str,
                                                                sinks: bool) -> None:
    value = _value(kind, where)
    q, k, v, kw = make_case(kind, where, value, _dtype(backend))
    z = torch.linspace(-1.0, 1.0, HQ) if sinks else None

    def run(q, k, v, s):
        return az.attention(q, k, v, backend=_name(backend), sinks=s, **kw)

    check(run, q, k, v, kw, sinks=z, grads=backend != "flex" and _grads_defined(kind, where))  # flex: no CPU backward


@pytest.mark.parametrize("where", ["k", "v", "q"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_sigmoid_attention_keeps_non_finite_entries_in_their_rows(backend: str, kind: str, where: str) -> None:
    value = _value(kind, where)
    q, k, v, kw = make_case(kind, where, value, torch.float64)
    if backend == "tiled" and isinstance(kw.get("mask"), torch.Tensor) and kw["mask"].is_floating_point():
        kw_run = dict(kw)  # a float mask without gradients is fine on tiled
    else:
        kw_run = kw

    def run(q, k, v, s):
        return az.sigmoid_attention(q, k, v, backend=backend, **kw_run)

    check(run, q, k, v, kw, score="sigmoid", grads=_grads_defined(kind, where))


def test_float_mask_with_a_hidden_nan_key_is_no_internal_error() -> None:
    """The issue's reproducer: a float mask and any NaN in K was ``NotImplementedError:
    "bitwise_and_cpu" not implemented for 'Float'`` (an operator-precedence slip in ``_edge``)."""
    q, k, v, kw = make_case("float_padding", "k", float("nan"), torch.float32)
    out = az.attention(q, k, v, backend="sdpa", **kw)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_nan_query_row_on_sdpa_is_nan_in_that_row_only(backend: str) -> None:
    """torch's fused CPU kernel returns a NaN query's row finite; attnzoo gives NaN there, as the math,
    masked or not (an unmasked call, the one-token decode's form, came back finite: issue 33 gaps),
    with and without sinks, and in one-token decode calls (``auto``'s split-KV path)."""
    q, k, v, _ = make_case("causal", "q", float("nan"), torch.float32)
    real = torch.ones(B, 1, 1, N, dtype=torch.bool)
    for extra in ({}, {"causal": True}, {"mask": real}, {"sinks": torch.zeros(HQ)}):
        out = az.attention(q, k, v, backend=backend, **extra)
        rows = torch.isnan(out).any(-1)
        assert rows.nonzero().tolist() == [[0, 1, 3]], (extra, rows.nonzero().tolist())
    one = az.attention(q[:, :, 3:4], k, v, backend=backend)  # decode: one query, unmasked
    assert torch.isnan(one).any(-1).nonzero().tolist() == [[0, 1, 0]]


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
