"""The two plans of the per-channel (vector) decay scores of GLA and KDA (``attnzoo.functional.recurrent.gla``).

The fast plan (blocks of ``MATMUL_SUB_CHUNK`` tokens on the diagonal, one matmul each) runs when every
block's total log decay is within ``MATMUL_DIAGONAL_SPAN``; otherwise the exact elementwise plan runs.
Both must give the definition ``A[t, s] = sum_d q_td k_sd exp(b_td - b_sd)`` (``s <= t``) and the same
gradients, for one query set or a stack of them, and the layers built on them must equal the float64
token loops of ``tests/recurrent_oracle.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import attnzoo as az
import attnzoo.functional.recurrent.gla as gla
from recurrent_oracle import token_loop


def definition(q: Tensor, k: Tensor, g: Tensor) -> Tensor:
    """The scores from their definition, in float64: ``[..., C, Dk]`` -> ``[..., C, C]``."""
    b = g.double().cumsum(dim=-2)
    rel = b.unsqueeze(-2) - b.unsqueeze(-3)  # [..., t, s, Dk]: b_t - b_s
    causal = torch.ones(g.shape[-2], g.shape[-2], dtype=torch.bool).tril()
    rel = rel.masked_fill(~causal[..., None], float("-inf"))
    return (q.double().unsqueeze(-2) * k.double().unsqueeze(-3) * rel.exp()).sum(-1)


def inputs(c: int, decay: float, dtype: torch.dtype = torch.float64, seed: int = 0,
           stack: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lead = (stack, 2, 3) if stack else (2, 3)
    q = torch.randn(*lead, c, 5, generator=gen, dtype=dtype)
    k = torch.randn(2, 3, c, 5, generator=gen, dtype=dtype)
    g = -decay * torch.rand(2, 3, c, 5, generator=gen, dtype=dtype)
    return q, k, g


def rel_err(got: Tensor, ref: Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def test_the_plan_follows_the_decays_the_dtype_and_the_chunk() -> None:
    """The fast plan takes the largest block (16, 32, ... up to the whole chunk) whose every total log
    decay per channel is within the span; none: the exact elementwise plan."""
    sub = gla.MATMUL_SUB_CHUNK
    _, _, weak = inputs(64, 0.1)
    _, _, medium = inputs(64, 2.5)  # 16 tokens sum to about -20 (within float64's 50), 64 tokens to about -80
    _, _, strong = inputs(64, 10.0)
    assert gla._plan(weak, gla.SUB_CHUNK) == (64, True)  # the whole chunk is one block
    assert gla._plan(weak.float(), gla.SUB_CHUNK) == (64, True)
    assert gla._plan(weak[..., :50, :], gla.SUB_CHUNK) == (64, True)  # 50 tokens: one block, padded
    assert gla._plan(medium, gla.SUB_CHUNK) in ((sub, True), (2 * sub, True))
    assert gla._plan(strong, gla.SUB_CHUNK) == (gla.SUB_CHUNK, False)  # 16 tokens of up to e^-10: beyond the span
    assert gla._plan(weak.bfloat16(), gla.SUB_CHUNK) == (gla.SUB_CHUNK, False)  # no span for bfloat16
    assert gla._plan(weak[..., : 2 * sub - 1, :], gla.SUB_CHUNK) == (gla.SUB_CHUNK, False)  # under two blocks
    assert gla._plan(weak, sub) == (sub, False)  # the quadratic form's one block: unchanged
    # the bound is on each block's total per channel, inclusive
    span = gla.MATMUL_DIAGONAL_SPAN[torch.float64]
    at_bound = torch.full((1, 64, 1), -span / sub, dtype=torch.float64)
    assert gla._plan(at_bound, gla.SUB_CHUNK) == (sub, True)  # blocks of 32 would decay by twice the span
    assert not gla._plan(at_bound * 1.01, gla.SUB_CHUNK)[1]
    assert gla._plan(at_bound / 4, gla.SUB_CHUNK) == (64, True)  # the whole chunk exactly at the span


@pytest.mark.parametrize("c", [32, 50, 64, 100])
@pytest.mark.parametrize("stack", [0, 2])
def test_both_plans_equal_the_definition(c: int, stack: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of two blocks, not a multiple of a block, a power of two and beyond; one query set or a stack."""
    q, k, g = inputs(c, 0.3, stack=stack, seed=c)
    want = definition(q, k, g)
    assert gla._plan(g, gla.SUB_CHUNK)[1]
    fast = gla._vector_scores(q, k, g, gla.SUB_CHUNK)
    monkeypatch.setattr(gla, "MATMUL_DIAGONAL_SPAN", {})
    exact = gla._vector_scores(q, k, g, gla.SUB_CHUNK)
    assert rel_err(fast, want) < 1e-12
    assert rel_err(exact, want) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fast_plan_at_its_span_bound_keeps_the_dtype_precision(dtype: torch.dtype) -> None:
    """Every block decaying by exactly the span (float32 e^-20 per channel over 16 tokens): the factors
    ``exp(+-(b_t - b_m))`` are as large as the plan allows and the masked products stay exact."""
    q, k, _ = inputs(64, 1.0, dtype=dtype)
    span = gla.MATMUL_DIAGONAL_SPAN[dtype]
    g = torch.full_like(q[..., :1], -span / gla.MATMUL_SUB_CHUNK).expand_as(q).contiguous()
    assert gla._plan(g, gla.SUB_CHUNK)[1]
    got = gla._vector_scores(q, k, g, gla.SUB_CHUNK)
    assert torch.isfinite(got).all()
    assert rel_err(got, definition(q, k, g)) < (2e-6 if dtype == torch.float32 else 1e-13)


@pytest.mark.parametrize("plan", ["fast", "exact"])
@pytest.mark.parametrize("stack", [0, 2])
def test_the_operator_gradients_equal_autograd_of_the_definition(plan: str, stack: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``attnzoo::gla_vector_scores``'s analytic backward, by either plan, with a stack of queries
    summing their share of ``dk`` and ``dg``; ``opcheck`` passes on the stacked call."""
    if plan == "exact":
        monkeypatch.setattr(gla, "MATMUL_DIAGONAL_SPAN", {})
    q, k, g = (t.requires_grad_() for t in inputs(50, 0.3, stack=stack, seed=3))
    weight = torch.randn(*q.shape[:-1], q.shape[-2], generator=torch.Generator().manual_seed(4), dtype=q.dtype)
    got = torch.autograd.grad((gla.vector_scores(q, k, g, gla.SUB_CHUNK) * weight).sum(), (q, k, g))
    want = torch.autograd.grad((definition(q, k, g) * weight).sum(), (q, k, g))
    for name, a, b in zip("qkg", got, want, strict=True):
        assert rel_err(a, b) < 1e-11, f"d{name} ({plan}, stack={stack}): {rel_err(a, b):.2e}"
    torch.library.opcheck(gla.vector_scores, (q, k, g, gla.SUB_CHUNK))


@pytest.mark.parametrize("decay", [0.1, 2.5, 10.0])  # the whole chunk, blocks of 16/32, the exact plan
@pytest.mark.parametrize("stack", [0, 2])
def test_chunk_scores_equal_the_definition_with_gradients(decay: float, stack: int) -> None:
    """``chunk_scores`` (what GLA and KDA call): one autograd matmul when the whole chunk is one block,
    the halving operator otherwise; zero above the diagonal, values and float64 gradients as the definition."""
    q, k, g = (t.requires_grad_() for t in inputs(64, decay, stack=stack, seed=7))
    _assert_chunk_scores_exact(q, k, g, f"decay={decay}, stack={stack}")


def _assert_chunk_scores_exact(q: Tensor, k: Tensor, g: Tensor, label: str) -> None:
    """``chunk_scores`` == the definition (values to 1e-12, zero above the diagonal, float64 gradients)."""
    got = gla.chunk_scores(q, k, g, gla.SUB_CHUNK)
    want = definition(q, k, g)
    assert rel_err(got, want) < 1e-12
    assert not got.detach().triu(1).any()
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(8), dtype=got.dtype)
    grads = torch.autograd.grad((got * weight).sum(), (q, k, g))
    wants = torch.autograd.grad((want * weight).sum(), (q, k, g))
    for name, a, b in zip("qkg", grads, wants, strict=True):
        assert rel_err(a, b) < 1e-11, f"d{name} ({label}): {rel_err(a, b):.2e}"


def _mixed(c: int, dtype: torch.dtype = torch.float64, stack: int = 0, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Channels 1 and 3 decay strongly (up to e^-5 a token), the others weakly: the channel split."""
    q, k, g = inputs(c, 0.05, dtype=dtype, stack=stack, seed=seed)
    strong = torch.zeros(5, dtype=torch.bool)
    strong[[1, 3]] = True
    g = torch.where(strong, g * 100, g)
    return q, k, g


@pytest.mark.parametrize("stack", [0, 2])
def test_strong_channels_are_split_off_and_the_sum_equals_the_definition(stack: int) -> None:
    """Some channels beyond the span, the others within it as whole chunks: the strong ones (lowest totals
    first) run through the halving operator, the rest through one matmul; values and float64 gradients
    equal the definition."""
    q, k, g = (t.requires_grad_() for t in _mixed(64, stack=stack, seed=4))
    assert not gla._plan(g.detach(), gla.SUB_CHUNK)[1]  # no single plan fits
    exact = gla._exact_channels(g.detach(), gla.SUB_CHUNK)
    assert exact is not None and sorted(exact.flatten().unique().tolist()) == [1, 3]
    _assert_chunk_scores_exact(q, k, g, f"split, stack={stack}")


def test_the_split_needs_most_channels_weak() -> None:
    """More than half the channels beyond the span, or none: no split (the halving or the whole chunk)."""
    _, _, g = inputs(64, 0.05)
    assert gla._exact_channels(g, gla.SUB_CHUNK) is None  # all weak: the whole-chunk plan serves it
    assert gla._exact_channels(g * 400, gla.SUB_CHUNK) is None  # all strong
    _, _, mixed = _mixed(64)
    assert gla._exact_channels(mixed, gla.MATMUL_SUB_CHUNK) is None  # the quadratic form's one block
    assert gla._exact_channels(mixed.bfloat16(), gla.SUB_CHUNK) is None  # no span for bfloat16


@pytest.mark.parametrize("kind", ["delta", "gla"])
def test_kda_and_gla_with_mixed_decays_equal_the_token_loop(kind: str) -> None:
    """The channel split inside the chunked layers (3.5 chunks of 64), float32 within 1e-5 of the float64 loop."""
    x = _layer_inputs(224, 0.05, seed=6)
    x["log_decay"][..., [0, 4]] *= 200  # two of six channels strong
    x = {n: t.float() for n, t in x.items()}
    exact = gla._exact_channels(x["log_decay"][..., :64, :], gla.SUB_CHUNK)  # the first chunk takes the split
    assert exact is not None and sorted(exact.flatten().unique().tolist()) == [0, 4]
    if kind == "delta":
        out = az.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"],
                            initial_state=x["initial_state"], form="chunked", chunk_size=64)
        ref, _ = token_loop("delta", *(x[n].double() for n in ("q", "k", "v", "log_decay", "beta")),
                            s0=x["initial_state"].double())
    else:
        out = az.gated_linear_attention(x["q"], x["k"], x["v"], x["log_decay"], initial_state=x["initial_state"],
                                        form="chunked", chunk_size=64)
        ref, _ = token_loop("gla", *(x[n].double() for n in ("q", "k", "v", "log_decay")),
                            s0=x["initial_state"].double())
    assert rel_err(out, ref) < 1e-5


def test_the_whole_chunk_plan_in_float32_at_its_span_bound() -> None:
    """float32, every channel decaying by exactly the span over the chunk: finite, float32 precision."""
    q, k, _ = inputs(64, 1.0, dtype=torch.float32)
    span = gla.MATMUL_DIAGONAL_SPAN[torch.float32]
    g = torch.full_like(q[..., :1], -span / 64).expand_as(q).contiguous()
    assert gla._plan(g, gla.SUB_CHUNK) == (64, True)
    got = gla.chunk_scores(q, k, g, gla.SUB_CHUNK)
    assert torch.isfinite(got).all()
    assert rel_err(got, definition(q, k, g)) < 2e-6


def test_gradcheck_on_the_fast_plan() -> None:
    q, k, g = (t[:1, :1, ..., :3].contiguous().requires_grad_() for t in inputs(33, 0.2, seed=5))
    assert gla._plan(g, gla.SUB_CHUNK)[1]
    assert torch.autograd.gradcheck(lambda q, k, g: gla.vector_scores(q, k, g, gla.SUB_CHUNK), (q, k, g))


def _layer_inputs(n: int, decay: float, seed: int = 0) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    return {"q": q, "k": F.normalize(k, dim=-1), "v": v, "beta": torch.rand(1, 2, n, generator=gen, dtype=torch.float64),
            "log_decay": -decay * torch.rand(1, 2, n, 6, generator=gen, dtype=torch.float64),
            "initial_state": torch.randn(1, 2, 6, 6, generator=gen, dtype=torch.float64)}


@pytest.mark.parametrize("decay", [0.05, 2.5, 10.0])  # whole chunks; blocks of 16/32; strong decays: the exact plan
@pytest.mark.parametrize("kind", ["delta", "gla"])
def test_kda_and_gla_by_both_plans_equal_the_token_loop(kind: str, decay: float) -> None:
    """Chunked KDA (the delta rule with per-channel decays) and GLA over 3.5 chunks of 64, outputs,
    states and float64 gradients against the token loop."""
    x = {name: t.requires_grad_() for name, t in _layer_inputs(224, decay).items()}
    # chunks of 64 hold whole blocks of 16: the plan of the whole sequence is every chunk's
    assert gla._plan(x["log_decay"].detach(), gla.SUB_CHUNK)[1] == (decay < 5)
    if kind == "delta":
        out, s = az.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"],
                               initial_state=x["initial_state"], return_state=True, form="chunked", chunk_size=64)
        ref, s_ref = token_loop("delta", x["q"], x["k"], x["v"], x["log_decay"], x["beta"], s0=x["initial_state"])
    else:
        out, s = az.gated_linear_attention(x["q"], x["k"], x["v"], x["log_decay"], initial_state=x["initial_state"],
                                           return_state=True, form="chunked", chunk_size=64)
        ref, s_ref = token_loop("gla", x["q"], x["k"], x["v"], x["log_decay"], s0=x["initial_state"])
    assert max(rel_err(out, ref), rel_err(s, s_ref)) < 1e-10
    leaves = [x[n] for n in ("q", "k", "v", "log_decay")]
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    got = torch.autograd.grad((out * w).sum() + s.sum(), leaves)
    want = torch.autograd.grad((ref * w).sum() + s_ref.sum(), leaves)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-9
