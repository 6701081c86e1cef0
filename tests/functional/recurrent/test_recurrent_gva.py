"""Grouped value heads (GVA) in retention, GLA and the delta rule: ``q, k [B, Hk, N, Dk]``,
``v [B, Hv, N, Dv]``, value head ``j`` reads key head ``j // (Hv // Hk)``; equal to the float64
token loop (``recurrent_oracle``) for ratios 1, 2 and 4, in every form, with gradients."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import attnzoo as az
from recurrent_oracle import token_loop

FAMILIES = ["retention", "gla", "gla_scalar", "deltanet", "gated_deltanet", "kda"]


def make(family: str, hk: int, ratio: int, n: int = 11, dk: int = 4, dv: int = 3, b: int = 2,
         seed: int = 0) -> tuple[dict[str, Tensor], Callable[..., tuple[Tensor, Tensor]], tuple[Tensor, Tensor]]:
    """Inputs, the library call ``f(x, **kw) -> (out, state)`` and the oracle's ``(out, state)``."""
    gen = torch.Generator().manual_seed(seed)
    hv = hk * ratio

    def rand(*s: int) -> Tensor:
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    x = {"q": rand(b, hk, n, dk), "k": F.normalize(rand(b, hk, n, dk), dim=-1), "v": rand(b, hv, n, dv),
         "s0": rand(b, hv, dk, dv)}
    if family == "retention":
        x["gamma"] = 0.5 + 0.45 * torch.rand(hv, generator=gen, dtype=torch.float64)
        g = x["gamma"].log()[None, :, None].expand(b, hv, n)

        def f(x: dict[str, Tensor], **kw: object) -> tuple[Tensor, Tensor]:
            return az.retention(x["q"], x["k"], x["v"], x["gamma"], initial_state=x["s0"], return_state=True, **kw)

        return x, f, token_loop("gla", x["q"], x["k"], x["v"], g, s0=x["s0"])
    per_channel = family in ("gla", "kda")
    x["g"] = -torch.rand(*((b, hv, n, dk) if per_channel else (b, hv, n)), generator=gen, dtype=torch.float64)
    if family.startswith("gla"):
        def f(x: dict[str, Tensor], **kw: object) -> tuple[Tensor, Tensor]:
            return az.gated_linear_attention(x["q"], x["k"], x["v"], x["g"], initial_state=x["s0"],
                                             return_state=True, **kw)

        return x, f, token_loop("gla", x["q"], x["k"], x["v"], x["g"], s0=x["s0"])
    x["beta"] = torch.rand(b, hv, n, generator=gen, dtype=torch.float64)
    if family == "deltanet":
        x["g"] = torch.zeros(b, hv, n, dtype=torch.float64)

    def f(x: dict[str, Tensor], **kw: object) -> tuple[Tensor, Tensor]:
        return az.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=None if family == "deltanet" else x["g"],
                             initial_state=x["s0"], return_state=True, **kw)

    return x, f, token_loop("delta", x["q"], x["k"], x["v"], x["g"], x["beta"], s0=x["s0"])


def rel_err(got: Tensor, ref: Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_grouped_value_heads_equal_the_token_loop(family: str, ratio: int) -> None:
    x, f, (ref, s_ref) = make(family, hk=2, ratio=ratio)
    for form, chunk in [("recurrent", None), ("quadratic", None), ("chunked", 4), ("chunked", 64), ("auto", 8)]:
        out, s = f(x, form=form, chunk_size=chunk)
        assert out.shape == ref.shape and s.shape == s_ref.shape
        err = max(rel_err(out, ref), rel_err(s, s_ref))
        assert err < 1e-10, f"{family} ratio={ratio} form={form} chunk={chunk}: rel err {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_value_heads_gradients_equal_the_expanded_call(family: str) -> None:
    """Gradients of the grouped call equal those of the same call with q, k repeated per value head
    (the ratio-1 kernel, itself checked against the token loop above); dq, dk sum over the group."""
    x, f, _ = make(family, hk=2, ratio=2, n=9, b=1, seed=1)
    leaves = {k: t.clone().requires_grad_() for k, t in x.items()}
    out, s = f(leaves, form="chunked", chunk_size=4)
    w1, w2 = torch.randn_like(out), torch.randn_like(s)
    got = torch.autograd.grad((out * w1).sum() + (s * w2).sum(), list(leaves.values()), allow_unused=True,
                              materialize_grads=True)
    leaves2 = {k: t.clone().requires_grad_() for k, t in x.items()}
    expanded = dict(leaves2)
    expanded["q"], expanded["k"] = (leaves2[n].repeat_interleave(2, dim=1) for n in ("q", "k"))
    out2, s2 = f(expanded, form="chunked", chunk_size=4)
    want = torch.autograd.grad((out2 * w1).sum() + (s2 * w2).sum(), list(leaves2.values()), allow_unused=True,
                               materialize_grads=True)
    for name, g, r in zip(x, got, want, strict=True):
        assert rel_err(g, r) < 1e-10, f"{family}: d{name} rel err {rel_err(g, r):.2e}"


def test_a_head_ratio_that_does_not_divide_names_the_heads() -> None:
    q, k, v = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3), torch.randn(1, 3, 4, 5)
    with pytest.raises(ValueError, match="multiple of k's heads"):
        az.delta_rule(q, k, v, torch.rand(1, 3, 4))
    with pytest.raises(ValueError, match="gamma"):  # gamma is per value head
        az.retention(q, k, torch.randn(1, 4, 4, 5), torch.full((2,), 0.9))
    with pytest.raises(ValueError, match="beta"):
        az.delta_rule(q, k, torch.randn(1, 4, 4, 5), torch.rand(1, 2, 4))
