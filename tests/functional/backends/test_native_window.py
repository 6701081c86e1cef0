"""The compiled forward (``tiled/native.py``, ``native_window.cpp``: windows, causal and full
attention, softcap; ``native_nsa.cpp``: NSA's selected branch) against the float64 reference, the
requests it must leave to the PyTorch path, and ``attnzoo native``.

The kernel is built once for the module into a temporary ``ATTNZOO_NATIVE_DIR`` (about 20 s); where
it cannot be built (no compiler, ninja or MKL ``sgemm_``, not x86) the tests that need it skip with
the reason and the fallback tests still run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import attnzoo as az
from attnzoo import cli
from attnzoo.functional.backends.tiled import native
from attnzoo.functional.core import _edge
from attnzoo.functional.softmax.nsa import NSAConfig, nsa_attention
from attnzoo.nn.nsa import BlockCompressor

F64 = torch.float64


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("native")
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNZOO_NATIVE_DIR", str(root))
    mp.delenv("ATTNZOO_NATIVE", raising=False)
    mp.setenv("ATTNZOO_NATIVE_AUTO", "sdpa")  # auto's choices as without the build (its own test below)
    yield root
    native._cache.clear()
    mp.undo()


def _build_here() -> None:
    try:
        native.build()
    except native.NativeUnavailable as exc:
        pytest.skip(f"the compiled forward cannot be built here: {exc}")


@pytest.fixture(scope="module")
def built(native_dir: Path) -> object:
    """The kernel's module: the one the README's install built beside the sources when its tag says
    they are these sources (a 25-second compile saved), else built here; ``test_build_compiles_the_kernel``
    (slow) compiles it whatever is installed."""
    if native.installed_path() is None:
        _build_here()
    mod = native.native_module()
    assert mod is not None
    return mod


@pytest.mark.slow
def test_build_compiles_the_kernel(native_dir: Path) -> None:
    """``native.build()`` compiles the sources into :func:`native.build_dir`, and that build is loaded
    ahead of the installed one."""
    _build_here()
    assert native.module_path() == native.build_dir() / f"{native.NAME}.so"
    native._cache.pop(native.build_dir(), None)
    mod = native.native_module()
    assert mod is not None and hasattr(mod, "window_fwd")


@pytest.fixture
def calls(built: object, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Counts the kernel's calls (the windows it was called with)."""
    seen: list[tuple[int, int]] = []

    def spy(q, k, v, left, right, scale, softcap, block, softmax, slopes=None, finite=None):  # type: ignore[no-untyped-def]
        seen.append((left, right))
        return built.window_fwd(q, k, v, left, right, scale, softcap, block, softmax, slopes, finite)  # type: ignore[attr-defined]

    monkeypatch.setitem(native._cache, native.build_dir(), SimpleNamespace(window_fwd=spy))
    return seen


def _qkv(B: int, H: int, Hkv: int, N: int, D: int, Dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g, dtype=F64) for s in ((B, H, N, D), (B, Hkv, N, D), (B, Hkv, N, Dv)))


CASES = [  # (B, H, Hkv, N, D, Dv, causal, window, softcap, the (left, right) the kernel is called with)
    (2, 4, 4, 200, 16, 16, True, (37, 0), None, (37, 0)),
    (1, 4, 2, 777, 32, 24, False, (64, 5), None, (64, 5)),  # two-sided, GQA 2, N not a multiple of the block
    (2, 4, 1, 300, 8, 8, True, (300, 0), None, (300, 0)),  # window over the whole sequence, MQA
    (1, 2, 2, 65, 16, 16, True, (0, 0), None, (0, 0)),  # each query sees only its own key
    (1, 2, 2, 100, 16, 16, True, (10, 7), None, (10, 0)),  # causal clips the right side to 0
    (2, 4, 2, 300, 16, 16, True, None, None, (300, 0)),  # dense causal
    (1, 2, 1, 150, 16, 8, False, None, None, (150, 150)),  # full (bidirectional)
    (1, 4, 2, 333, 16, 16, True, None, 2.0, (333, 0)),  # causal with a softcap that binds
    (1, 2, 2, 200, 16, 16, True, (50, 0), 1.5, (50, 0)),  # window with a softcap
    (1, 2, 1, 1500, 16, 16, True, None, 2.0, (1500, 0)),  # rows longer than KEY_CHUNK: a running maximum
    (1, 2, 2, 1300, 8, 8, False, None, None, (1300, 1300)),  # ... bidirectional
]


@pytest.mark.parametrize("case", CASES, ids=[f"N{c[3]}-win{c[7]}-causal{c[6]}-cap{c[8]}-g{c[1] // c[2]}"
                                             for c in CASES])
def test_native_forward_matches_the_float64_reference(case, calls: list[tuple[int, int]]) -> None:
    B, H, Hkv, N, D, Dv, causal, window, softcap, sides = case
    q, k, v = _qkv(B, H, Hkv, N, D, Dv)
    q = q * 3  # large enough scores that a softcap of 1.5-2 changes them
    kw = {"causal": causal, "window": window, "softcap": softcap}
    ref, ref_lse = az.attention(q, k, v, return_lse=True, backend="reference", **kw)
    eager = az.attention(q.float(), k.float(), v.float(), backend="reference", **kw)
    with torch.inference_mode():
        out, lse = az.attention(q.float(), k.float(), v.float(), return_lse=True, backend="tiled", **kw)
    assert calls == [sides]
    bound = 2 * (eager.double() - ref).abs().max().item() + 1e-6
    assert (out.double() - ref).abs().max().item() <= bound
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)


@pytest.fixture
def bwd_calls(built: object, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the kernel's forward and backward calls."""
    seen: list[str] = []

    def fwd(*a):  # type: ignore[no-untyped-def]
        seen.append("fwd")
        return built.window_fwd(*a)  # type: ignore[attr-defined]

    def bwd(*a):  # type: ignore[no-untyped-def]
        seen.append("bwd")
        return built.window_bwd(*a)  # type: ignore[attr-defined]

    monkeypatch.setitem(native._cache, native.build_dir(), SimpleNamespace(window_fwd=fwd, window_bwd=bwd))
    return seen


def _grads(q, k, v, d_out, d_lse, dtype, backend, **kw):  # type: ignore[no-untyped-def]
    """``(out, lse, dq, dk, dv)`` in float64 of ``az.attention`` on ``q, k, v`` cast to ``dtype``, the
    loss weighting the output by ``d_out`` and the log-sum-exp by ``d_lse``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = az.attention(*leaves, return_lse=True, backend=backend, **kw)
    ((out.double() * d_out).sum() + (lse.double() * d_lse).sum()).backward()
    return [t.detach().double() for t in (out, lse, *(x.grad for x in leaves))]


@pytest.mark.parametrize("case", CASES, ids=[f"N{c[3]}-win{c[7]}-causal{c[6]}-cap{c[8]}-g{c[1] // c[2]}"
                                             for c in CASES])
def test_native_backward_matches_the_float64_reference(case, bwd_calls: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Training through the compiled forward and backward: output, LSE and the gradients of q, k, v
    (from both outputs: the LSE's gradient is what merging partial results needs) within 2x the
    float32 PyTorch path's error of the float64 reference."""
    B, H, Hkv, N, D, Dv, causal, window, softcap, _ = case
    q, k, v = _qkv(B, H, Hkv, N, D, Dv, seed=1)
    q = q * 3
    g = torch.Generator().manual_seed(2)
    d_out, d_lse = torch.randn(B, H, N, Dv, generator=g, dtype=F64), torch.randn(B, H, N, generator=g, dtype=F64)
    kw = {"causal": causal, "window": window, "softcap": softcap}
    ref = _grads(q, k, v, d_out, d_lse, F64, "reference", **kw)
    ours = _grads(q, k, v, d_out, d_lse, torch.float32, "tiled", **kw)
    assert bwd_calls == ["fwd", "bwd"]
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    eager = _grads(q, k, v, d_out, d_lse, torch.float32, "tiled", **kw)
    for name, a, e, r in zip(("out", "lse", "dq", "dk", "dv"), ours, eager, ref, strict=True):
        err, eager_err = (a - r).abs().max().item(), (e - r).abs().max().item()
        assert err <= 2 * eager_err + 1e-6, (name, err, eager_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_backward_serves_half_inputs_through_float32(dtype: torch.dtype, bwd_calls: list[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Half-precision training runs its tile math in float32 (tiled_attention upcasts): the compiled
    kernels serve it, as close to the float64 reference as the PyTorch path."""
    q, k, v = _qkv(1, 4, 2, 300, 16, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    d_out, d_lse = torch.randn(1, 4, 300, 16, generator=g, dtype=F64), torch.zeros(1, 4, 300, dtype=F64)
    kw = {"causal": True, "window": (40, 0)}
    ref = _grads(q, k, v, d_out, d_lse, F64, "reference", **kw)
    ours = _grads(q, k, v, d_out, d_lse, dtype, "tiled", **kw)
    assert bwd_calls == ["fwd", "bwd"]
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    eager = _grads(q, k, v, d_out, d_lse, dtype, "tiled", **kw)
    for name, a, e, r in zip(("out", "lse", "dq", "dk", "dv"), ours, eager, ref, strict=True):
        err, eager_err = (a - r).abs().max().item(), (e - r).abs().max().item()
        assert err <= 1.5 * eager_err + 1e-3, (name, err, eager_err)


def test_the_backward_kernel_checks_its_inputs(built: object) -> None:
    q = torch.randn(2, 8, 4)
    lse = torch.randn(2, 8)
    bwd = built.window_bwd  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="float32"):
        bwd(q.double(), q, q, q, lse, q, lse, 2, 0, 0.5, 0.0, 32)
    with pytest.raises(RuntimeError, match="lse"):
        bwd(q, q, q, q, lse[:, :4], q, lse, 2, 0, 0.5, 0.0, 32)
    with pytest.raises(RuntimeError, match="d_out"):
        bwd(q, q, q, q, lse, q[:, :4], lse, 2, 0, 0.5, 0.0, 32)


def test_scores_past_the_buffer_limit_keep_the_pytorch_path(calls: list[tuple[int, int]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "MAX_SCORE_BYTES", native.BLOCK * 100 * 4)  # rows of at most 100 keys
    q, k, v = (t.float() for t in _qkv(1, 2, 2, 256, 16, 16))
    with torch.no_grad():
        az.attention(q, k, v, causal=True, window=(30, 0), backend="tiled")  # 64 + 30 keys a block: served
        az.attention(q, k, v, causal=True, backend="tiled")  # 256: not
    assert calls == [(30, 0)]


def test_auto_uses_it_for_a_long_float32_window(calls: list[tuple[int, int]]) -> None:
    q, k, v = (t.float() for t in _qkv(1, 2, 2, 4096, 32, 32))
    with torch.no_grad():
        out = az.attention(q, k, v, causal=True, window=(256, 0))
    assert calls == [(256, 0)]
    torch.testing.assert_close(out, az.attention(q, k, v, causal=True, window=(256, 0), backend="reference"),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("what", ["alibi gradient", "float64", "mask", "q_offset", "off"])
def test_requests_it_does_not_serve_take_the_pytorch_path(what: str, calls: list[tuple[int, int]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = (t.float() for t in _qkv(1, 2, 2, 96, 16, 16))
    kw: dict[str, object] = {"causal": True, "window": (20, 0), "backend": "tiled"}
    if what == "alibi gradient":  # tiled refuses it; auto gives it to the reference
        kw["alibi_slopes"], kw["backend"] = torch.tensor([0.5, 0.25], requires_grad=True), "auto"
    elif what == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif what == "mask":
        kw["mask"] = torch.ones(1, 1, 96, 96, dtype=torch.bool)
    elif what == "q_offset":
        q, kw["q_offset"] = q[:, :, -32:].contiguous(), 64
    elif what == "off":
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    out = az.attention(q, k, v, **kw)
    ref_kw = {**kw, "backend": "reference"}
    torch.testing.assert_close(out, az.attention(q.detach(), k, v, **ref_kw), atol=1e-5, rtol=1e-5)
    assert calls == []


def _not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """As after an install that built no kernels (pip's isolated build, no compiler)."""
    monkeypatch.setattr(native, "installed_path", lambda: None)


def test_not_built_means_none_and_no_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNZOO_NATIVE_DIR", str(tmp_path))
    _not_installed(monkeypatch)
    native._cache.pop(native.build_dir(), None)
    assert native.native_module() is None
    assert list(tmp_path.iterdir()) == []  # looking never builds


def test_the_kernel_checks_its_inputs(built: object) -> None:
    q = torch.randn(2, 8, 4)
    with pytest.raises(RuntimeError, match="float32"):
        built.window_fwd(q.double(), q.double(), q.double(), 2, 0, 0.5, 0.0, 32, True)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="multiple"):
        built.window_fwd(torch.randn(3, 8, 4), q, q, 2, 0, 0.5, 0.0, 32, True)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=">= 0"):
        built.window_fwd(q, q, q, -1, 0, 0.5, 0.0, 32, True)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="softcap"):
        built.window_fwd(q, q, q, 2, 0, 0.5, -1.0, 32, True)  # type: ignore[attr-defined]


def test_cli_native_reports_and_explains_a_failed_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ATTNZOO_NATIVE_DIR", str(tmp_path))
    _not_installed(monkeypatch)
    native._cache.pop(native.build_dir(), None)
    assert cli.main(["native"]) == 0
    assert "not built" in capsys.readouterr().out

    def fail(verbose: bool = False) -> Path:
        raise native.NativeUnavailable("no compiler here")

    monkeypatch.setattr(native, "build", fail)
    assert cli.main(["native", "--build"]) == 2
    assert "no compiler here" in capsys.readouterr().err
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    assert cli.main(["native"]) == 0
    assert "off (ATTNZOO_NATIVE=0)" in capsys.readouterr().out


VARLEN = [  # (lengths, Hq, Hkv, causal, window, softcap)
    ((5, 70, 1, 130, 64), 4, 2, True, None, None),
    ((33, 0, 100, 7), 2, 2, False, None, None),  # an empty sequence, bidirectional
    ((90, 200, 65), 4, 1, True, (40, 0), None),
    ((120, 50), 2, 2, False, (16, 9), 2.0),
    ((1100, 3, 300), 2, 1, True, None, None),  # rows of >= WIDE_ROWS keys: blocks of WIDE_BLOCK queries
]


@pytest.mark.parametrize("case", VARLEN, ids=[f"len{c[0]}-causal{c[3]}-win{c[4]}-cap{c[5]}" for c in VARLEN])
def test_native_varlen_matches_per_sequence_reference(case, built: object, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths, hq, hkv, causal, window, softcap = case
    called: list[int] = []

    def spy(*args):  # type: ignore[no-untyped-def]
        called.append(args[8])  # the query block
        return built.varlen_fwd(*args)  # type: ignore[attr-defined]

    monkeypatch.setitem(native._cache, native.build_dir(), SimpleNamespace(varlen_fwd=spy))
    g = torch.Generator().manual_seed(1)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, 16, generator=g, dtype=F64) * 2 for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"causal": causal, "window": window, "softcap": softcap}
    ref, ref_lse = az.attention_varlen(q, k, v, cu, cu, return_lse=True, backend="reference", **kw)
    eager = az.attention_varlen(q.float(), k.float(), v.float(), cu, cu, backend="reference", **kw)
    with torch.no_grad():
        out, lse = az.attention_varlen(q.float(), k.float(), v.float(), cu, cu, return_lse=True, **kw)
        plain = az.attention_varlen(q.float(), k.float(), v.float(), cu, cu, backend="tiled", **kw)
    wide = causal and window is None and max(lengths) >= native.WIDE_ROWS
    assert called == [native.WIDE_BLOCK if wide else native.BLOCK] * 2
    assert (out.double() - ref).abs().max().item() <= 2 * (eager.double() - ref).abs().max().item() + 1e-6
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)
    assert torch.equal(plain, out)


def test_native_varlen_leaves_sinks_and_unequal_lengths_to_pytorch(calls: list[tuple[int, int]],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(native._cache[native.build_dir()], "varlen_fwd", lambda *a: seen.append(1), raising=False)
    monkeypatch.setattr(native._cache[native.build_dir()], "window_bwd", lambda *a: seen.append(2), raising=False)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(40, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    ref = az.attention_varlen(q, k, v, cu, cu, causal=True, backend="reference")
    sinks = torch.zeros(2, requires_grad=True)
    torch.testing.assert_close(az.attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks * 0 - 1e9), ref,
                               atol=1e-5, rtol=1e-5)
    qg = q.clone().requires_grad_()
    az.attention_varlen(qg, k, v, cu, cu, causal=True, sinks=sinks).sum().backward()
    az.attention_varlen(q[:30], k, v, torch.tensor([0, 10, 30], dtype=torch.int32), cu, causal=True)
    qs = q[:30].clone().requires_grad_()
    az.attention_varlen(qs, k, v, torch.tensor([0, 10, 30], dtype=torch.int32), cu, causal=True).sum().backward()
    assert seen == [] and qg.grad is not None and qs.grad is not None


@pytest.mark.parametrize("case", VARLEN, ids=[f"len{c[0]}-causal{c[3]}-win{c[4]}-cap{c[5]}" for c in VARLEN])
def test_native_varlen_trains_like_the_float64_reference(case, built: object,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed training (forward ``varlen_fwd``, backward ``window_bwd`` once per non-empty sequence):
    the output and the gradients of q, k, v within 2x the PyTorch float32 path's error of float64."""
    lengths, hq, hkv, causal, window, softcap = case
    calls: list[int] = []
    fwd, bwd = built.varlen_fwd, built.window_bwd  # type: ignore[attr-defined]
    monkeypatch.setitem(native._cache, native.build_dir(), SimpleNamespace(
        varlen_fwd=lambda *a: calls.append(1) or fwd(*a), window_bwd=lambda *a: calls.append(2) or bwd(*a)))
    g = torch.Generator().manual_seed(3)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, 16, generator=g, dtype=F64) * 2 for h in (hq, hkv, hkv))
    d_out = torch.randn(T, hq, 16, generator=g, dtype=F64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"causal": causal, "window": window, "softcap": softcap}

    def grads(dtype: torch.dtype, **extra: object) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = az.attention_varlen(*leaves, cu, cu, **kw, **extra)
        (out * d_out.to(dtype)).sum().backward()
        return [out.detach().double(), *(t.grad.double() for t in leaves)]

    ref = grads(F64, backend="reference")
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    eager = grads(torch.float32)
    monkeypatch.delenv("ATTNZOO_NATIVE")
    ours = grads(torch.float32)
    assert calls == [1] + [2] * sum(1 for n in lengths if n > 0)
    for name, mine, theirs, exact in zip(("out", "dq", "dk", "dv"), ours, eager, ref, strict=True):
        err, bound = (mine - exact).abs().max().item(), (theirs - exact).abs().max().item()
        assert err <= 2 * bound + 1e-5, f"{name}: {err:.2e} vs the PyTorch path's {bound:.2e}"


NSA_CASES = [  # (config (l, d, l', n, w), H, Hkv, Nq, Nk, D, Dv): Nq >= 256 runs the block-major branch
    (NSAConfig(32, 16, 64, 16, 512), 8, 2, 700, 700, 16, 16),  # the module's defaults, GQA 4
    (NSAConfig(4, 2, 4, 4, 4), 3, 1, 300, 333, 8, 8),  # tiny blocks (Ns = 84), MQA, queries after a prefix
    (NSAConfig(4, 4, 8, 3, 6), 4, 4, 257, 1000, 8, 12),  # wider selection blocks, Dv != D, q_offset 743
    (NSAConfig(6, 3, 3, 4, 5), 2, 2, 400, 401, 8, 8),  # selection blocks shorter than compressed ones
]


@pytest.mark.parametrize("case", NSA_CASES, ids=[f"Nq{c[3]}-Nk{c[4]}-g{c[1] // c[2]}-lsel{c[0].select_len}"
                                                 for c in NSA_CASES])
def test_native_nsa_selected_matches_the_float64_reference(case, built: object,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``nsa_attention`` in float32 inference with the compiled selected branch against the dense
    float64 reference form; as close as the PyTorch float32 path is, and the kernel was called."""
    cfg, H, G, Nq, Nk, D, Dv = case
    g = torch.Generator().manual_seed(Nq)
    q = torch.randn(2, H, Nq, D, generator=g, dtype=F64)
    k = torch.randn(2, G, Nk, D, generator=g, dtype=F64)
    v = torch.randn(2, G, Nk, Dv, generator=g, dtype=F64)
    gates = torch.rand(2, H, Nq, 3, generator=g, dtype=F64)
    torch.manual_seed(0)
    comp_k = BlockCompressor(D, cfg.block_len, cfg.block_stride, {"dtype": F64})
    comp_v = BlockCompressor(Dv, cfg.block_len, cfg.block_stride, {"dtype": F64})
    args64 = (q, k, v, comp_k(k).detach(), comp_v(v).detach(), gates)
    args32 = tuple(t.float() for t in args64)
    ref = nsa_attention(*args64, cfg, form="reference")
    called: list[int] = []
    kernel = built.nsa_selected_fwd  # type: ignore[attr-defined]
    monkeypatch.setitem(native._cache, native.build_dir(),
                        SimpleNamespace(nsa_selected_fwd=lambda *a: called.append(1) or kernel(*a)))
    with torch.no_grad():
        out = nsa_attention(*args32, cfg)
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
        eager = nsa_attention(*args32, cfg)
    assert called == [1]
    err, eager_err = ((x.double() - ref).abs().max().item() for x in (out, eager))
    assert err <= 2 * eager_err + 1e-6, (err, eager_err)


@pytest.mark.parametrize("case", NSA_CASES, ids=[f"Nq{c[3]}-Nk{c[4]}-g{c[1] // c[2]}-lsel{c[0].select_len}"
                                                 for c in NSA_CASES])
def test_native_nsa_selected_trains_like_the_float64_reference(case, built: object,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``nsa_attention`` trained in float32 with the compiled selected branch (forward with its LSE,
    ``nsa_selected_bwd``): the gradients of q, k, v and the gates within 2x the PyTorch float32
    path's error of the float64 reference form's, and both kernels ran."""
    cfg, H, G, Nq, Nk, D, Dv = case
    g = torch.Generator().manual_seed(Nq + 1)
    q = torch.randn(2, H, Nq, D, generator=g, dtype=F64)
    k = torch.randn(2, G, Nk, D, generator=g, dtype=F64)
    v = torch.randn(2, G, Nk, Dv, generator=g, dtype=F64)
    gates = torch.rand(2, H, Nq, 3, generator=g, dtype=F64)
    d_out = torch.randn(2, H, Nq, Dv, generator=g, dtype=F64)
    torch.manual_seed(0)
    comp_k = BlockCompressor(D, cfg.block_len, cfg.block_stride, {"dtype": F64})
    comp_v = BlockCompressor(Dv, cfg.block_len, cfg.block_stride, {"dtype": F64})
    kc, vc = comp_k(k).detach(), comp_v(v).detach()

    def grads(dtype: torch.dtype, **kw: object) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v, gates)]
        out = nsa_attention(leaves[0], leaves[1], leaves[2], kc.to(dtype), vc.to(dtype), leaves[3], cfg, **kw)
        (out * d_out.to(dtype)).sum().backward()
        return [out.detach().double(), *(t.grad.double() for t in leaves)]

    ref = grads(F64, form="reference")
    calls: list[str] = []
    fwd, bwd = built.nsa_selected_train_fwd, built.nsa_selected_bwd  # type: ignore[attr-defined]
    monkeypatch.setitem(native._cache, native.build_dir(), SimpleNamespace(
        nsa_selected_train_fwd=lambda *a: calls.append("fwd") or fwd(*a),
        nsa_selected_bwd=lambda *a: calls.append("bwd") or bwd(*a)))
    ours = grads(torch.float32)
    assert calls == ["fwd", "bwd"]
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    eager = grads(torch.float32)
    for name, mine, theirs, exact in zip(("out", "dq", "dk", "dv", "dgates"), ours, eager, ref, strict=True):
        err, bound = (mine - exact).abs().max().item(), (theirs - exact).abs().max().item()
        assert err <= 2 * bound + 1e-5, f"{name}: {err:.2e} vs the PyTorch path's {bound:.2e}"


def test_native_nsa_selected_leaves_float64_and_decoding_to_pytorch(built: object,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setitem(native._cache, native.build_dir(), SimpleNamespace(
        nsa_selected_fwd=lambda *a: seen.append(1), nsa_selected_train_fwd=lambda *a: seen.append(2)))
    cfg = NSAConfig(4, 2, 4, 4, 4)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 300, 8, generator=g, dtype=F64) for _ in range(3))
    comp = BlockCompressor(8, cfg.block_len, cfg.block_stride, {"dtype": F64})
    kc, vc = comp(k).detach(), comp(v).detach()
    gates = torch.rand(1, 2, 300, 3, generator=g, dtype=F64)
    out = nsa_attention(q.requires_grad_(), k, v, kc, vc, gates, cfg)  # float64 training: the autograd path
    out.sum().backward()
    with torch.no_grad():  # fewer than 256 queries (decoding): the per-query gather
        nsa_attention(q[:, :, -8:].float(), k.float(), v.float(), kc.float(), vc.float(), gates[:, :, -8:].float(),
                      cfg, q_offset=292)
    assert seen == [] and q.grad is not None


def test_the_nsa_kernel_checks_its_inputs(built: object) -> None:
    kb = torch.randn(1, 1, 4, 8, 16)
    q = torch.randn(1, 2, 32, 16)
    idx = torch.zeros(1, 1, 32, 2, dtype=torch.long)
    ok = torch.ones(1, 1, 32, 2, dtype=torch.bool)
    fwd = built.nsa_selected_fwd  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="float32"):
        fwd(q.double(), kb, kb, idx, ok, 0, 0.25, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        fwd(q, kb, kb, idx + 4, ok, 0, 0.25, 16)
    with pytest.raises(RuntimeError, match="t0"):
        fwd(q, kb, kb, idx, ok, 1, 0.25, 16)  # positions 1 .. 32 need 33 keys; the blocks hold 32
    with pytest.raises(RuntimeError, match="idx"):
        fwd(q, kb, kb, idx.int(), ok, 0, 0.25, 16)
    padded = fwd(q, kb, kb, idx + 4, ok & False, 0, 0.25, 16)  # padding slots are never read
    assert torch.equal(padded, torch.zeros_like(padded))


def test_compiled_graphs_train_through_the_kernels(bwd_calls: list[str]) -> None:
    """``torch.compile`` sees the tiled backend as two custom operators; with the kernels built their
    eager bodies run the compiled forward and backward, with the eager gradients."""
    q, k, v = (t.float() for t in _qkv(1, 2, 2, 128, 16, 16, seed=5))
    d_out = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(6))

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (az.attention(q, k, v, causal=True, window=(20, 0), backend="tiled") * d_out).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(loss, backend="aot_eager", fullgraph=True)(*leaves).backward()
    assert bwd_calls == ["fwd", "bwd"]
    ref = [t.clone().requires_grad_() for t in (q.double(), k.double(), v.double())]
    (az.attention(*ref, causal=True, window=(20, 0), backend="reference") * d_out.double()).sum().backward()
    for a, r in zip(leaves, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=2e-5, rtol=1e-4)


DECODE = [  # (B, Hq, Hkv, Nq, Nk, D, Dv, causal, window, softcap, q_offset)
    (1, 8, 2, 1, 3000, 32, 32, True, None, None, None),  # GQA 4, three splits
    (2, 4, 1, 3, 2500, 16, 8, True, (100, 0), None, None),  # MQA, a window, Dv != D, a few queries
    (1, 4, 4, 2, 1500, 16, 16, False, None, 2.0, None),  # bidirectional with a softcap that binds
    (1, 4, 2, 8, 2100, 16, 16, True, (10, 3), None, 1000),  # queries in the middle of the cache
    (1, 2, 2, 2, 100, 8, 8, True, (0, 0), None, 99),  # the second query sees no key: zeros, LSE -inf
]


@pytest.mark.parametrize("case", DECODE, ids=[f"B{c[0]}-g{c[1] // c[2]}-Nq{c[3]}-Nk{c[4]}-win{c[8]}-cap{c[9]}"
                                              for c in DECODE])
def test_native_decode_matches_the_float64_reference(case, built: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Split-KV decoding through the compiled kernel, reading K/V as slices of a longer cache (rows
    contiguous, heads strided): output and LSE against the float64 reference, within 2x the error of
    the PyTorch split-KV path."""
    from attnzoo.functional.backends.decode import decode_attention

    B, Hq, Hkv, Nq, Nk, D, Dv, causal, window, softcap, q_offset = case
    g = torch.Generator().manual_seed(Nk)
    q = torch.randn(B, Hq, Nq, D, generator=g) * 2
    k = torch.randn(B, Hkv, Nk + 50, D, generator=g)[:, :, :Nk]  # a cache buffer longer than its fill
    v = torch.randn(B, Hkv, Nk + 50, Dv, generator=g)[:, :, :Nk]
    kw = {"causal": causal, "window": window, "softcap": softcap, "q_offset": q_offset}
    ref, ref_lse = az.attention(q.double(), k.double(), v.double(), return_lse=True, backend="reference", **kw)
    called: list[int] = []
    kernel = built.decode_fwd  # type: ignore[attr-defined]
    monkeypatch.setitem(native._cache, native.build_dir(),
                        SimpleNamespace(decode_fwd=lambda *a: called.append(1) or kernel(*a)))
    with torch.no_grad():
        out, lse = decode_attention(q, k, v, return_lse=True, **kw)
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
        eager, eager_lse = decode_attention(q, k, v, return_lse=True, **kw)
    assert called == [1]
    assert (out.double() - ref).abs().max().item() <= 2 * (eager.double() - ref).abs().max().item() + 1e-6
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and torch.equal(torch.isinf(eager_lse), torch.isinf(lse))
    seen = torch.isfinite(ref_lse)
    assert torch.allclose(lse[seen].double(), ref_lse[seen], atol=1e-5, rtol=1e-6)


def test_native_decode_serves_auto_and_leaves_gradients_to_pytorch(built: object,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    kernel = built.decode_fwd  # type: ignore[attr-defined]
    monkeypatch.setitem(native._cache, native.build_dir(),
                        SimpleNamespace(decode_fwd=lambda *a: seen.append(1) or kernel(*a)))
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(1, 8, 1, 16, generator=g), torch.randn(1, 2, 4096, 16, generator=g), torch.randn(1, 2, 4096, 16, generator=g)
    with torch.no_grad():
        out = az.attention(q, k, v, causal=True, q_offset=4095)  # auto: GQA decoding over >= 2,048 keys
    assert seen == [1]
    torch.testing.assert_close(out, az.attention(q, k, v, causal=True, q_offset=4095, backend="reference"),
                               atol=2e-6, rtol=1e-5)
    qg = q.clone().requires_grad_()
    az.attention(qg, k, v, causal=True, q_offset=4095).sum().backward()  # autograd: the PyTorch path
    az.attention(q.double(), k.double(), v.double(), causal=True, q_offset=4095)  # float64: the oracle
    assert seen == [1] and qg.grad is not None


def test_the_decode_kernel_checks_its_inputs(built: object) -> None:
    fwd = built.decode_fwd  # type: ignore[attr-defined]
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 64, 8)
    with pytest.raises(RuntimeError, match="float32"):
        fwd(q.double(), k, k, 64, 0, 63, 0.3, 0.0, 16)
    with pytest.raises(RuntimeError, match="disagree"):
        fwd(torch.randn(1, 3, 1, 8), k, k, 64, 0, 63, 0.3, 0.0, 16)
    with pytest.raises(RuntimeError, match=">= 0"):
        fwd(q, k, k, -1, 0, 63, 0.3, 0.0, 16)


def test_a_modules_strided_projections_are_read_in_place(bwd_calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v as attention modules make them (``[B, N, H, D]`` projections viewed as ``[B, H, N, D]``:
    rows contiguous, heads strided) reach the kernel without a copy, forward and backward, and a
    ``sliding`` module's forward runs it."""
    from attnzoo.variants import build_attention

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 130, h, 16, generator=g).transpose(1, 2) for h in (4, 2, 2))
    assert not q.is_contiguous()
    d_out = torch.randn(2, 4, 130, 16, generator=g, dtype=F64)
    kw = {"causal": True, "window": (30, 0)}
    zeros = torch.zeros(2, 4, 130, dtype=F64)
    ref = _grads(q.double(), k.double(), v.double(), d_out, zeros, F64, "reference", **kw)
    ours = _grads(q, k, v, d_out, zeros, torch.float32, "tiled", **kw)
    assert bwd_calls == ["fwd", "bwd"]
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r, atol=2e-5, rtol=1e-4)
    m = build_attention("sliding", 32, 2, causal=True, window=16).eval()
    x = torch.randn(1, 1100, 32, generator=g)  # 1.2M scores, 1.5% visible: auto picks tiled
    with torch.no_grad():
        y = m(x)
        assert bwd_calls == ["fwd", "bwd", "fwd"]
        monkeypatch.setenv("ATTNZOO_NATIVE", "0")
        torch.testing.assert_close(y, m(x), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["native", "sdpa", "measure"])
def test_auto_prefers_the_kernel_over_sdpa_as_measured(mode: str, bwd_calls: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``auto`` would run SDPA (float32 CPU, no mask), it runs the compiled kernel from
    ``AUTO_MIN_KEYS`` keys when ``ATTNZOO_NATIVE_AUTO`` says so, or (``measure``) when the kernel was
    timed at most ``AUTO_MAX_RATIO`` of SDPA's time on this CPU; never below ``AUTO_MIN_KEYS``, with a
    mask, or for another dtype. The results equal the reference either way."""
    monkeypatch.setenv("ATTNZOO_NATIVE_AUTO", mode)
    if mode == "measure":
        monkeypatch.setattr(native, "_calibrated", {})
        monkeypatch.setattr(native, "_time_against_sdpa", lambda mod, training: 0.5 if training else 2.0)
    n = native.AUTO_MIN_KEYS
    q, k, v = (t.float() for t in _qkv(1, 2, 1, n, 16, 16, seed=9))
    with torch.no_grad():
        out = az.attention(q, k, v, causal=True)
        az.attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], causal=True)  # too few keys
        az.attention(q, k, v, mask=torch.ones(n, n, dtype=torch.bool))  # a mask tensor
        az.attention(q.double(), k.double(), v.double(), causal=True)  # float64: the oracle
        span = native.AUTO_MAX_SPAN
        monkeypatch.setattr(native, "AUTO_MAX_SPAN", n - 1)
        az.attention(q, k, v, causal=True)  # rows longer than the span the kernel wins on
        monkeypatch.setattr(native, "AUTO_MAX_SPAN", span)
    assert bwd_calls == (["fwd"] if mode == "native" else [])  # measure: inference timed at 2x SDPA's time
    torch.testing.assert_close(out, az.attention(q, k, v, causal=True, backend="reference"), atol=2e-6, rtol=1e-5)
    bwd_calls.clear()
    qg = q.clone().requires_grad_()
    az.attention(qg, k, v, causal=True).sum().backward()  # measure: training timed at 0.5x
    assert bwd_calls == (["fwd", "bwd"] if mode in ("native", "measure") else [])
    if mode == "measure":
        assert native.calibration(True) == 0.5  # measured once, then the cached ratio decides


def test_the_calibration_measures_once_and_a_bad_mode_is_named(built: object,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_calibrated", {})
    ratio = native.calibration(False)
    assert 0 < ratio < float("inf") and native.calibration(False) == ratio  # cached: the same number
    monkeypatch.setenv("ATTNZOO_NATIVE_AUTO", "fastest")
    with pytest.raises(ValueError, match="ATTNZOO_NATIVE_AUTO"):
        native.auto_mode()


def test_cli_native_reports_auto_calibration(built: object, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(native, "_calibrated", {False: 0.7, True: 1.3})
    monkeypatch.setenv("ATTNZOO_NATIVE_AUTO", "measure")
    assert cli.main(["native"]) == 0
    out = capsys.readouterr().out
    assert "0.70x SDPA's time in inference and 1.30x in training" in out and "for inference (0.70x" in out
    monkeypatch.setenv("ATTNZOO_NATIVE_AUTO", "sdpa")
    assert cli.main(["native"]) == 0
    assert "ATTNZOO_NATIVE_AUTO=sdpa" in capsys.readouterr().out


ALIBI = [  # (H, Hkv, N, causal, window, softcap)
    (4, 2, 300, True, None, None),
    (2, 2, 200, True, (40, 0), None),
    (4, 1, 150, False, None, 2.0),  # bidirectional: |i - j| on both sides, under a softcap
    (2, 1, 1200, True, None, None),  # rows longer than KEY_CHUNK
]


@pytest.mark.parametrize("case", ALIBI, ids=[f"N{c[2]}-causal{c[3]}-win{c[4]}-cap{c[5]}" for c in ALIBI])
def test_native_alibi_matches_the_float64_reference(case, bwd_calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """ALiBi (MPT, BLOOM) in the compiled forward and backward: output, LSE and q/k/v gradients within 2x
    the float32 PyTorch path's error of the float64 reference (slopes without gradient)."""
    H, Hkv, N, causal, window, softcap = case
    q, k, v = _qkv(2, H, Hkv, N, 16, 16, seed=10)
    g = torch.Generator().manual_seed(11)
    d_out, d_lse = torch.randn(2, H, N, 16, generator=g, dtype=F64), torch.randn(2, H, N, generator=g, dtype=F64)
    slopes = az.alibi_slopes(H)
    kw = {"causal": causal, "window": window, "softcap": softcap}
    ref = _grads(q, k, v, d_out, d_lse, F64, "reference", alibi_slopes=slopes.double(), **kw)
    ours = _grads(q, k, v, d_out, d_lse, torch.float32, "tiled", alibi_slopes=slopes, **kw)
    assert bwd_calls == ["fwd", "bwd"]
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")
    eager = _grads(q, k, v, d_out, d_lse, torch.float32, "tiled", alibi_slopes=slopes, **kw)
    for name, a, e, r in zip(("out", "lse", "dq", "dk", "dv"), ours, eager, ref, strict=True):
        err, eager_err = (a - r).abs().max().item(), (e - r).abs().max().item()
        assert err <= 2 * eager_err + 1e-6, (name, err, eager_err)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["k", "q"])
def test_every_kernel_makes_a_row_that_sees_a_non_finite_score_nan(built: object, value: float, where: str) -> None:
    """docs/conventions.md: a row whose query, or a key it sees, holds a NaN or inf is NaN (and its LSE);
    every other row is the clean run's. The kernels are built with -ffast-math, under which a float
    test for NaN may be folded away and the exp2 clamp turned a NaN into a finite number: before the
    bit test, a NaN key vanished from an unmasked row."""
    g = torch.Generator().manual_seed(11)
    n, j, i = 96, 40, 50  # the bad key j (window rows j .. j + 8 see it), the bad query row i
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(3))
    bad_q, bad_k = q.clone(), k.clone()
    if where == "k":
        bad_k[0, 1, j, 3] = value
    else:
        bad_q[0, 1, i, 3] = value
    hit = torch.zeros(1, 2, n, dtype=torch.bool)
    if where == "k":
        hit[0, 1, j:j + 9] = True
    else:
        hit[0, 1, i] = True
    fwd = built.window_fwd  # type: ignore[attr-defined]
    out, lse = fwd(bad_q, bad_k, v, 8, 0, 0.35, 0.0, 32, True, None)
    clean, clean_lse = fwd(q, k, v, 8, 0, 0.35, 0.0, 32, True, None)
    assert torch.equal(torch.isnan(out).any(-1), hit) and torch.equal(torch.isnan(lse), hit)
    torch.testing.assert_close(out[~hit], clean[~hit], atol=0, rtol=0)
    torch.testing.assert_close(lse[~hit], clean_lse[~hit], atol=0, rtol=0)
    # decoding: the last 4 queries against the whole cache, 2 splits (a NaN split poisons the merge)
    dq = bad_q[:, :, -4:].contiguous() if where == "q" else q[:, :, -4:].contiguous()
    dec, dec_lse = built.decode_fwd(dq, bad_k, v, n, 0, n - 4, 0.35, 0.0, 48)  # type: ignore[attr-defined]
    rows = torch.zeros(1, 2, 4, dtype=torch.bool)
    if where == "k":
        rows[0, 1] = True  # every decoding query sees key j
    assert torch.equal(torch.isnan(dec).any(-1), rows) and torch.equal(torch.isnan(dec_lse), rows)
    assert torch.isfinite(dec[~rows]).all()


def test_the_nsa_kernel_makes_a_row_that_sees_a_non_finite_key_nan(built: object) -> None:
    kb = torch.randn(1, 1, 4, 8, 16, generator=torch.Generator().manual_seed(12))
    q = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(13))
    idx = torch.arange(4).repeat(32, 1)[:, :2].reshape(1, 1, 32, 2).contiguous()  # blocks 0 and 1
    ok = torch.ones(1, 1, 32, 2, dtype=torch.bool)
    fwd = built.nsa_selected_fwd  # type: ignore[attr-defined]
    clean = fwd(q, kb, kb, idx, ok, 0, 0.25, 16)
    bad = kb.clone()
    bad[0, 0, 1, 2, 5] = float("nan")  # key 10: queries 10 .. 31 see it
    out = fwd(q, bad, kb, idx, ok, 0, 0.25, 16)
    hit = torch.zeros(1, 2, 32, dtype=torch.bool)
    hit[:, :, 10:] = True
    assert torch.equal(torch.isnan(out).any(-1), hit)
    torch.testing.assert_close(out[~hit], clean[~hit], atol=0, rtol=0)


FUSED = [  # (B, H, Hkv, N, D, Dv, left, right, block, strided, softcap, alibi): the register-blocked forward's cases
    (1, 2, 1, 1, 64, 64, 0, 0, 64, False, 0.0, False),  # a single query
    (2, 4, 2, 200, 64, 64, 37, 0, 64, False, 0.0, False),  # causal window, GQA, a partial last block
    (1, 2, 2, 100, 40, 48, 7, 7, 48, True, 0.0, False),  # D not a multiple of 16, 3 value vectors, two-sided, strided
    (1, 3, 1, 1100, 64, 128, 1100, 0, 64, True, 0.0, False),  # dense causal past a 512-key chunk, MQA, strided
    (1, 2, 1, 700, 16, 80, 700, 700, 32, False, 0.0, False),  # bidirectional over two chunks, 5 value vectors
    (1, 2, 2, 333, 128, 16, 256, 0, 128, False, 0.0, False),  # 16-wide values, four sub-blocks of 32 a block
    (1, 1, 1, 65, 8, 112, 0, 0, 64, True, 0.0, False),  # each query sees only its own key, 7 value vectors
    (1, 4, 2, 600, 64, 64, 600, 0, 64, False, 2.0, False),  # a softcap that binds, past a chunk
    (1, 2, 2, 150, 32, 32, 50, 3, 64, True, 0.0, True),  # ALiBi on a two-sided window, strided
    (2, 2, 1, 900, 16, 48, 900, 900, 64, False, 1.5, True),  # both, bidirectional over two chunks
]


def _fused_inputs(case):  # type: ignore[no-untyped-def]
    B, H, Hkv, N, D, Dv, _, _, _, strided, *_ = case
    q, k, v = _qkv(B, H, Hkv, N, D, Dv, seed=3)
    q = q * 2
    if strided:  # a module's [B, N, H, D] projections viewed as [B, H, N, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("case", FUSED, ids=[f"N{c[3]}-D{c[4]}-Dv{c[5]}-win{c[6:8]}-g{c[1] // c[2]}-strided{c[9]}"
                                             f"-cap{c[10]}-alibi{c[11]}" for c in FUSED])
def test_the_register_blocked_forward_matches_the_float64_reference(case, built: object) -> None:
    """The AVX-512 micro-kernel form (``native_fused.h``) against the float64 reference, within 2x the
    sgemm form's error (its output and LSE), on windows, chunked rows, GQA, odd widths and strided
    layouts, softcaps and ALiBi; and the strided layout (rows copied together by ``RowPack``) gives what
    the contiguous one gives."""
    _, H, _, _, D, _, left, right, block, strided, cap, alibi = case
    q, k, v = _fused_inputs(case)
    slopes = torch.linspace(0.05, 0.4, H, dtype=F64) if alibi else None
    ref, ref_lse = az.attention(q, k, v, window=(left, right), softcap=cap or None, alibi_slopes=slopes,
                                backend="reference", return_lse=True)
    scale = D ** -0.5
    extra = (None if slopes is None else slopes.float(),)
    qf, kf, vf = (t.float() for t in (q, k, v))
    errors = {}
    for on in (True, False):
        was = built.set_fused(on)  # type: ignore[attr-defined]
        try:
            out, lse = built.window_fwd(qf, kf, vf, left, right, scale, cap, block, True, *extra)  # type: ignore[attr-defined]
            if strided:
                same, same_lse = built.window_fwd(qf.contiguous(), kf.contiguous(), vf.contiguous(), left, right,  # type: ignore[attr-defined]
                                                  scale, cap, block, True, *extra)
                torch.testing.assert_close(out, same, rtol=0, atol=1e-6)
                torch.testing.assert_close(lse, same_lse, rtol=0, atol=1e-6)
        finally:
            built.set_fused(was)  # type: ignore[attr-defined]
        errors[on] = ((out.double() - ref).abs().max().item(), (lse.double() - ref_lse).abs().max().item())
    for fused, plain in zip(errors[True], errors[False], strict=True):
        assert fused <= 2 * plain + 1e-6, errors


def test_the_kernel_vouches_for_a_finite_output_and_not_for_a_leak(built: object,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``finite`` says whether every output value is finite: on clean inputs the non-finite guard of
    ``az.attention`` then skips its pass over the output; a NaN value row hidden from the rows before
    it (which a P V tile multiplies by zero) makes the kernel say no, and the guard keeps those rows
    finite."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 300, 64, generator=g) for _ in range(3))
    finite = torch.zeros((), dtype=torch.bool)
    built.window_fwd(q, k, v, 4, 0, 0.125, 0.0, 64, True, None, finite)  # type: ignore[attr-defined]
    assert bool(finite)
    monkeypatch.setitem(native._cache, native.build_dir(), built)

    def no_pass(*tensors: torch.Tensor) -> bool:
        raise AssertionError("the guard read the output although the kernel vouched for it")

    with monkeypatch.context() as m:
        m.setattr(_edge, "_maybe_non_finite", no_pass)
        clean = az.attention(q, k, v, window=(4, 0), backend="tiled")
    torch.testing.assert_close(clean, az.attention(q, k, v, window=(4, 0), backend="reference"), rtol=1e-5, atol=1e-5)
    v[0, 0, 150] = float("nan")
    built.window_fwd(q, k, v, 4, 0, 0.125, 0.0, 64, True, None, finite)  # type: ignore[attr-defined]
    assert not bool(finite)
    out = az.attention(q, k, v, window=(4, 0), backend="tiled")
    sees = torch.zeros(300, dtype=torch.bool)
    sees[150:155] = True  # the rows whose window holds key 150
    assert torch.isnan(out[0, 0, sees]).all() and torch.isfinite(out[0, 0, ~sees]).all()
    assert torch.isfinite(out[0, 1]).all()


def test_the_build_says_which_forward_form_it_has(built: object) -> None:
    """``has_fused`` is true exactly where the compiler targeted AVX-512 (the micro-kernels); ``attnzoo
    native`` reports it."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
    assert built.has_fused() == (" avx512f" in flags)  # type: ignore[attr-defined]
