"""The delta rule with a decay per key channel (KDA): every form equals the float64 token loop.

The reference is ``recurrent_oracle.token_loop`` (written from the recurrence
``S'_{t-1} = diag(exp(g_t)) S_{t-1}; S_t = S' + beta_t k_t (v_t - S'^T k_t)^T; o_t = scale S_t^T q_t``),
not the chunked code.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import attnzoo as az
from recurrent_oracle import token_loop


def make(b: int = 1, h: int = 2, n: int = 9, dk: int = 5, dv: int = 4, decay: float = 1.0, seed: int = 0,
         dtype: torch.dtype = torch.float64, per_channel: bool = True) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen, dtype=dtype) for d in (dk, dk, dv))
    shape = (b, h, n, dk) if per_channel else (b, h, n)
    return {"q": q, "k": F.normalize(k, dim=-1), "v": v, "beta": torch.rand(b, h, n, generator=gen, dtype=dtype),
            "log_decay": -decay * torch.rand(*shape, generator=gen, dtype=dtype),
            "initial_state": torch.randn(b, h, dk, dv, generator=gen, dtype=dtype)}


def oracle(x: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    return token_loop("delta", x["q"], x["k"], x["v"], x["log_decay"], x["beta"], s0=x["initial_state"])


def rel_err(got: Tensor, ref: Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


FORMS = [("recurrent", None), ("quadratic", None), ("chunked", 1), ("chunked", 4), ("chunked", 13),
         ("chunked", 16), ("chunked", 64), ("auto", 4), ("auto", None)]


def run(x: dict[str, Tensor], **kw: object) -> tuple[Tensor, Tensor]:
    return az.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"],
                         initial_state=x["initial_state"], return_state=True, **kw)  # type: ignore[return-value]


@pytest.mark.parametrize("n", [1, 2, 7, 16, 17, 37])
@pytest.mark.parametrize("per_channel", [True, False])
def test_every_form_equals_the_token_loop(n: int, per_channel: bool) -> None:
    x = make(n=n, per_channel=per_channel)
    ref, s_ref = oracle(x)
    for form, chunk in FORMS:
        out, s = run(x, form=form, chunk_size=chunk)
        err = max(rel_err(out, ref), rel_err(s, s_ref))
        assert err < 1e-10, f"N={n} per_channel={per_channel} form={form} chunk={chunk}: max rel err {err:.2e}"


def test_strong_decays_stay_finite_and_exact() -> None:
    """Decays down to e^-60 per token (sums of e^-1000s over a chunk) and channels that never decay."""
    x = make(n=40, dk=6, decay=60.0, seed=1)
    x["log_decay"][..., 0] = 0.0  # a channel that keeps everything
    x["log_decay"][:, :, ::7, 1] = -1e4  # occasional total resets of one channel
    ref, s_ref = oracle(x)
    for form, chunk in [("chunked", 16), ("chunked", 40), ("quadratic", None), ("recurrent", None)]:
        out, s = run(x, form=form, chunk_size=chunk)
        assert torch.isfinite(out).all() and torch.isfinite(s).all()
        err = max(rel_err(out, ref), rel_err(s, s_ref))
        assert err < 1e-10, f"form={form} chunk={chunk}: {err:.2e}"
        x32 = {k: t.float() for k, t in x.items()}
        out32, s32 = run(x32, form=form, chunk_size=chunk)
        assert max(rel_err(out32, ref), rel_err(s32, s_ref)) < 1e-5, f"float32 form={form}"


def test_float32_within_1e5_of_the_float64_token_loop() -> None:
    x = make(n=150, dk=16, dv=8, decay=0.5, seed=2)
    ref, s_ref = oracle(x)
    x32 = {k: t.float() for k, t in x.items()}
    for form, chunk in [("chunked", 32), ("chunked", 64), ("auto", None), ("recurrent", None)]:
        out, s = run(x32, form=form, chunk_size=chunk)
        assert out.dtype == torch.float32 and s.dtype == torch.float32
        err = max(rel_err(out, ref), rel_err(s, s_ref))
        assert err < 1e-5, f"form={form} chunk={chunk}: {err:.2e}"


@pytest.mark.parametrize("chunk", [4, 64])
def test_gradients_equal_the_token_loop(chunk: int) -> None:
    x = make(n=11, dk=4, dv=3, seed=3)
    w_out, w_s = torch.randn(1, 2, 11, 3, dtype=torch.float64), torch.randn(1, 2, 4, 3, dtype=torch.float64)

    def grads(f) -> list[Tensor]:  # type: ignore[no-untyped-def]
        leaves = {k: t.clone().requires_grad_() for k, t in x.items()}
        out, s = f(leaves)
        return list(torch.autograd.grad((out * w_out).sum() + (s * w_s).sum(), list(leaves.values())))

    want = grads(oracle)
    for form in ("chunked", "recurrent", "quadratic"):
        got = grads(lambda leaves, form=form: run(leaves, form=form, chunk_size=chunk))
        for name, g, r in zip(x, got, want, strict=True):
            assert rel_err(g, r) < 1e-9, f"form={form} chunk={chunk}: d{name} rel err {rel_err(g, r):.2e}"


def test_gradcheck_chunked() -> None:
    x = make(n=7, dk=3, dv=2, seed=4)
    names = list(x)

    def f(*ts: Tensor) -> tuple[Tensor, Tensor]:
        return run(dict(zip(names, ts, strict=True)), form="chunked", chunk_size=3)

    assert torch.autograd.gradcheck(f, tuple(t.clone().requires_grad_() for t in x.values()))


def test_state_chaining_equals_one_call() -> None:
    x = make(n=23, seed=5)
    full, s_full = run(x, chunk_size=8)
    first = {k: (t[:, :, :10] if t.dim() >= 3 and k != "initial_state" else t) for k, t in x.items()}
    rest = {k: (t[:, :, 10:] if t.dim() >= 3 and k != "initial_state" else t) for k, t in x.items()}
    o1, s1 = run(first, chunk_size=8)
    rest["initial_state"] = s1
    o2, s2 = run(rest, chunk_size=8)
    assert rel_err(torch.cat([o1, o2], dim=2), full) < 1e-12 and rel_err(s2, s_full) < 1e-12


@pytest.mark.parametrize("bad", ["positive", "shape", "nan"])
def test_bad_per_channel_decay_names_log_decay(bad: str) -> None:
    x = make(n=4)
    g = {"positive": x["log_decay"].abs() + 0.1, "shape": x["log_decay"][..., :2],
         "nan": x["log_decay"] * float("nan")}[bad]
    with pytest.raises(ValueError, match="log_decay"):
        az.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=g)
