"""Gated DeltaProduct and the negative-eigenvalue option: the kernels equal float64 token loops written
from the recurrences here (not the micro-token construction), decode == full for the module, cost."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import attnzoo as az
from attnzoo.functional.recurrent.delta_product import delta_product
from attnzoo.variants import build_attention
from recurrent_oracle import token_loop


def product_loop(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, nh: int,
                 s0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per token: ``S = a_t S``, then ``n_h`` delta steps ``S += beta k (v - S^T k)^T``, then ``o = S^T q / sqrt(D)``."""
    return token_loop("delta", q, k, v, g, beta, s0=s0, num_householder=nh)


def make(n: int = 7, nh: int = 3, hk: int = 2, ratio: int = 2, dk: int = 4, dv: int = 3, neg: bool = False,
         seed: int = 0) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hv = hk * ratio

    def rand(*s: int) -> Tensor:
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    return {"q": rand(1, hk, n, dk), "k": F.normalize(rand(1, hk, n * nh, dk), dim=-1), "v": rand(1, hv, n * nh, dv),
            "beta": torch.rand(1, hv, n * nh, generator=gen, dtype=torch.float64) * (2 if neg else 1),
            "g": -torch.rand(1, hv, n, generator=gen, dtype=torch.float64), "s0": rand(1, hv, dk, dv)}


@pytest.mark.parametrize("nh", [1, 2, 3])
@pytest.mark.parametrize("neg", [False, True])
def test_delta_product_equals_the_token_loop(nh: int, neg: bool) -> None:
    x = make(n=9, nh=nh, neg=neg)
    ref, s_ref = product_loop(x["q"], x["k"], x["v"], x["beta"], x["g"], nh, x["s0"])
    for form, chunk in [("recurrent", None), ("chunked", 4), ("chunked", 64), ("auto", None)]:
        out, s = delta_product(x["q"], x["k"], x["v"], x["beta"], num_householder=nh, log_decay=x["g"],
                               initial_state=x["s0"], return_state=True, form=form, chunk_size=chunk,
                               allow_neg_eigval=neg)
        err = max(float((out - ref).abs().max() / ref.abs().max()), float((s - s_ref).abs().max() / s_ref.abs().max()))
        assert err < 1e-10, f"nh={nh} neg={neg} form={form} chunk={chunk}: {err:.2e}"


def test_delta_product_packed_and_gradcheck() -> None:
    x = make(n=6, nh=2, ratio=1, dk=3, dv=2, seed=1)
    cu = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    out = delta_product(x["q"], x["k"], x["v"], x["beta"], num_householder=2, log_decay=x["g"], cu_seqlens=cu,
                        chunk_size=3)
    for lo, hi in ((0, 2), (2, 6)):
        alone = product_loop(x["q"][:, :, lo:hi], x["k"][:, :, 2 * lo:2 * hi], x["v"][:, :, 2 * lo:2 * hi],
                             x["beta"][:, :, 2 * lo:2 * hi], x["g"][:, :, lo:hi], 2)[0]
        torch.testing.assert_close(out[:, :, lo:hi], alone, rtol=1e-10, atol=1e-12)
    names = ["q", "k", "v", "beta", "g"]

    def f(*ts: Tensor) -> Tensor:
        d = dict(zip(names, ts, strict=True))
        return delta_product(d["q"], d["k"], d["v"], d["beta"], num_householder=2, log_decay=d["g"], chunk_size=4)

    assert torch.autograd.gradcheck(f, tuple(x[n].clone().requires_grad_() for n in names))


def test_negative_eigenvalues_in_the_delta_rule_equal_the_token_loop() -> None:
    x = make(n=13, nh=1, neg=True, seed=2)
    ref, s_ref = token_loop("delta", x["q"], x["k"], x["v"], x["g"], x["beta"], s0=x["s0"])
    out, s = az.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["g"], initial_state=x["s0"],
                           return_state=True, chunk_size=4, allow_neg_eigval=True)
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-10
    assert float((s - s_ref).abs().max() / s_ref.abs().max()) < 1e-10
    with pytest.raises(ValueError, match="beta"):  # without the option, beta > 1 is refused
        az.delta_rule(x["q"], x["k"], x["v"], x["beta"])


def test_bad_delta_product_shapes_are_named() -> None:
    x = make(n=4, nh=2)
    with pytest.raises(ValueError, match="num_householder"):
        delta_product(x["q"], x["k"][:, :, :7], x["v"], x["beta"], num_householder=2)
    with pytest.raises(ValueError, match="log_decay"):
        delta_product(x["q"], x["k"], x["v"], x["beta"], num_householder=2, log_decay=x["g"].repeat(1, 1, 2))
    with pytest.raises(TypeError, match="num_householder"):
        delta_product(x["q"], x["k"], x["v"], x["beta"], num_householder=2.0)


@pytest.mark.parametrize("kw", [{}, {"num_householder": 3, "num_v_heads": 6, "allow_neg_eigval": True},
                                {"conv_size": 0, "num_householder": 1}])
def test_module_decoding_equals_the_full_forward(kw: dict) -> None:
    torch.manual_seed(0)
    m = build_attention("gated_deltaproduct", 24, 3, chunk_size=4, **kw).double().eval()
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
        for steps in ([1] * 11, [4, 1, 6]):
            cache = m.init_cache(2, 11)
            outs, s = [], 0
            for n in steps:
                outs.append(m(x[:, s:s + n], cache=cache))
                s += n
            torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-11, atol=1e-11)


def test_one_householder_module_equals_gated_deltanet() -> None:
    torch.manual_seed(0)
    m = build_attention("gated_deltaproduct", 24, 3, num_householder=1).double().eval()
    g = build_attention("gated_deltanet", 24, 3).double().eval()
    g.load_state_dict(m.state_dict())
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), g(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [40, 300])
def test_cost_against_the_flop_counter(n: int) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    m = build_attention("gated_deltaproduct", 64, 8).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m(torch.randn(1, n, 64))
    est, measured = az.cost.estimate("gated_deltaproduct", n, 64, 8), fc.get_total_flops()
    assert abs(est.flops - measured) <= 0.15 * measured, f"N={n}: estimate {est.flops} vs measured {measured}"
    assert est.params == sum(p.numel() for p in m.parameters())
