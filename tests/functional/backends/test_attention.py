"""Every backend against the independent float64 oracle (tests/oracle.py): forward, LSE and
gradients, over a property grid."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnzoo as az
import attnzoo.functional.backends.flex as flex_mod
import attnzoo.functional.backends.tiled as tiled_mod
import attnzoo.functional.backends.tiled.backward as tiled_backward
import attnzoo.functional.backends.tiled.forward as tiled_forward
from attnzoo import masks as M
from attnzoo.functional import choose_backend
from attnzoo.functional.backends.tiled import DEFAULT_TILES, TileConfig, use_tiles
from attnzoo.functional.core._request import build_request
from attnzoo.oracle import oracle_attention, visible_table

#: Tiny tiles so that small inputs exercise many tiles, chunk merging and skipping.
SMALL_TILES = TileConfig(block_q=8, block_k=4, max_chunk_k=12, merge_k=8)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test of this module runs the tiled backend with ``SMALL_TILES`` unless it says otherwise."""
    monkeypatch.setattr(flex_mod, "COMPILE", False)
    with use_tiles(SMALL_TILES):
        yield


@st.composite
def cases(draw: st.DrawFn) -> dict:
    hkv = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 2, 3]))
    case = {
        "B": draw(st.sampled_from([1, 2])),
        "Hq": hkv * g,
        "Hkv": hkv,
        "Nq": draw(st.integers(1, 37)),
        "Nk": draw(st.integers(1, 37)),
        "D": draw(st.sampled_from([4, 8])),
        "Dv": draw(st.sampled_from([4, 6])),
    }
    kw: dict = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        left = draw(st.one_of(st.none(), st.integers(0, 9)))
        right = draw(st.one_of(st.none(), st.integers(0, 9)))
        kw["window"] = (left, right)
    if draw(st.booleans()):
        kw["q_offset"] = draw(st.integers(-4, 12))
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "padding", "doc_global"]))
    kw["_mask"] = mask_kind
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([1.0, 5.0]))
    if draw(st.booleans()):
        kw["_alibi"] = True
    if draw(st.booleans()):
        kw["scale"] = draw(st.sampled_from([0.1, 1.0]))
    case["kw"] = kw
    return case


def make(case: dict, dtype: torch.dtype = torch.float64) -> tuple:
    B, Hq, Hkv, Nq, Nk, D, Dv = (case[k] for k in ("B", "Hq", "Hkv", "Nq", "Nk", "D", "Dv"))
    gen = torch.Generator().manual_seed(Nq * 131 + Nk)
    q = torch.randn(B, Hq, Nq, D, generator=gen, dtype=dtype) * 1.5
    k = torch.randn(B, Hkv, Nk, D, generator=gen, dtype=dtype) * 1.5
    v = torch.randn(B, Hkv, Nk, Dv, generator=gen, dtype=dtype)
    kw = {k2: v2 for k2, v2 in case["kw"].items() if not k2.startswith("_")}
    kind = case["kw"]["_mask"]
    if kind == "bool":
        kw["mask"] = torch.rand(B, 1, Nq, Nk, generator=gen) > 0.3
    elif kind == "float":
        fm = torch.randn(1, Hq, Nq, Nk, generator=gen, dtype=dtype)
        kw["mask"] = fm.masked_fill(torch.rand(1, Hq, Nq, Nk, generator=gen) > 0.8, float("-inf"))
    elif kind == "padding":
        kw["mask"] = M.key_padding(torch.randint(0, Nk + 1, (B,), generator=gen))
    elif kind == "doc_global":
        ids = torch.randint(0, 3, (B, max(Nk, Nq + kw.get("q_offset", Nk - Nq), 1)), generator=gen).sort(-1).values
        kw["mask"] = M.document(ids) | M.global_tokens([0])
    if case["kw"].get("_alibi"):
        kw["alibi_slopes"] = torch.linspace(0.1, 1.0, Hq, dtype=dtype)
    return q, k, v, kw


def convert(kw: dict, dtype: torch.dtype) -> dict:
    out = {}
    for key, val in kw.items():
        out[key] = val.to(dtype) if isinstance(val, torch.Tensor) and val.is_floating_point() else val
    return out


def check_backend(backend: str, case: dict, dtype: torch.dtype = torch.float32) -> None:
    q, k, v, kw = make(case)
    r = build_request(q, k, v, mask=kw.get("mask"), causal=kw.get("causal", False), window=kw.get("window"),
                      q_offset=kw.get("q_offset"), scale=kw.get("scale"), softcap=kw.get("softcap"),
                      alibi_slopes=kw.get("alibi_slopes"), dropout_p=0.0, return_lse=True, return_weights=False)
    from attnzoo.functional.softmax.attention import _missing

    grads = backend != "flex"  # FlexAttention has no CPU backward
    if _missing(r, backend) - {"return_lse", "float64"}:
        pytest.skip(f"{backend} lacks {_missing(r, backend)}")
    wants_lse = "return_lse" not in _missing(r, backend)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = oracle_attention(qr, kr, vr, **kw)
    q2, k2, v2 = (t.detach().to(dtype).requires_grad_(grads) for t in (q, k, v))
    got = az.attention(q2, k2, v2, backend=backend, return_lse=wants_lse, **convert(kw, dtype))
    out, lse = got if wants_lse else (got, None)
    tol = 2e-5 if dtype == torch.float32 else 1e-9
    assert out.dtype == dtype
    err = (out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    scale = max(1.0, ref_out.abs().max().item() if out.numel() else 1.0)
    assert err <= tol * scale, f"{backend} out err {err:.2e} shapes {case}"
    assert torch.isfinite(out).all()
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{backend} -inf rows differ"
        fin = torch.isfinite(ref_lse)
        lerr = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
        assert lerr <= tol * 10, f"{backend} lse err {lerr:.2e}"
    if not grads:
        return
    g = torch.randn_like(ref_out)
    (ref_out * g).sum().backward()
    (out * g.to(dtype)).sum().backward()
    for name, a, b in (("dq", q2, qr), ("dk", k2, kr), ("dv", v2, vr)):
        assert a.grad is not None and torch.isfinite(a.grad).all(), f"{backend} {name} not finite"
        gerr = (a.grad.double() - b.grad).abs().max().item()
        gscale = max(1.0, b.grad.abs().max().item())
        assert gerr <= 20 * tol * gscale, f"{backend} {name} err {gerr:.2e} shapes {case}"


@pytest.mark.parametrize(("kw", "table"), [
    ({"causal": True}, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
    ({"causal": True, "q_offset": 0}, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]),
    ({"causal": True, "window": (1, 0)}, [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]),
])
def test_oracle_draws_the_tables_of_the_conventions_page(kw: dict, table: list) -> None:
    """The oracle's visibility is the Nq=2, Nk=5 tables of docs/conventions.md, and so is attention's."""
    want = torch.tensor(table, dtype=torch.bool)
    assert torch.equal(visible_table(1, 1, 2, 5, **kw)[0, 0], want)
    q, k = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 5, 4)
    v = torch.eye(5).view(1, 1, 5, 5)  # the output row is the weight row: uniform over visible keys
    for backend in ("reference", "tiled", "sdpa"):
        out = az.attention(q, k, v, backend=backend, **kw)[0, 0]
        assert torch.equal(out > 0, want), (backend, out)


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(cases())
def test_tiled_matches_reference(case: dict) -> None:
    check_backend("tiled", case)


@SETTINGS
@given(cases())
def test_sdpa_matches_reference(case: dict) -> None:
    check_backend("sdpa", case)


@SETTINGS
@given(cases())
def test_reference_float64_matches_oracle(case: dict) -> None:
    check_backend("reference", case, torch.float64)


@settings(max_examples=30, deadline=None)
@given(cases())
def test_auto_matches_reference(case: dict) -> None:
    check_backend("reference", case)  # float32 reference vs the float64 oracle
    q, k, v, kw = make(case, torch.float64)
    auto = az.attention(q.float(), k.float(), v.float(), **convert(kw, torch.float32))
    ref = az.attention(q, k, v, backend="reference", **kw)
    assert (auto.double() - ref).abs().max().item() < 5e-5


FLEX_CASES = [
    {"B": 2, "Hq": 4, "Hkv": 2, "Nq": 19, "Nk": 33, "D": 8, "Dv": 8, "kw": {"causal": True, "_mask": "none"}},
    {"B": 1, "Hq": 2, "Hkv": 1, "Nq": 33, "Nk": 33, "D": 8, "Dv": 8,
     "kw": {"window": (5, 2), "softcap": 5.0, "_mask": "padding", "_alibi": True}},
    {"B": 1, "Hq": 2, "Hkv": 2, "Nq": 7, "Nk": 20, "D": 8, "Dv": 8, "kw": {"causal": True, "q_offset": -3,
                                                                          "_mask": "float"}},
]


@pytest.mark.parametrize("case", FLEX_CASES)
def test_flex_matches_reference(case: dict) -> None:
    if "flex" not in az.available_backends():
        pytest.skip("FlexAttention not available")
    check_backend("flex", case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["tiled", "sdpa", "auto"])
def test_half_precision_error_bounded_by_eager(backend: str, dtype: torch.dtype) -> None:
    """flash-attn's rule: error vs a float64 reference at most twice a plain eager half implementation."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 96, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    ref = az.attention(q, k, v, causal=True, backend="reference")
    qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(32)
    s = s.masked_fill(~M.causal().materialize(1, 1, 96, 96), float("-inf"))
    eager = torch.softmax(s, dim=-1) @ vh
    eager_err = (eager.double() - ref).abs().max().item()
    got = az.attention(qh, kh, vh, causal=True, backend=backend)
    assert got.dtype == dtype
    err = (got.double() - ref).abs().max().item()
    assert err <= 2 * eager_err, f"{backend} {dtype}: err {err:.2e} > 2 x eager {eager_err:.2e}"


@pytest.mark.parametrize("backend", ["reference", "tiled", "sdpa"])
def test_fully_masked_rows_zero_and_finite_grads(backend: str) -> None:
    q = torch.randn(2, 2, 6, 8, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, requires_grad=True)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[:, :, 2] = False  # row 2 sees nothing
    out = az.attention(q, k, v, mask=mask, backend=backend)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, 2], torch.zeros_like(q.grad[:, :, 2]))


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_lse_is_logsumexp_of_scores(backend: str) -> None:
    q, k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    _, lse = az.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    s = s.masked_fill(~M.causal().materialize(1, 1, 9, 13), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, dim=-1), atol=1e-5)


def test_weights_are_softmax_rows() -> None:
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    out, w = az.attention(q, k, v, causal=True, return_weights=True)
    assert w.shape == (1, 2, 5, 7)
    assert torch.allclose(w.sum(-1), torch.ones(1, 2, 5))
    assert torch.allclose(out, w @ v, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_merge_attention_of_two_key_halves(backend: str) -> None:
    q = torch.randn(2, 4, 10, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 30, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 30, 8, dtype=torch.float64, requires_grad=True)
    full, full_lse = az.attention(q, k, v, causal=True, return_lse=True, backend="reference")
    off = 30 - 10
    parts = [az.attention(q, k[:, :, a:b], v[:, :, a:b], causal=True, q_offset=off - a, return_lse=True,
                          backend="reference" if backend == "reference" else "tiled")
             if backend == "reference" else
             az.attention(q.float(), k[:, :, a:b].float(), v[:, :, a:b].float(), causal=True, q_offset=off - a,
                          return_lse=True, backend="tiled")
             for a, b in ((0, 17), (17, 30))]
    out, lse = az.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    tol = 1e-10 if backend == "reference" else 1e-5
    assert (out.double() - full).abs().max() < tol
    assert (lse.double() - full_lse).abs().max() < tol
    g = torch.randn_like(full)
    (full * g).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (out.double() * g).sum().backward()
    for a, b in zip((q, k, v), ref_grads, strict=False):
        assert (a.grad - b).abs().max() < tol * 10


def test_merge_attention_with_empty_part() -> None:
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    o1, l1 = az.attention(q, k, v, return_lse=True)
    o2 = torch.zeros_like(o1)
    l2 = torch.full_like(l1, float("-inf"))
    out, lse = az.merge_attention([o1, o2], [l1, l2])
    assert torch.allclose(out, o1) and torch.allclose(lse, l1)


# ------------------------------------------------------------------ auto policy (docs/backends.md)
def req(**kw):
    q = kw.pop("q", torch.randn(1, 2, 16, 8))
    k = kw.pop("k", torch.randn(1, 2, 16, 8))
    defaults = {"mask": None, "causal": False, "window": None, "q_offset": None, "scale": None, "softcap": None,
                "alibi_slopes": None, "dropout_p": 0.0, "return_lse": False, "return_weights": False}
    defaults.update(kw)
    return build_request(q, k, k, **defaults)


def test_auto_policy_as_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_backend(req(return_weights=True)) == "reference"
    assert choose_backend(req(q=torch.randn(1, 2, 4, 8, dtype=torch.float64),
                              k=torch.randn(1, 2, 4, 8, dtype=torch.float64))) == "reference"
    assert choose_backend(req(dropout_p=0.1)) == "sdpa"
    assert choose_backend(req(dropout_p=0.1, softcap=3.0)) == "reference"
    assert choose_backend(req(return_lse=True)) == "tiled"
    assert choose_backend(req(softcap=2.0)) == "tiled"
    assert choose_backend(req(causal=True)) == "sdpa"
    big = torch.randn(1, 1, 2048, 8)
    assert choose_backend(req(q=big, k=big, causal=True)) == "sdpa"  # dense causal: fused kernel
    assert choose_backend(req(q=big, k=big, causal=True, window=(128, 0))) == "tiled"  # sparse: skip tiles
    assert choose_backend(req(causal=True, window=(2, 0))) == "sdpa"  # tiny: dense kernel wins
    half = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    for mode in ("native", "float32"):  # sdpa either way: it picks its own math dtype
        monkeypatch.setenv("ATTNZOO_HALF_MATH", mode)
        assert choose_backend(req(q=half, k=half)) == "sdpa"


def test_named_backend_refuses_missing_feature() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="return_weights"):
        az.attention(q, q, q, return_weights=True, backend="sdpa")
    with pytest.raises(ValueError, match="softcap"):
        az.attention(q, q, q, softcap=2.0, backend="sdpa")
    with pytest.raises(ValueError, match="dropout"):
        az.attention(q, q, q, dropout_p=0.5, backend="tiled")
    with pytest.raises(ValueError, match="flash"):
        az.attention(q, q, q, backend="flash")


def test_tiled_memory_is_linear_in_n(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward+backward never holds an N x N tensor: the largest score tile is block_q x chunk."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")  # the PyTorch tiled path itself (not its compiled twin)
    tiles = TileConfig(block_q=64, block_k=64, max_chunk_k=256)
    sizes: list[int] = []
    n = 1024
    q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3))
    orig = tiled_forward.tile_scores

    def spy(*a, **kw):
        s, t = orig(*a, **kw)
        sizes.append(s.numel())
        return s, t

    monkeypatch.setattr(tiled_forward, "tile_scores", spy)
    monkeypatch.setattr(tiled_backward, "tile_scores", spy)
    with use_tiles(tiles):
        out = az.attention(q, k, v, causal=True, backend="tiled")
        out.sum().backward()
    assert max(sizes) <= tiles.block_q * tiles.max_chunk_k < n * n


# ------------------------------------------------------------------------------- bad input
Q = torch.randn(2, 4, 5, 8)
K = torch.randn(2, 2, 7, 8)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"q": torch.randn(4, 5, 8)}, ValueError, "rank 4"),
        ({"q": [1, 2]}, TypeError, "torch.Tensor"),
        ({"k": torch.randn(3, 2, 7, 8), "v": torch.randn(3, 2, 7, 8)}, ValueError, "batch"),
        ({"k": torch.randn(2, 3, 7, 8), "v": torch.randn(2, 3, 7, 8)}, ValueError, "Hq % Hkv"),
        ({"k": torch.randn(2, 2, 7, 6)}, ValueError, "head dims"),
        ({"v": torch.randn(2, 2, 6, 8)}, ValueError, "same length"),
        ({"v": torch.randn(2, 1, 7, 8)}, ValueError, "same number of heads"),
        ({"q": torch.randn(2, 4, 5, 8, dtype=torch.float64)}, TypeError, "dtype"),
        ({"q": torch.randint(0, 3, (2, 4, 5, 8))}, TypeError, "float"),
        ({"mask": torch.ones(3, 1, 5, 7, dtype=torch.bool)}, ValueError, "broadcast"),
        ({"mask": torch.ones(5, 6, dtype=torch.bool)}, ValueError, "Nk"),
        ({"mask": torch.ones(5, 7, dtype=torch.int64)}, TypeError, "mask"),
        ({"mask": "causal"}, TypeError, "mask"),
        ({"mask": M.key_padding(torch.tensor([1, 2, 3]))}, ValueError, "batch"),
        ({"window": (-1, 0)}, ValueError, "window"),
        ({"window": -2}, ValueError, "window"),
        ({"window": (1, 2, 3)}, TypeError, "window"),
        ({"window": (1.5, 0)}, TypeError, "window"),
        ({"dropout_p": 1.0}, ValueError, "dropout_p"),
        ({"dropout_p": -0.1}, ValueError, "dropout_p"),
        ({"scale": -1.0}, ValueError, "scale"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"alibi_slopes": torch.ones(3)}, ValueError, "alibi_slopes"),
        ({"q_offset": 1.5}, TypeError, "q_offset"),
        ({"causal": 1}, TypeError, "causal"),
        ({"backend": "fastest"}, ValueError, "backend"),
        ({"return_lse": "yes"}, TypeError, "return_lse"),
    ],
)
def test_bad_input(kwargs: dict, exc: type, words: str) -> None:
    args = {"q": Q, "k": K, "v": torch.randn(2, 2, 7, 8)}
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc) as info:
        az.attention(q, k, v, **args)
    assert words in str(info.value), str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize(("n_q", "n_k"), [(5, 40), (40, 40), (130, 300)])
def test_flex_compiled_matches_reference(monkeypatch: pytest.MonkeyPatch, n_q: int, n_k: int) -> None:
    """Compiled FlexAttention (inference) agrees with the reference, short key sequences included."""
    monkeypatch.setattr(flex_mod, "COMPILE", True)
    q, k, v = torch.randn(2, 4, n_q, 16), torch.randn(2, 4, n_k, 16), torch.randn(2, 4, n_k, 16)
    with torch.no_grad():
        for causal in (False, True):
            got = az.attention(q, k, v, causal=causal, backend="flex")
            ref = az.attention(q, k, v, causal=causal, backend="reference")
            assert (got - ref).abs().max() < 1e-5, (n_q, n_k, causal)


@pytest.mark.parametrize(("window", "extra"), [((100, 0), {}), ((64, 7), {"softcap": 5.0}),
                                               ((48, 0), {"alibi": True}), ((100, 0), {"padding": True})])
@pytest.mark.parametrize("hkv", [1, 4])
def test_tiled_sliding_window_band_gradients(monkeypatch: pytest.MonkeyPatch, window, extra, hkv) -> None:
    """The backward pass of window bands (default block sizes) against float64 autograd of the reference."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")  # the PyTorch tiled path itself (not its compiled twin)
    pieces: list[int] = []
    real = tiled_backward.backward_band
    monkeypatch.setattr(tiled_backward, "backward_band", lambda *a: (pieces.append(1), real(*a))[1])
    torch.manual_seed(0)
    n, hq = 1100, 4
    q = torch.randn(2, hq, n, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, n, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hkv, n, 16, dtype=torch.float64, requires_grad=True)
    kw: dict = {"causal": True, "window": window}
    if extra.get("softcap"):
        kw["softcap"] = extra["softcap"]
    if extra.get("alibi"):
        kw["alibi_slopes"] = az.alibi_slopes(hq).double()
    if extra.get("padding"):
        kw["mask"] = M.key_padding(torch.tensor([1000, 1100]))
    g_out = torch.randn(2, hq, n, 16, dtype=torch.float64)
    ref = az.attention(q, k, v, backend="reference", **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g_out)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].float()
    with use_tiles(TileConfig(backward_band_elems=1 << 16)):  # default sizes, several pieces per band
        out = az.attention(qf, kf, vf, backend="tiled", **kw)
        grads = torch.autograd.grad(out, (qf, kf, vf), g_out.float())
    assert pieces, "the band backward was not used"
    assert (out.double() - ref).abs().max() < 1e-5
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 1e-5, (name, float(err))


@pytest.mark.parametrize("window", [(40, 0), (100, 7), (300, 0)])
@pytest.mark.parametrize("hkv", [1, 4])
def test_tiled_sliding_window_bands_at_default_sizes(window, hkv) -> None:
    """Default block sizes (bands re-planned with smaller query blocks) against the float64 reference."""
    n = 1100
    q = torch.randn(2, 4, n, 16, dtype=torch.float64)
    k, v = torch.randn(2, hkv, n, 16, dtype=torch.float64), torch.randn(2, hkv, n, 16, dtype=torch.float64)
    # key padding: the band's mask is evaluated per block; without it the window is relative and
    # one block's pattern is applied to the masked columns only
    for mask in (M.key_padding(torch.tensor([1000, 1100])), None):
        ref, ref_lse = az.attention(q, k, v, causal=True, window=window, mask=mask, return_lse=True,
                                    backend="reference")
        with use_tiles(DEFAULT_TILES):
            out, lse = az.attention(q.float(), k.float(), v.float(), causal=True, window=window, mask=mask,
                                    return_lse=True, backend="tiled")
        assert (out.double() - ref).abs().max() < 1e-5, mask
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        fin = torch.isfinite(ref_lse)
        assert (lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-4


def test_band_pieces_cover_the_band_and_fit_in_the_unwritten_rows() -> None:
    """Pieces tile the band's rows in order; each piece's scores fit in the output rows after it,
    down to one block and then sub-blocks of that block (which keep the block's key window)."""
    bq, nq, dv = 64, 64 * 40, 64
    band = tiled_mod.Band(first=8, count=32, k_lo=8 * 64 - 256, width=320, needs_mask=True)
    min_tail = DEFAULT_TILES.min_tail_block
    pieces = tiled_forward.band_pieces(band, bq, nq, dv, min_tail)
    row = band.first * bq
    for size, piece in pieces:
        assert piece.first * size == row, (size, piece)
        block = row // bq  # the block the piece starts in keeps that block's key window
        assert piece.k_lo == band.k_lo + (block - band.first) * bq and piece.width == band.width
        rows = piece.count * size
        assert size == min_tail or rows * (band.width + dv) <= (nq - row) * dv, (size, piece)
        row += rows
    assert row == (band.first + band.count) * bq
    assert min(size for size, _ in pieces) == min_tail  # the last rows use sub-blocks


@pytest.mark.parametrize("mask", [None, "padding"])
@pytest.mark.parametrize("hkv", [1, 2])
def test_tiled_band_tail_sub_blocks_match_reference(monkeypatch: pytest.MonkeyPatch, mask, hkv) -> None:
    """The last band blocks, cut into sub-blocks over their key windows, give the reference's rows."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")  # the PyTorch tiled path itself (not its compiled twin)
    sizes: list[int] = []
    real = tiled_forward.forward_band
    monkeypatch.setattr(tiled_forward, "forward_band", lambda r, bq, *a: (sizes.append(bq), real(r, bq, *a))[1])
    torch.manual_seed(0)
    n = 1024
    q = torch.randn(2, 4, n, 16, dtype=torch.float64)
    k, v = torch.randn(2, hkv, n, 16, dtype=torch.float64), torch.randn(2, hkv, n, 16, dtype=torch.float64)
    m = M.key_padding(torch.tensor([1000, 1024])) if mask else None
    ref = az.attention(q, k, v, causal=True, window=(100, 0), mask=m, backend="reference")
    with torch.no_grad(), use_tiles(DEFAULT_TILES):
        out = az.attention(q.float(), k.float(), v.float(), causal=True, window=(100, 0), mask=m, backend="tiled")
    assert min(sizes) < max(sizes), sizes  # sub-blocks ran
    assert (out.double() - ref).abs().max() < 1e-5


def test_tile_config_is_checked() -> None:
    with pytest.raises(ValueError, match="TileConfig: block_q must be >= 1, got 0"):
        TileConfig(block_q=0)
    with pytest.raises(TypeError, match="tiles must be a TileConfig"), use_tiles({"block_q": 8}):  # type: ignore[arg-type]
        pass


def test_tile_plans_are_cached_for_plain_patterns_only() -> None:
    """causal/window plans are reused (same object); a Mask object's or mask tensor's plan is rebuilt;
    other tile sizes give a new plan."""
    q = torch.randn(1, 2, 300, 8)

    def plan(**kw: object) -> tiled_mod.TilePlan:
        return tiled_mod.tile_plan(build_request(q, q, q, **{"mask": None, "causal": True, "window": None,
                                                              "q_offset": None, "scale": None, "softcap": None,
                                                              "alibi_slopes": None, "dropout_p": 0.0,
                                                              "return_lse": False, "return_weights": False,
                                                              **kw}), 64, 64)

    assert plan() is plan()
    assert plan(window=(32, 0)) is plan(window=(32, 0))
    assert plan(window=(32, 0)) is not plan(window=(33, 0))
    assert plan(mask=M.causal()) is not plan(mask=M.causal())
    assert plan(mask=M.causal()).rows == plan().rows  # same pattern, same plan
    dense = torch.ones(300, 300, dtype=torch.bool).tril()
    assert plan(mask=dense) is not plan(mask=dense)
    first = plan()
    with use_tiles(TileConfig(block_q=8, block_k=4, max_chunk_k=64, merge_k=8)):
        assert plan() is not first
