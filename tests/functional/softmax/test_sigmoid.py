"""Sigmoid attention: reference and tiled forms vs a float64 oracle written from the definition."""

from __future__ import annotations

import math

import pytest
import torch

import attnzoo as az
from attnzoo import masks


def oracle(q, k, v, *, bias=None, causal=False, window=None, q_offset=None, allowed=None, softcap=None):
    """out_i = sum_j sigmoid(scale q_i.k_j + b) v_j over visible j, b = -log(Nk) by default."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    nq, nk = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    off = nk - nq if q_offset is None else q_offset
    p_q, p_k = torch.arange(nq).view(-1, 1) + off, torch.arange(nk).view(1, -1)
    ok = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        ok &= p_k <= p_q
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        ok &= (p_k >= p_q - left) & (p_k <= p_q + right)
    if allowed is not None:
        ok = ok & allowed
    w = torch.sigmoid(s + (-math.log(nk) if bias is None else bias)) * ok
    return w @ v


CASES = [
    dict(hq=4, hkv=4, nq=33, nk=33),
    dict(hq=4, hkv=2, nq=33, nk=33, causal=True, bias=-1.5),
    dict(hq=4, hkv=1, nq=9, nk=40, window=(4, 2), softcap=3.0),
    dict(hq=2, hkv=2, nq=12, nk=7, causal=True),  # default alignment: first rows see nothing
    dict(hq=2, hkv=2, nq=8, nk=20, causal=True, q_offset=5),
    dict(hq=2, hkv=1, nq=300, nk=300, causal=True, window=(70, 0)),  # several tiles, some skipped
]


def _inputs(c: dict):
    q = torch.randn(2, c["hq"], c["nq"], 16)
    k = torch.randn(2, c["hkv"], c["nk"], 16)
    v = torch.randn(2, c["hkv"], c["nk"], 8)
    return q, k, v


def _kw(c: dict) -> dict:
    return {n: c[n] for n in ("bias", "causal", "window", "q_offset", "softcap") if n in c}


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_oracle_forward_and_backward(backend: str, case: dict) -> None:
    q, k, v = (t.requires_grad_() for t in _inputs(case))
    out = az.sigmoid_attention(q, k, v, backend=backend, **_kw(case))
    want = oracle(q, k, v, **_kw(case))
    assert out.shape == want.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(want)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    exp = torch.autograd.grad((want * g).sum(), (q, k, v))
    for name, a, b in zip(["q", "k", "v"], got, exp, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, n=name: f"{backend} d{n} {case}: {m}")


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_mask_object_and_bool_tensor(backend: str) -> None:
    q, k, v = _inputs(dict(hq=4, hkv=2, nq=150, nk=150))
    m = masks.causal() & (masks.sliding_window(20, 0) | masks.global_tokens([0, 1]))
    dense = m.materialize(1, 1, 150, 150)[0, 0]
    want = oracle(q, k, v, allowed=dense)
    torch.testing.assert_close(az.sigmoid_attention(q, k, v, mask=m, backend=backend).double(), want,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(az.sigmoid_attention(q, k, v, mask=dense, backend=backend).double(), want,
                               atol=1e-5, rtol=1e-5)


def test_alibi_and_float_mask_are_additive() -> None:
    q, k, v = _inputs(dict(hq=2, hkv=2, nq=10, nk=10))
    slopes = torch.tensor([0.1, 0.5])
    fm = torch.randn(10, 10)
    dist = (torch.arange(10).view(-1, 1) - torch.arange(10).view(1, -1)).abs()
    bias_full = -slopes.view(1, 2, 1, 1) * dist + fm  # [1, 2, 10, 10]
    ref = az.sigmoid_attention(q, k, v, alibi_slopes=slopes, mask=fm, backend="reference")
    tiled = az.sigmoid_attention(q, k, v, alibi_slopes=slopes, mask=fm, backend="tiled")
    s = q.double() @ k.double().transpose(-1, -2) / 4 + bias_full.double()
    want = torch.sigmoid(s - math.log(10)) @ v.double()
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tiled.double(), want, atol=1e-5, rtol=1e-5)


def test_default_bias_is_minus_log_nk_and_weights() -> None:
    q, k, v = _inputs(dict(hq=2, hkv=2, nq=5, nk=9))
    a = az.sigmoid_attention(q, k, v)
    b = az.sigmoid_attention(q, k, v, bias=-math.log(9))
    torch.testing.assert_close(a, b)
    out, w = az.sigmoid_attention(q, k, v, causal=True, return_weights=True)
    assert w.shape == (2, 2, 5, 9) and (w[..., -1:, :] > 0).all() and (w[:, :, 0, 5:] == 0).all()
    torch.testing.assert_close(out, w @ v)


def test_half_precision_close() -> None:
    q, k, v = _inputs(dict(hq=2, hkv=1, nq=64, nk=64))
    want = oracle(q, k, v, causal=True)
    got = az.sigmoid_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, backend="tiled")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_float64_tiled() -> None:
    q, k, v = (t.double().requires_grad_() for t in _inputs(dict(hq=2, hkv=1, nq=40, nk=40)))
    assert torch.autograd.gradcheck(lambda a, b, c: az.sigmoid_attention(a, b, c, causal=True, backend="tiled"),
                                    (q[:1, :, :6], k[:1, :, :6], v[:1, :, :6]))


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(bias="x"), TypeError, "bias must be a float"),
    (dict(bias=float("inf")), ValueError, "bias must be finite"),
    (dict(backend="sdpa"), ValueError, "backend must be one of"),
    (dict(backend="tiled", return_weights=True), ValueError, "return_weights"),
    (dict(window=-1), ValueError, "window"),
])
def test_bad_input(kwargs: dict, exc: type, words: str) -> None:
    q, k, v = _inputs(dict(hq=2, hkv=2, nq=4, nk=4))
    with pytest.raises(exc, match=words):
        az.sigmoid_attention(q, k, v, **kwargs)


def test_tiled_never_forms_the_score_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward evaluate the sigmoid on tiles only (memory O(N x block))."""
    seen: list[int] = []
    real = torch.sigmoid

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.numel())
        return real(x)

    monkeypatch.setattr(torch, "sigmoid", spy)
    q, k, v = (t.requires_grad_() for t in _inputs(dict(hq=2, hkv=1, nq=1200, nk=1200)))
    az.sigmoid_attention(q, k, v, causal=True, backend="tiled").sum().backward()
    full = 2 * 2 * 1200 * 1200
    assert seen and max(seen) <= full // 4, (max(seen), full)
