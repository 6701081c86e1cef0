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
from attnzoo.functional.backends import halfmath
from attnzoo.oracle import oracle_attention, visible_table

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


# ----------------------------------------------------------------------------- issue 33: items 3, 4, 5, 8
FEW = settings(max_examples=25, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def non_finite_cases(draw: st.DrawFn) -> tuple:
    """Random shapes, masks, backends (sinks, sigmoid) with one NaN/inf entry in q, k or v."""
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    nq, nk, d = draw(st.integers(1, 7)), draw(st.integers(1, 9)), draw(st.sampled_from([1, 4]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(b, hkv * group, nq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, nk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, nk, d, generator=gen, dtype=torch.float64)
    kind = draw(st.sampled_from(["causal", "window", "bool_padding", "float_padding", "mask_object", "bool_tensor"]))
    kw: dict = {}
    if kind in ("causal", "window"):
        kw["causal"] = True
        if kind == "window":
            kw["window"] = draw(st.integers(0, 3))
    elif kind == "bool_tensor":
        kw["mask"] = torch.rand(b, 1, nq, nk, generator=gen) < 0.6
    else:
        real = torch.rand(b, nk, generator=gen) < 0.7
        kw["mask"] = {"bool_padding": real[:, None, None, :], "mask_object": M.key_padding(real),
                      "float_padding": torch.zeros(b, 1, 1, nk, dtype=torch.float64).masked_fill(
                          ~real[:, None, None, :], float("-inf"))}[kind]
    where = draw(st.sampled_from(["q", "k", "v"]))
    t = {"q": q, "k": k, "v": v}[where]
    idx = tuple(draw(st.integers(0, s - 1)) for s in t.shape)
    t[idx] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    call = draw(st.sampled_from(["reference", "sdpa", "tiled", "sigmoid-reference", "sigmoid-tiled"]))
    sinks = draw(st.booleans()) and not call.startswith("sigmoid")
    return q, k, v, kw, call, sinks


@FEW
@given(non_finite_cases())
def test_non_finite_inputs_change_only_their_rows(case: tuple) -> None:
    """Issue 33, item 5: a NaN/inf in q, k or v changes only the rows that see it (or own it), forward
    and gradients, on every backend, with sinks and for sigmoid attention (float64 oracle)."""
    from nonfinite_oracle import check

    q, k, v, kw, call, sinks = case
    dtype = torch.float32 if call == "sdpa" else torch.float64
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kw = {n: (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    z = torch.linspace(-1.0, 1.0, q.shape[1]) if sinks else None
    if call.startswith("sigmoid"):
        backend = call.split("-")[1]
        check(lambda q, k, v, s: az.sigmoid_attention(q, k, v, backend=backend, **kw), q, k, v, kw, score="sigmoid")
    else:
        check(lambda q, k, v, s: az.attention(q, k, v, backend=call, sinks=s, **kw), q, k, v, kw, sinks=z)


def _variant(name: str) -> torch.nn.Module:
    from attnzoo.variants import VARIANTS, build_attention

    torch.manual_seed(0)
    return build_attention(name, 32, 4, causal=True, **VARIANTS[name].check).eval()


VARIANT_NAMES = sorted(__import__("attnzoo.variants", fromlist=["VARIANTS"]).VARIANTS)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VARIANT_NAMES), st.integers(0, 2), st.integers(0, 3), st.integers(0, 4),
       st.sampled_from(["KeyboardInterrupt", "RuntimeError", "float64 x"]), st.integers(0, 20))
def test_cached_calls_are_all_or_nothing(name: str, batch_minus_1: int, empty_steps: int, fail_step: int,
                                         failure: str, pick: int) -> None:
    """Issue 33, items 3-4: decoding with empty calls and one failed call (in a random submodule of the
    step, or a wrong dtype) mixed in gives the outputs of a plain decode; the failed and empty calls
    leave ``cache.length`` where it was."""
    m, batch = _variant(name), batch_minus_1 + 1
    x = torch.randn(batch, 8, 32, generator=torch.Generator().manual_seed(pick))
    with torch.no_grad():
        ref_cache = m.init_cache(batch, 8)
        ref = torch.cat([m(x[:, :3], cache=ref_cache)] + [m(x[:, i:i + 1], cache=ref_cache) for i in range(3, 8)], 1)
        cache = m.init_cache(batch, 8)
        outs = [m(x[:, :3], cache=cache)]
        for i in range(3, 8):
            if i == 3 + fail_step:
                before = cache.length
                for _ in range(empty_steps):
                    assert m(x[:, :0], cache=cache).shape == (batch, 0, 32)
                if failure == "float64 x":
                    with pytest.raises(TypeError, match=r"\bx\b"):
                        m(x[:, i:i + 1].double(), cache=cache)
                else:
                    subs = [s for n, s in m.named_modules() if n]
                    exc = KeyboardInterrupt if failure == "KeyboardInterrupt" else RuntimeError

                    def boom(*args: object, exc: type[BaseException] = exc) -> None:
                        raise exc("injected")

                    hook = subs[pick % len(subs)].register_forward_hook(boom)
                    try:
                        out = m(x[:, i:i + 1], cache=cache)  # the submodule may not run in this step
                    except (KeyboardInterrupt, RuntimeError):
                        out = None
                    finally:
                        hook.remove()
                    if out is not None:  # no failure: that call was this step
                        outs.append(out)
                        continue
                assert cache.length == before
            outs.append(m(x[:, i:i + 1], cache=cache))
    assert (torch.cat(outs, 1) - ref).abs().max().item() <= 1e-6


@FEW
@given(st.integers(0, 9), st.integers(0, 5), st.integers(1, 4), st.integers(2, 12), st.integers(1, 11))
def test_streaming_left_padding_equals_the_row_alone(pad: int, window: int, sinks: int, n: int, split: int) -> None:
    """Issue 33, item 8: StreamingLLM over a left-padded row (full forward and chunked prefill + decode
    through its sink/ring cache) equals the row alone: its sinks are its first real tokens."""
    from attnzoo.models._common import positions_from_mask

    torch.manual_seed(pad * 7 + window)
    m = az.SlidingWindowAttention(16, 2, window=window, sink_tokens=sinks, rope=True).eval()
    row, other = torch.randn(1, n, 16), torch.randn(1, n + pad, 16)
    x = torch.cat([other, torch.cat([torch.zeros(1, pad, 16), row], 1)])
    real = torch.ones(2, n + pad, dtype=torch.bool)
    real[1, :pad] = False
    pos = positions_from_mask(real)
    split = min(split, n + pad - 1)
    with torch.no_grad():
        alone = m(row)
        full = m(x, mask=real[:, None, None, :], positions=pos)
        cache = m.init_cache(2, n + pad)
        dec = [m(x[:, :split], cache=cache, mask=real[:, None, None, :split], positions=pos[:, :split])]
        dec += [m(x[:, t:t + 1], cache=cache, mask=real[:, None, None, :t + 1], positions=pos[:, t:t + 1])
                for t in range(split, n + pad)]
    assert (full[1, pad:] - alone[0]).abs().max().item() <= 1e-5
    assert (torch.cat(dec, 1) - full).abs().max().item() <= 1e-5
