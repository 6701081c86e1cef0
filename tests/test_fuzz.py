"""Property-based fuzzing of ``attnzoo.attention`` against the dense float64 oracle (issue 14).

Backends x dtypes (float32, bfloat16, float16) x masks (none, causal, window, padding, ``Mask``
objects) x GQA x empty/degenerate shapes x score magnitudes (up to +-30, and +-300 with a
softcap). Tolerances are scaled to the dtype: a half-precision result may be off by at most twice
what a plain eager implementation in that dtype is off (plus a floor of a few ulps), a float32
result by float32 rounding. Bounded: ``max_examples`` per property and no deadline, derandomised
so the default run is reproducible (a few seconds in all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnzoo as az
from attnzoo import masks as M
from attnzoo.functional import halfmath
from oracle import oracle_attention, visible_table

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # flex's eager-mode notice

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Error floor per dtype, in units of the largest |value| (four ulps; float32 a few more).
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,
         torch.float16: 4 * torch.finfo(torch.float16).eps}
MASKS = ("none", "causal", "window", "padding", "mask_object", "bool_tensor")


@dataclass
class Case:
    backend: str
    dtype: torch.dtype
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict
    oracle_kwargs: dict
    return_lse: bool
    half_math: str  # "native" | "float32": both paths of half inputs, whatever this CPU measures


def _scaled(shape: tuple[int, ...], magnitude: float, gen: torch.Generator) -> torch.Tensor:
    """Random rows of norm ``sqrt(magnitude * sqrt(D))``, so that ``|q.k| / sqrt(D) <= magnitude``."""
    x = torch.randn(shape, generator=gen)
    if magnitude <= 0:
        return x
    return torch.nn.functional.normalize(x, dim=-1) * math.sqrt(magnitude * math.sqrt(shape[-1]))


@st.composite
def cases(draw: st.DrawFn, backends: tuple[str, ...] = ("reference", "sdpa", "tiled", "flex", "auto")) -> Case:
    b = draw(st.sampled_from([0, 1, 2]) if draw(st.booleans()) else st.just(1))
    hkv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    nq, nk = draw(st.integers(0, 12)), draw(st.integers(0, 20))
    d = draw(st.sampled_from([1, 4, 8, 16]))
    dv = draw(st.sampled_from([d, 5]))
    dtype = draw(st.sampled_from(DTYPES))
    scores = draw(st.sampled_from(["small", "large", "huge"]))  # randn, +-30, +-300 with a softcap
    magnitude = {"small": 0.0, "large": 30.0, "huge": 300.0}[scores]
    softcap = draw(st.sampled_from([20.0, 50.0])) if scores == "huge" else None
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = _scaled((b, hkv * group, nq, d), magnitude, gen).to(dtype)
    k = _scaled((b, hkv, nk, d), magnitude, gen).to(dtype)
    v = torch.randn(b, hkv, nk, dv, generator=gen).to(dtype)
    kwargs: dict = {"softcap": softcap}
    oracle_kwargs: dict = {"softcap": softcap}
    kind = draw(st.sampled_from(MASKS))
    if kind == "causal":
        kwargs["causal"] = oracle_kwargs["causal"] = True
    elif kind == "window":
        w = (draw(st.none() | st.integers(0, 6)), draw(st.none() | st.integers(0, 6)))
        kwargs["window"] = oracle_kwargs["window"] = w
        kwargs["causal"] = oracle_kwargs["causal"] = draw(st.booleans())
    elif kind == "padding" and b > 0:
        lengths = [draw(st.integers(0, nk)) for _ in range(b)]
        kwargs["mask"] = oracle_kwargs["mask"] = M.key_padding(lengths)
    elif kind == "mask_object":
        mask = M.sliding_window(draw(st.integers(0, 5)), draw(st.none() | st.integers(0, 3)))
        kwargs["mask"] = oracle_kwargs["mask"] = mask | M.global_tokens([0]) if draw(st.booleans()) else mask
    elif kind == "bool_tensor":
        t = torch.rand(b, 1, nq, nk, generator=gen) < 0.7
        kwargs["mask"] = oracle_kwargs["mask"] = t
    if draw(st.booleans()) and nq <= nk + 3:
        kwargs["q_offset"] = oracle_kwargs["q_offset"] = draw(st.integers(0, 4))
    return Case(draw(st.sampled_from(backends)), dtype, q, k, v, kwargs, oracle_kwargs, draw(st.booleans()),
                draw(st.sampled_from(["native", "float32"])))


def _eager_errors(c: Case, ref: torch.Tensor, ref_lse: torch.Tensor, seen: torch.Tensor) -> tuple[float, float]:
    """Max errors (output, LSE) of a plain eager implementation in ``c.dtype`` over rows that see a key."""
    if not seen.any():
        return 0.0, 0.0
    group = c.q.shape[1] // c.k.shape[1]
    k, v = c.k.repeat_interleave(group, 1), c.v.repeat_interleave(group, 1)
    s = c.q @ k.transpose(-1, -2) / math.sqrt(c.q.shape[-1])
    if c.kwargs["softcap"] is not None:
        s = torch.tanh(s / c.kwargs["softcap"]) * c.kwargs["softcap"]
    ok = visible_table(*c.q.shape[:3], c.k.shape[2], **_visibility(c))
    s = s.masked_fill(~ok, float("-inf"))
    out = torch.softmax(s, dim=-1) @ v
    lse = torch.logsumexp(s, dim=-1)
    return (out.double() - ref).abs()[seen].max().item(), (lse.double() - ref_lse).abs()[seen].max().item()


def _visibility(c: Case) -> dict:
    return {k: v for k, v in c.oracle_kwargs.items() if k in ("causal", "window", "q_offset", "mask")}


def _tolerances(c: Case, ref: torch.Tensor, ref_lse: torch.Tensor, seen: torch.Tensor) -> tuple[float, float]:
    """(output, LSE) tolerances: float32 rounding, or for half inputs the larger of four ulps and
    twice a plain eager implementation's error in that dtype."""
    scale = max(1.0, c.v.abs().max().item() if c.v.numel() else 1.0)
    lse_scale = 1.0 + (ref_lse.abs()[seen].max().item() if seen.any() else 0.0)
    out_tol, lse_tol = FLOOR[c.dtype] * scale, FLOOR[c.dtype] * lse_scale
    if c.dtype == torch.float32:
        return 10 * out_tol, 10 * lse_tol
    eager_out, eager_lse = _eager_errors(c, ref, ref_lse, seen)
    return max(out_tol, 2 * eager_out), max(lse_tol, 2 * eager_lse)


def _expect_refusal(c: Case) -> bool:
    return c.backend == "sdpa" and (c.return_lse or c.kwargs["softcap"] is not None)


def _attend(c: Case, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    halfmath.set_half_math(c.half_math)
    try:
        return az.attention(c.q, k, v, backend=c.backend, return_lse=c.return_lse, **c.kwargs)
    finally:
        halfmath.set_half_math(None)


@FUZZ
@given(cases())
def test_every_backend_matches_the_oracle(c: Case) -> None:
    if c.backend == "flex" and "flex" not in az.functional.available_backends("cpu"):
        return
    if _expect_refusal(c):
        with pytest.raises(ValueError, match="does not support"):
            _attend(c, c.k, c.v)
        return
    res = _attend(c, c.k, c.v)
    out, lse = res if c.return_lse else (res, None)
    ref, ref_lse = oracle_attention(c.q, c.k, c.v, **c.oracle_kwargs)
    assert out.shape == ref.shape and out.dtype == c.dtype
    seen = torch.isfinite(ref_lse)  # rows with at least one visible key
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))  # the others are exact zeros
    tol, lse_tol = _tolerances(c, ref, ref_lse, seen)
    err = (out.double() - ref).abs()[seen]
    assert err.numel() == 0 or err.max().item() <= tol, (err.max().item(), tol)
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), ~seen)
        lse_err = (lse.double() - ref_lse).abs()[seen]
        assert lse_err.numel() == 0 or lse_err.max().item() <= lse_tol, (lse_err.max().item(), lse_tol)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases(backends=("reference", "sdpa", "tiled", "auto")), st.sampled_from(["k", "v"]),
       st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_hidden_non_finite_keys_change_no_row(c: Case, where: str, value: float) -> None:
    """A non-finite key or value changes only the rows that see it (they become non-finite)."""
    if _expect_refusal(c) or c.k.shape[2] == 0 or c.q.numel() == 0:
        return
    clean = _attend(c, c.k, c.v)
    clean = clean[0] if isinstance(clean, tuple) else clean
    j = c.k.shape[2] - 1
    k, v = c.k.clone(), c.v.clone()
    (k if where == "k" else v)[:, 0, j, 0] = value
    out = _attend(c, k, v)
    out = out[0] if isinstance(out, tuple) else out
    sees = visible_table(*c.q.shape[:3], c.k.shape[2], **_visibility(c))[..., j].clone()  # [B, Hq, Nq]
    sees[:, c.q.shape[1] // c.k.shape[1]:] = False  # only KV head 0's query heads read key j
    # equal up to rounding (the tiled backend's score bound may take another path without the key)
    torch.testing.assert_close(out[~sees], clean[~sees], atol=FLOOR[c.dtype], rtol=FLOOR[c.dtype])
