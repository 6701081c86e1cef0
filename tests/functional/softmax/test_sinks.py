"""Attention sinks (gpt-oss): every backend vs a float64 oracle written from the definition."""

from __future__ import annotations

import pytest
import torch

import attnzoo as az
from attnzoo.functional.softmax.sinks import apply_sinks


def oracle(q, k, v, sinks, *, causal=False, window=None, q_offset=None, scale=None):
    """Definition: append a column of sink logits to the masked score matrix, softmax, drop it."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    B, Hq, Nq, D = q.shape
    G = Hq // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    off = k.shape[2] - Nq if q_offset is None else q_offset
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else D ** -0.5)
    p_q = torch.arange(Nq).view(-1, 1) + off
    p_k = torch.arange(k.shape[2]).view(1, -1)
    ok = torch.ones(Nq, k.shape[2], dtype=torch.bool)
    if causal:
        ok &= p_k <= p_q
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if left is not None:
            ok &= p_k >= p_q - left
        if right is not None:
            ok &= p_k <= p_q + right
    s = s.masked_fill(~ok, float("-inf"))
    col = sinks.view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)
    full = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return p @ v, lse


CASES = [
    dict(hq=4, hkv=4, nq=37, nk=37, causal=True),
    dict(hq=4, hkv=2, nq=37, nk=37, causal=True, window=(5, 0)),
    dict(hq=4, hkv=1, nq=9, nk=30, window=(3, 2)),
    dict(hq=2, hkv=2, nq=12, nk=7, causal=True),  # default alignment: first 5 rows see nothing
    dict(hq=4, hkv=2, nq=10, nk=20, causal=True, window=(2, 0), q_offset=25),  # rows past every key...
    dict(hq=2, hkv=1, nq=300, nk=300, causal=True),  # several tiles
]


def _inputs(c: dict, dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(2, c["hq"], c["nq"], 16, dtype=dtype)
    k = torch.randn(2, c["hkv"], c["nk"], 16, dtype=dtype)
    v = torch.randn(2, c["hkv"], c["nk"], 12, dtype=dtype)
    sinks = torch.randn(c["hq"], dtype=dtype) * 2
    return q, k, v, sinks


def _kw(c: dict) -> dict:
    return {n: c[n] for n in ("causal", "window", "q_offset") if n in c}


@pytest.mark.parametrize("backend", ["reference", "tiled", "sdpa", "auto"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_gradients_match_oracle(backend: str, case: dict) -> None:
    q, k, v, sinks = (t.requires_grad_() for t in _inputs(case))
    want_out, want_lse = oracle(q, k, v, sinks, **_kw(case))
    gw = torch.randn_like(want_out)
    if backend == "sdpa":  # no LSE there
        out = az.attention(q, k, v, sinks=sinks, backend=backend, **_kw(case))
        loss, want_loss = (out * gw).sum(), (want_out * gw).sum()
    else:
        out, lse = az.attention(q, k, v, sinks=sinks, return_lse=True, backend=backend, **_kw(case))
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
        gl = torch.randn_like(want_lse)
        loss = (out * gw).sum() + (lse * gl).sum()
        want_loss = (want_out * gw).sum() + (want_lse * gl).sum()
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{backend} {case}: {m}")
    got = torch.autograd.grad(loss, (q, k, v, sinks))
    want = torch.autograd.grad(want_loss, (q, k, v, sinks))
    for name, g, w in zip(["q", "k", "v", "sinks"], got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{backend} d{n}: {m}")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", CASES[:5], ids=str)
def test_flex_forward_matches_oracle(case: dict) -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v, sinks = _inputs(case)
    want_out, want_lse = oracle(q, k, v, sinks, **_kw(case))
    with torch.no_grad():
        out, lse = az.attention(q, k, v, sinks=sinks, return_lse=True, backend="flex", **_kw(case))
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_empty_rows_return_zeros_and_the_sink_lse() -> None:
    q, k, v, sinks = _inputs(dict(hq=2, hkv=2, nq=12, nk=7))
    for backend in ("reference", "tiled"):
        out, lse = az.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, backend=backend)
        assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))  # rows at positions < 0
        torch.testing.assert_close(lse[:, :, :5], sinks.view(1, 2, 1).expand(2, 2, 5))
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_weights_drop_the_sink_column() -> None:
    q, k, v, sinks = _inputs(dict(hq=2, hkv=1, nq=6, nk=6))
    out, lse, w = az.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, return_weights=True)
    want = torch.exp(q.new_tensor(0.0) + sinks.view(1, 2, 1) - lse)  # mass on the sink
    torch.testing.assert_close(w.sum(-1), 1 - want)
    torch.testing.assert_close(out, w @ v.expand(2, 2, 6, 12))


def test_half_precision_tiled_close_to_float32() -> None:
    q, k, v, sinks = _inputs(dict(hq=4, hkv=2, nq=64, nk=64))
    want, _ = oracle(q, k, v, sinks, causal=True)
    got = az.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, sinks=sinks, backend="tiled")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_apply_sinks_is_the_lse_correction() -> None:
    out = torch.randn(1, 2, 3, 4)
    lse = torch.tensor([[[0.0, float("-inf"), 1.0], [2.0, -1.0, float("-inf")]]])
    sinks = torch.tensor([0.5, -0.5])
    o2, l2, w = apply_sinks(out, lse, sinks)
    torch.testing.assert_close(l2, torch.logaddexp(lse, sinks.view(1, 2, 1)))
    assert w[0, 0, 1, 0] == 0 and w[0, 1, 2, 0] == 0
    torch.testing.assert_close(o2, out * w)


@pytest.mark.parametrize("bad, exc, words", [
    (torch.zeros(3), ValueError, "shape [Hq]"),
    (torch.zeros(2, dtype=torch.long), TypeError, "floating-point"),
    ([0.0, 0.0], TypeError, "float tensor"),
    (torch.tensor([0.0, float("nan")]), ValueError, "finite"),
])
def test_bad_sinks(bad: object, exc: type, words: str) -> None:
    q, k, v, _ = _inputs(dict(hq=2, hkv=2, nq=4, nk=4))
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        az.attention(q, k, v, sinks=bad)


def test_named_backend_without_lse_gradient_refuses() -> None:
    q, k, v, sinks = _inputs(dict(hq=2, hkv=2, nq=4, nk=4))
    with pytest.raises(ValueError, match="sinks with gradients"):
        az.attention(q.requires_grad_(), k, v, sinks=sinks, backend="flex")
    with pytest.raises(ValueError, match="return_lse"):
        az.attention(q, k, v, sinks=sinks, backend="sdpa", return_lse=True)
