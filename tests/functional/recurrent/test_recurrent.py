"""Retention, gated linear attention and the delta rule: every form equals the recurrence.

The recurrent form is the definition (a loop over tokens); the chunked and quadratic forms are
checked against it in float64 (outputs, final state and gradients), for lengths that are not
multiples of the chunk, and in float32 against the float64 recurrence (<= 1e-5 relative).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.tools.test_docs import run_blocks
from torch import Tensor

import attnzoo as az
from attnzoo.functional.recurrent._chunked_scan import resolve_form

FAMILIES = ["retention", "gla", "gla_scalar", "deltanet", "gated_deltanet"]
Run = Callable[..., "Tensor | tuple[Tensor, Tensor]"]


def make(family: str, b: int = 2, h: int = 3, n: int = 9, dk: int = 5, dv: int = 4,
         dtype: torch.dtype = torch.float64, decay: float = 1.0, seed: int = 0) -> tuple[dict[str, Tensor], Run]:
    """Inputs (q, k, v, the family's gates, initial_state) and a function of them."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    x = {"q": rand(b, h, n, dk), "k": rand(b, h, n, dk), "v": rand(b, h, n, dv), "s0": rand(b, h, dk, dv)}
    if family == "retention":
        x["gate"] = 0.05 + 0.9 * torch.rand(h, generator=gen, dtype=dtype)
        return x, lambda q, k, v, gate, s0, **kw: az.retention(q, k, v, gate, initial_state=s0, **kw)
    if family.startswith("gla"):
        shape = (b, h, n) if family == "gla_scalar" else (b, h, n, dk)
        x["gate"] = -decay * torch.rand(*shape, generator=gen, dtype=dtype)
        return x, lambda q, k, v, gate, s0, **kw: az.gated_linear_attention(q, k, v, gate, initial_state=s0, **kw)
    x["k"] = F.normalize(x["k"], dim=-1)  # as the modules do: keeps the delta-rule state bounded
    x["gate"] = torch.rand(b, h, n, generator=gen, dtype=dtype)  # beta
    if family == "deltanet":
        return x, lambda q, k, v, gate, s0, **kw: az.delta_rule(q, k, v, gate, initial_state=s0, **kw)
    x["log_decay"] = -decay * torch.rand(b, h, n, generator=gen, dtype=dtype)
    return x, lambda q, k, v, gate, s0, log_decay, **kw: az.delta_rule(q, k, v, gate, log_decay=log_decay,
                                                                         initial_state=s0, **kw)


def rel_err(got: Tensor, ref: Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


FORMS = [("quadratic", None), ("chunked", 1), ("chunked", 4), ("chunked", 13), ("chunked", 16), ("chunked", 64),
         ("auto", 4), ("auto", None)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [1, 2, 7, 16, 17, 37])
def test_forms_equal_recurrence_float64(family: str, n: int) -> None:
    x, run = make(family, n=n)
    ref, s_ref = run(**x, form="recurrent", return_state=True)
    for form, chunk in FORMS:
        out, s = run(**x, form=form, chunk_size=chunk, return_state=True)
        assert out.shape == ref.shape and s.shape == s_ref.shape
        err = max(rel_err(out, ref), rel_err(s, s_ref))
        assert err < 1e-10, f"{family} N={n} form={form} chunk={chunk}: max rel err {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_within_1e5_of_float64_recurrence(family: str) -> None:
    x, run = make(family, b=1, h=2, n=150, dk=16, dv=8, decay=0.5)
    ref, s_ref = run(**x, form="recurrent", return_state=True)
    x32 = {name: t.float() for name, t in x.items()}
    for form, chunk in [("chunked", 32), ("chunked", 64), ("quadratic", None), ("recurrent", None)]:
        out, s = run(**x32, form=form, chunk_size=chunk, return_state=True)
        assert out.dtype == torch.float32 and s.dtype == torch.float32
        err = max(rel_err(out, ref), rel_err(s, s_ref))
        assert err < 1e-5, f"{family} float32 form={form} chunk={chunk}: max rel err {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n,chunk", [(11, 4), (16, 16), (23, 8)])
def test_gradients_equal_between_forms(family: str, n: int, chunk: int) -> None:
    x, run = make(family, n=n)
    names = list(x)
    w_out = torch.randn(2, 3, n, 4, dtype=torch.float64)
    w_state = torch.randn(2, 3, 5, 4, dtype=torch.float64)

    def grads(form: str) -> list[Tensor]:
        leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
        out, s = run(**leaves, form=form, chunk_size=chunk, return_state=True)
        loss = (out * w_out).sum() + (s * w_state).sum()
        return list(torch.autograd.grad(loss, [leaves[name] for name in names]))

    ref = grads("recurrent")
    for form in ("chunked", "quadratic"):
        for name, got, want in zip(names, grads(form), ref, strict=True):
            err = rel_err(got, want)
            assert err < 1e-9, f"{family} N={n} chunk={chunk} form={form}: grad of {name} rel err {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_gradcheck_chunked(family: str) -> None:
    x, run = make(family, b=1, h=2, n=7, dk=3, dv=2)
    names = list(x)

    def f(*ts: Tensor) -> tuple[Tensor, Tensor]:
        return run(**dict(zip(names, ts, strict=True)), form="chunked", chunk_size=3, return_state=True)

    leaves = [t.clone().requires_grad_() for t in x.values()]
    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("form", ["recurrent", "chunked", "quadratic", "auto"])
def test_state_chaining(family: str, form: str) -> None:
    """Two calls (the second starting from the first one's state) == one call; so does token-by-token decode."""
    x, run = make(family, n=21)
    full, s_full = run(**x, form=form, chunk_size=4, return_state=True)

    def part(lo: int, hi: int, s0: Tensor) -> tuple[Tensor, Tensor]:
        sl = {name: (t if name == "s0" or t.dim() == 1 else t[:, :, lo:hi]) for name, t in x.items()}
        sl["s0"] = s0
        return run(**sl, form=form, chunk_size=4, return_state=True)

    o1, s1 = part(0, 10, x["s0"])
    o2, s2 = part(10, 21, s1)
    assert rel_err(torch.cat([o1, o2], dim=2), full) < 1e-10 and rel_err(s2, s_full) < 1e-10
    s, outs = x["s0"], []
    for t in range(21):
        o, s = part(t, t + 1, s)
        outs.append(o)
    assert rel_err(torch.cat(outs, dim=2), full) < 1e-10 and rel_err(s, s_full) < 1e-10


@pytest.mark.parametrize("family", ["gla", "gla_scalar", "gated_deltanet"])
def test_strong_decay_stays_finite_and_exact(family: str) -> None:
    """log decay ~ -5 per step: the cumulative decay of a 64-token chunk is ~e^-320 (0 in float32)."""
    x, run = make(family, b=1, h=2, n=200, dk=8, dv=8, decay=10.0)
    ref, s_ref = run(**x, form="recurrent", return_state=True)
    x32 = {name: t.float().requires_grad_() for name, t in x.items()}
    for chunk in (64, 100):
        out, s = run(**x32, form="chunked", chunk_size=chunk, return_state=True)
        assert max(rel_err(out, ref), rel_err(s, s_ref)) < 1e-5
        (out.sum() + s.sum()).backward()
        for name, t in x32.items():
            assert t.grad is not None and torch.isfinite(t.grad).all(), f"{family}: non-finite grad of {name}"
            t.grad = None
    out64 = run(**x, form="chunked", chunk_size=64)
    assert rel_err(out64, ref) < 1e-10


def test_loop_free_vector_scores_equal_the_halving() -> None:
    """The scores a compiled graph computes for a per-key decay (blocks below the diagonal, no loop)
    equal the halving of eager mode to float64 rounding, for chunks that are not a multiple of the
    block, one-token chunks and decays of e^-320 over a chunk; compiled (aot_eager) chunked GLA with
    such decays equals the float64 recurrence (inference: the loop-free scores) and has finite
    gradients in float32 (training: the halving as an operator)."""
    from attnzoo.functional.recurrent.gla import _blocked_vector_scores, _vector_scores

    gen = torch.Generator().manual_seed(0)
    for c, sub, decay in ((64, 16, 1.0), (50, 16, 1.0), (64, 8, 10.0), (7, 16, 1.0), (1, 16, 1.0), (33, 4, 10.0)):
        q, k = (torch.randn(2, 3, 4, c, 5, generator=gen, dtype=torch.float64) for _ in range(2))
        g = -decay * torch.rand(2, 3, 4, c, 5, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(_blocked_vector_scores(q, k, g, sub), _vector_scores(q, k, g, 4),
                                   rtol=1e-12, atol=1e-12)
    x, run = make("gla", b=1, h=2, n=200, dk=8, dv=8, decay=10.0)
    ref = run(**x, form="recurrent")
    torch._dynamo.reset()
    compiled = torch.compile(lambda **kw: run(**kw, form="chunked", chunk_size=64), backend="aot_eager",
                             fullgraph=True)
    assert rel_err(compiled(**x), ref) < 1e-10
    x32 = {name: t.float().requires_grad_() for name, t in x.items()}
    out = compiled(**x32)
    assert rel_err(out, ref) < 1e-5
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in x32.values())


@pytest.mark.parametrize(("c", "sub", "decay"), [(64, 4, 1.0), (37, 4, 1.0), (5, 4, 1.0), (1, 4, 1.0), (16, 16, 1.0),
                                             (9, 9, 1.0), (64, 4, 10.0)])
def test_vector_scores_operator_gradient_equals_autograd_of_the_halving(c: int, sub: int, decay: float) -> None:
    """``attnzoo::gla_vector_scores`` (the per-key scores with an analytic backward: the same halving
    for dq and dk, ``dg`` the suffix sum of ``q dq - k dk``) gives the values and float64 gradients of
    autograd through the halving: chunks that are not a power of two times ``sub``, one token, one
    sub-block (the quadratic form), decays of e^-320 over a chunk. Passes ``opcheck``."""
    from attnzoo.functional.recurrent.gla import _vector_scores, vector_scores

    gen = torch.Generator().manual_seed(c)
    q, k = (torch.randn(2, 3, c, 5, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    g = (-decay * torch.rand(2, 3, c, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(2, 3, c, c, generator=gen, dtype=torch.float64)
    want = _vector_scores(q, k, g, sub)
    got = vector_scores(q, k, g, sub)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad((got * weight).sum(), (q, k, g)),
                    torch.autograd.grad((want * weight).sum(), (q, k, g)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.library.opcheck(vector_scores, (q, k, g, sub))


def test_gla_second_derivatives_equal_the_recurrence() -> None:
    """A backward with ``create_graph=True`` through the scores operator is itself differentiable
    (gradient penalties, Hessian-vector products): float64 second derivatives of the chunked form
    equal those of the token loop."""
    x, run = make("gla", n=37)
    w = torch.randn(2, 3, 37, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = []
    for form in ("chunked", "recurrent"):
        leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
        (dq,) = torch.autograd.grad(run(**leaves, form=form, chunk_size=16).sum(), leaves["q"], create_graph=True)
        got.append(torch.autograd.grad((dq * w).sum(), [leaves[n] for n in ("k", "v", "gate", "s0")]))
    for name, a, b in zip(("k", "v", "gate", "s0"), *got, strict=True):
        assert rel_err(a, b) < 1e-10, f"second derivative of {name}: rel err {rel_err(a, b):.2e}"


def test_retention_is_scalar_gla_and_matches_decay_mask() -> None:
    x, _ = make("retention", n=12)
    q, k, v, gamma = x["q"], x["k"], x["v"], x["gate"]
    out = az.retention(q, k, v, gamma)
    log_decay = gamma.log()[None, :, None].expand(2, 3, 12)
    assert rel_err(az.gated_linear_attention(q, k, v, log_decay), out) < 1e-12
    vector = log_decay.unsqueeze(-1).expand(2, 3, 12, 5)
    assert rel_err(az.gated_linear_attention(q, k, v, vector, form="chunked", chunk_size=5), out) < 1e-12
    # RetNet's parallel form, written independently: (Q K^T * D) V with D[t, s] = gamma^(t - s), s <= t
    t = torch.arange(12, dtype=torch.float64)
    dist = t[:, None] - t[None, :]
    mask = torch.where(dist >= 0, gamma[:, None, None] ** dist.clamp_min(0), torch.zeros(()))  # [H, N, N]
    want = (q @ k.transpose(-1, -2) / math.sqrt(5) * mask) @ v
    assert rel_err(out, want) < 1e-12


def test_delta_rule_write_then_read_returns_value() -> None:
    """beta = 1 with orthonormal keys: reading key k_t after its write returns exactly v_t."""
    dk = 6
    keys = torch.linalg.qr(torch.randn(dk, dk, dtype=torch.float64))[0].T  # rows orthonormal
    k = keys[None, None].repeat(1, 1, 2, 1)  # each key written twice (the second write overwrites)
    v = torch.randn(1, 1, 2 * dk, 3, dtype=torch.float64)
    beta = torch.ones(1, 1, 2 * dk, dtype=torch.float64)
    for form in ("recurrent", "chunked", "quadratic"):
        _, s = az.delta_rule(k, k, v, beta, form=form, chunk_size=5, return_state=True)
        read = az.delta_rule(k[:, :, dk:], k[:, :, dk:], torch.zeros(1, 1, dk, 3, dtype=torch.float64),
                             torch.zeros(1, 1, dk, dtype=torch.float64), scale=1.0, initial_state=s, form=form)
        assert rel_err(read, v[:, :, dk:]) < 1e-10, form


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_compute_in_float32(family: str, dtype: torch.dtype) -> None:
    x, run = make(family, n=20, dtype=torch.float32)
    xh = {name: t.to(dtype) for name, t in x.items()}
    out, s = run(**xh, form="chunked", chunk_size=8, return_state=True)
    assert out.dtype == dtype and s.dtype == torch.float32
    want = run(**{name: t.float() for name, t in xh.items()}, form="recurrent")
    assert rel_err(out, want) < 1e-2


def test_default_scale_and_auto_form() -> None:
    x, run = make("gla", n=9)
    base = run(**x, scale=1 / math.sqrt(5))
    assert rel_err(run(**x), base) < 1e-14
    assert rel_err(run(**x, scale=0.5), run(**{**x, "q": x["q"] * 0.5}, scale=1.0)) < 1e-14
    assert [resolve_form("auto", n, 64) for n in (1, 2, 64, 65)] == ["recurrent", "quadratic", "quadratic", "chunked"]
    assert resolve_form("chunked", 1, 64) == "chunked"


def _bad_cases() -> list[tuple[str, Callable[[], object], type, str]]:
    q, k, v = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 5)
    gam, gd, beta = torch.full((2,), 0.9), -torch.rand(1, 2, 4, 3), torch.rand(1, 2, 4)
    return [
        ("gamma one", lambda: az.retention(q, k, v, torch.ones(2)), ValueError, "gamma"),
        ("gamma zero", lambda: az.retention(q, k, v, torch.zeros(2)), ValueError, "gamma"),
        ("gamma shape", lambda: az.retention(q, k, v, torch.full((3,), 0.5)), ValueError, "gamma"),
        ("gamma float", lambda: az.retention(q, k, v, 0.9), TypeError, "gamma"),
        ("positive log_decay", lambda: az.gated_linear_attention(q, k, v, -gd + 0.1), ValueError, "log_decay"),
        ("nan log_decay", lambda: az.gated_linear_attention(q, k, v, gd * float("nan")), ValueError, "log_decay"),
        ("log_decay shape", lambda: az.gated_linear_attention(q, k, v, gd[..., :2]), ValueError, "log_decay"),
        ("log_decay int", lambda: az.gated_linear_attention(q, k, v, gd.long()), TypeError, "log_decay"),
        ("beta > 1", lambda: az.delta_rule(q, k, v, beta + 1), ValueError, "beta"),
        ("beta < 0", lambda: az.delta_rule(q, k, v, -beta - 0.1), ValueError, "beta"),
        ("beta shape", lambda: az.delta_rule(q, k, v, beta[..., :3]), ValueError, "beta"),
        ("delta log_decay", lambda: az.delta_rule(q, k, v, beta, log_decay=-gd), ValueError, "log_decay"),
        ("delta log_decay shape", lambda: az.delta_rule(q, k, v, beta, log_decay=gd[..., :2]), ValueError,
         "log_decay"),
        ("q k shapes", lambda: az.retention(q, k[:, :, :3], v[:, :, :3], gam), ValueError, "q and k"),
        ("v length", lambda: az.retention(q, k, v[:, :, :3], gam), ValueError, "length"),
        ("rank", lambda: az.retention(q[0], k[0], v[0], gam), ValueError, "rank 4"),
        ("dtype mix", lambda: az.retention(q, k.double(), v, gam), TypeError, "dtype"),
        ("int q", lambda: az.retention(q.long(), k.long(), v.long(), gam), TypeError, "q must be"),
        ("state shape", lambda: az.retention(q, k, v, gam, initial_state=torch.zeros(1, 2, 3, 3)),
         ValueError, "initial_state"),
        ("state type", lambda: az.retention(q, k, v, gam, initial_state=[0.0]), TypeError, "initial_state"),
        ("form", lambda: az.retention(q, k, v, gam, form="fast"), ValueError, "form"),
        ("chunk zero", lambda: az.gated_linear_attention(q, k, v, gd, chunk_size=0), ValueError, "chunk_size"),
        ("chunk float", lambda: az.delta_rule(q, k, v, beta, chunk_size=2.0), TypeError, "chunk_size"),
        ("scale", lambda: az.delta_rule(q, k, v, beta, scale="x"), TypeError, "scale"),
        ("return_state", lambda: az.delta_rule(q, k, v, beta, return_state=1), TypeError, "return_state"),
        ("empty", lambda: az.retention(q[:, :, :0], k[:, :, :0], v[:, :, :0], gam), ValueError, "N >= 1"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_name_the_argument(case: tuple[str, Callable[[], object], type, str]) -> None:
    _, call, exc, words = case
    with pytest.raises(exc, match=words):
        call()


def test_docs_example_runs() -> None:
    run_blocks("docs/recurrent.md")


# The pinned signatures (DESIGN.md, "Additions pinned"): the shared keyword tail is one contract;
# reformatting the def lines or sharing docstring text must not change a name, kind, default or type.
_TAIL = ("scale: 'float | None' = None, initial_state: 'Tensor | None' = None, return_state: 'bool' = False, "
         "form: 'str' = 'auto', chunk_size: 'int | None' = None, cu_seqlens: 'Tensor | None' = None) "
         "-> 'Tensor | tuple[Tensor, Tensor]'")
PINNED_SIGNATURES = {
    "retention": "(q: 'Tensor', k: 'Tensor', v: 'Tensor', gamma: 'Tensor', *, " + _TAIL,
    "gated_linear_attention": "(q: 'Tensor', k: 'Tensor', v: 'Tensor', log_decay: 'Tensor', *, " + _TAIL,
    "delta_rule": "(q: 'Tensor', k: 'Tensor', v: 'Tensor', beta: 'Tensor', *, log_decay: 'Tensor | None' = None, "
                  + _TAIL.replace("None) -> ", "None, allow_neg_eigval: 'bool' = False) -> "),
}


@pytest.mark.parametrize("name", sorted(PINNED_SIGNATURES))
def test_pinned_signature_and_documented_keywords(name: str) -> None:
    fn = getattr(az, name)
    assert str(inspect.signature(fn)) == PINNED_SIGNATURES[name]
    doc = inspect.getdoc(fn) or ""
    for param in inspect.signature(fn).parameters:  # help() names every argument
        assert re.search(rf"\b{param}\b", doc), f"{name}: {param} is not in the docstring"
