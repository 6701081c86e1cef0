"""Half precision (issue 14): no overflow on any backend, exact one-key rows, and a measured
(not flag-inferred) choice between native half matmuls and float32 math on CPU."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

import attnzoo as az
from attnzoo.functional.backends import halfmath
from attnzoo.functional.backends.tiled import native_half_matmul
from attnzoo.functional.backends.tiled_ops import tiled_op_attention
from attnzoo.functional.core._request import build_request
from attnzoo.functional.softmax.attention import choose_backend
from attnzoo.oracle import oracle_attention

BACKENDS = ("reference", "sdpa", "tiled", "flex")
HALVES = (torch.float16, torch.bfloat16)


@pytest.fixture(params=["native", "float32"])
def half_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both math paths for half inputs, whatever this CPU measures."""
    halfmath.set_half_math(request.param)
    yield request.param
    halfmath.set_half_math(None)


def _run(backend: str, *args: torch.Tensor, **kw: object) -> torch.Tensor:
    if backend == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    out = az.attention(*args, backend=backend, **kw)
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("backend", (*BACKENDS, "auto"))
def test_float16_scores_do_not_overflow(backend: str, half_mode: str) -> None:
    q = torch.zeros(1, 1, 4, 16, dtype=torch.half)
    q[..., 0] = 8
    # k a copy of q: compiled flex crashed inside dynamo's recompilation guard when q is k
    # (AttributeError 'NoneType' object has no attribute 'fn', torch 2.13, after other flex calls)
    out = _run(backend, q, q.clone(), torch.ones_like(q))
    assert torch.equal(out, torch.ones_like(out))


def test_half_module_has_no_nan(half_mode: str) -> None:
    m = az.MultiHeadAttention(64, 4, causal=True).half()
    with torch.no_grad():
        y = m(4 * torch.randn(1, 256, 64).half())
    assert torch.isfinite(y).all()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_visible_key_is_exact(backend: str, dtype: torch.dtype, half_mode: str) -> None:
    q, k, v = (torch.randn(1, 2, 1, 16).to(dtype) for _ in range(3))
    assert torch.equal(_run(backend, q, k, v), v)
    # the first query row of a causal square sees only key 0, whatever the score scale
    q, k, v = (8 * torch.randn(1, 2, 40, 16).to(dtype) for _ in range(3))
    out = _run(backend, q, k, v, causal=True)
    assert torch.equal(out[:, :, 0], v[:, :, 0])


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """A plain eager implementation in the inputs' dtype (the accuracy yardstick)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    n = q.shape[2]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize(("magnitude", "softcap"), [(30.0, None), (300.0, 50.0)])
def test_large_scores_within_twice_eager_error(dtype: torch.dtype, magnitude: float, softcap: float | None,
                                               half_mode: str) -> None:
    """Scores up to +-magnitude: every backend's error vs float64 is at most 2x plain eager's."""
    n, d = 96, 32
    root = math.sqrt(magnitude * math.sqrt(d))
    q, k = (root * torch.nn.functional.normalize(torch.randn(1, 2, n, d), dim=-1) for _ in range(2))
    q, k, v = q.to(dtype), k.to(dtype), torch.randn(1, 2, n, d).to(dtype)
    ref, _ = oracle_attention(q, k, v, causal=True, softcap=softcap)
    bound = 2 * (_eager(q, k, v, softcap).double() - ref).abs().max().item() + 1e-3
    for backend in ("reference", "tiled", "auto") + (() if softcap else ("sdpa",)):
        out = az.attention(q, k, v, causal=True, softcap=softcap, backend=backend)
        assert (out.double() - ref).abs().max().item() <= bound, backend


def test_auto_sends_half_to_sdpa_whatever_the_math(half_mode: str) -> None:
    from attnzoo.functional.core._request import build_request

    q = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    r = build_request(q, q, q, mask=None, causal=True, window=None, q_offset=None, scale=None, softcap=None,
                      alibi_slopes=None, dropout_p=0.0, return_lse=False, return_weights=False)
    assert choose_backend(r) == "sdpa"
    assert native_half_matmul(torch.bfloat16, "cpu") == (half_mode == "native")
    assert native_half_matmul(torch.bfloat16, "cuda")


def test_half_math_is_measured_and_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTNZOO_HALF_MATH", raising=False)
    monkeypatch.setattr(halfmath, "_measured", {})
    calls: list[torch.dtype] = []

    def fake(dtype: torch.dtype, *a: object, **k: object) -> tuple[float, float]:
        calls.append(dtype)
        return (1.0, 0.5) if dtype == torch.bfloat16 else (1.0, 2.0)  # bf16 fast, fp16 slow

    monkeypatch.setattr(halfmath, "calibrate", fake)
    assert halfmath.half_math(torch.bfloat16, "cpu") == torch.bfloat16
    assert halfmath.half_math(torch.float16, "cpu") == torch.float32
    assert halfmath.half_math(torch.bfloat16, "cpu") == torch.bfloat16
    assert calls == [torch.bfloat16, torch.float16]  # once per dtype
    assert halfmath.half_math(torch.float32, "cpu") == torch.float32
    assert halfmath.half_math(torch.float16, "cuda") == torch.float16
    t32, th = halfmath.calibrate(torch.bfloat16, repeats=1, size=16, depth=8)  # the real timer runs
    assert t32 > 0 and th > 0


def test_sdpa_half_math_is_calibrated_on_sdpa_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDPA backend asks about SDPA (its CPU kernel accumulates half inputs in float32), the tiled
    kernels about the matmul; each answer is cached per (dtype, kernel). SDPA picks the faster of
    native and via-float32 (conversions are in its timing), the matmul keeps its 1.25x margin."""
    monkeypatch.delenv("ATTNZOO_HALF_MATH", raising=False)
    monkeypatch.setattr(halfmath, "_measured", {})
    real_calibrate = halfmath.calibrate
    calls: list[tuple[torch.dtype, str]] = []

    def fake(dtype: torch.dtype, *a: object, kernel: str = "matmul", **k: object) -> tuple[float, float]:
        calls.append((dtype, kernel))
        return (1.0, 1.2) if kernel == "matmul" else (1.0, 1.05)  # matmul within margin, sdpa slower

    monkeypatch.setattr(halfmath, "calibrate", fake)
    assert halfmath.half_math(torch.bfloat16, "cpu") == torch.bfloat16
    assert halfmath.half_math(torch.bfloat16, "cpu", kernel="sdpa") == torch.float32
    assert halfmath.half_math(torch.bfloat16, "cpu", kernel="sdpa") == torch.float32
    assert calls == [(torch.bfloat16, "matmul"), (torch.bfloat16, "sdpa")]
    for kernel in ("sdpa", "matmul"):
        t32, th = real_calibrate(torch.float16, repeats=1, size=16, depth=8, kernel=kernel)  # real timers
        assert t32 > 0 and th > 0
    with pytest.raises(ValueError, match="calibrate: kernel must be"):
        real_calibrate(torch.float16, kernel="conv")
    for mode in ("native", "float32", None):  # a bad kernel is refused whatever the mode or dtype
        halfmath.set_half_math(mode)
        try:
            with pytest.raises(ValueError, match=r"half_math: kernel must be one of \['matmul', 'sdpa'\], got 'conv'"):
                halfmath.half_math(torch.float32, "cpu", kernel="conv")
        finally:
            halfmath.set_half_math(None)


def test_half_math_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNZOO_HALF_MATH", "float32")
    assert halfmath.half_math(torch.bfloat16, "cpu") == torch.float32
    halfmath.set_half_math("native")
    try:
        assert halfmath.half_math(torch.bfloat16, "cpu") == torch.bfloat16  # the function wins
    finally:
        halfmath.set_half_math(None)
    with pytest.raises(ValueError, match="half math mode"):
        halfmath.set_half_math("fast")
    monkeypatch.setenv("ATTNZOO_HALF_MATH", "turbo")
    with pytest.raises(ValueError, match="ATTNZOO_HALF_MATH"):
        halfmath.half_math(torch.bfloat16, "cpu")


@pytest.mark.parametrize("compiled_path", [False, True], ids=["eager", "custom-op"])
def test_float16_tiled_gradients_do_not_overflow(half_mode: str, compiled_path: bool) -> None:
    """Large dO and V make ``dP = dO V^T`` leave the float16 range although every true gradient
    is small (equal value rows: dS = 0, so dq = dk = 0): the backward must not return inf/NaN."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 1, 2, 16, 16
    q, k = (torch.randn(B, H, N, D, generator=g) for _ in range(2))
    v = torch.full((B, H, N, D), 100.0) + torch.randn(B, H, 1, D, generator=g)  # equal rows, |v| ~ 400
    d_out = 300.0 * torch.randn(B, H, N, D, generator=g).sign()  # |dO| ~ 1200 per row
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    oracle_attention(*leaves64, causal=True)[0].backward(d_out.double())
    leaves16 = [t.half().requires_grad_() for t in (q, k, v)]
    if compiled_path:
        r = build_request(*leaves16, mask=None, causal=True, window=None, q_offset=None, scale=None, softcap=None,
                          alibi_slopes=None, dropout_p=0.0, return_lse=False, return_weights=False)
        out = tiled_op_attention(r)[0]
    else:
        out = az.attention(*leaves16, causal=True, backend="tiled")
    out.backward(d_out.half())
    ds_scale = (d_out.norm(dim=-1).amax() * v.norm(dim=-1).amax()).item()  # the size of dP = dO V^T
    for name, a, b in zip("qkv", leaves16, leaves64, strict=True):
        assert a.grad is not None and b.grad is not None
        assert bool(torch.isfinite(a.grad).all()), f"d{name} has inf/NaN ({half_mode})"
        err = (a.grad.double() - b.grad).abs().max().item()
        tol = max(2e-3 * b.grad.abs().max().item(), 1e-7 * ds_scale)  # float16 rounding of O enters delta
        assert err <= tol, f"d{name}: max error {err} > {tol} ({half_mode}, {compiled_path=})"
