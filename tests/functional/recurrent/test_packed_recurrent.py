"""Packed sequences (``cu_seqlens``, B == 1) in retention, GLA and the delta rule: equal to the float64
token loop on each sequence alone (``recurrent_oracle.packed_loop``), states ``[S, Hv, Dk, Dv]`` in
and out, gradients equal to calling each sequence alone; bad ``cu_seqlens`` named."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import attnzoo as az
from recurrent_oracle import packed_loop

FAMILIES = ["retention", "gla", "gla_scalar", "deltanet", "gated_deltanet", "kda"]
LENGTHS = [5, 1, 0, 17, 3, 9]


def make(family: str, lengths: list[int], hk: int = 2, ratio: int = 2, dk: int = 4, dv: int = 3,
         seed: int = 0) -> tuple[dict[str, Tensor], list[int], Callable[..., tuple[Tensor, Tensor]], str]:
    """Packed inputs, cu_seqlens as a list, the library call ``f(x, cu, **kw)`` and the oracle's kind."""
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t, hv, s = cu[-1], hk * ratio, len(lengths)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": rand(1, hk, t, dk), "k": F.normalize(rand(1, hk, t, dk), dim=-1), "v": rand(1, hv, t, dv),
         "s0": rand(s, hv, dk, dv)}
    if family == "retention":
        gamma = 0.5 + 0.45 * torch.rand(hv, generator=gen, dtype=torch.float64)
        x["g"] = gamma.log()[None, :, None].expand(1, hv, t).contiguous()

        def f(x: dict[str, Tensor], cu: Tensor, **kw: object) -> tuple[Tensor, Tensor]:
            return az.retention(x["q"], x["k"], x["v"], gamma, initial_state=x["s0"], return_state=True,
                                cu_seqlens=cu, **kw)

        return x, cu, f, "gla"
    shape = (1, hv, t, dk) if family in ("gla", "kda") else (1, hv, t)
    x["g"] = -torch.rand(*shape, generator=gen, dtype=torch.float64) * (0.0 if family == "deltanet" else 1.0)
    if family.startswith("gla"):
        def f(x: dict[str, Tensor], cu: Tensor, **kw: object) -> tuple[Tensor, Tensor]:
            return az.gated_linear_attention(x["q"], x["k"], x["v"], x["g"], initial_state=x["s0"],
                                             return_state=True, cu_seqlens=cu, **kw)

        return x, cu, f, "gla"
    x["beta"] = torch.rand(1, hv, t, generator=gen, dtype=torch.float64)

    def f(x: dict[str, Tensor], cu: Tensor, **kw: object) -> tuple[Tensor, Tensor]:
        return az.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=None if family == "deltanet" else x["g"],
                             initial_state=x["s0"], return_state=True, cu_seqlens=cu, **kw)

    return x, cu, f, "delta"


def rel_err(got: Tensor, ref: Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def i32(cu: list[int]) -> Tensor:
    return torch.tensor(cu, dtype=torch.int32)


@pytest.fixture(params=["per_sequence", "padded"])
def packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the chunked form runs packed sequences: each alone (CPU's default) or padded to whole
    chunks in one call (``_chunked_scan.PACK_CHUNKS_ON``: CUDA's default), forced here on CPU."""
    import attnzoo.functional.recurrent._chunked_scan as scan

    monkeypatch.setattr(scan, "PACK_CHUNKS_ON", frozenset({"cpu", "cuda"} if request.param == "padded" else ()))
    return str(request.param)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_each_sequence_alone_in_the_token_loop(family: str, packing: str) -> None:
    x, cu, f, kind = make(family, LENGTHS)
    ref, s_ref = packed_loop(kind, x["q"], x["k"], x["v"], x["g"], cu, x.get("beta"), s0=x["s0"])
    for form, chunk in [("recurrent", None), ("quadratic", None), ("chunked", 4), ("chunked", 64), ("auto", 8),
                        ("auto", None)]:
        out, s = f(x, i32(cu), form=form, chunk_size=chunk)
        assert out.shape == ref.shape and s.shape == s_ref.shape == (len(LENGTHS), *x["s0"].shape[1:])
        err = max(rel_err(out, ref), rel_err(s, s_ref))
        assert err < 1e-10, f"{family} form={form} chunk={chunk}: rel err {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_gradients_equal_each_sequence_alone(family: str, packing: str) -> None:
    """Gradients of one packed call equal the gradients of separate per-sequence calls."""
    lengths = [4, 1, 7, 0, 2]
    x, cu, f, _ = make(family, lengths, seed=1)
    leaves = {k: t.clone().requires_grad_() for k, t in x.items()}
    out, s = f(leaves, i32(cu), form="chunked", chunk_size=3)
    w1, w2 = torch.randn_like(out), torch.randn_like(s)
    got = torch.autograd.grad((out * w1).sum() + (s * w2).sum(), list(leaves.values()), allow_unused=True,
                              materialize_grads=True)
    leaves2 = {k: t.clone().requires_grad_() for k, t in x.items()}
    loss = 0.0
    for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
        one = {k: (t[i:i + 1] if k == "s0" else t[:, :, lo:hi]) for k, t in leaves2.items()}
        if hi == lo:
            loss = loss + (one["s0"] * w2[i:i + 1]).sum()
            continue
        o, st = f(one, i32([0, hi - lo]), form="chunked", chunk_size=3)
        loss = loss + (o * w1[:, :, lo:hi]).sum() + (st * w2[i:i + 1]).sum()
    want = torch.autograd.grad(loss, list(leaves2.values()), allow_unused=True, materialize_grads=True)
    for name, g, r in zip(x, got, want, strict=True):
        assert rel_err(g, r) < 1e-10, f"{family}: d{name} rel err {rel_err(g, r):.2e}"


def test_one_sequence_packed_equals_the_unpacked_call() -> None:
    x, cu, f, _ = make("kda", [13], seed=2)
    out, s = f(x, i32(cu), chunk_size=4)
    out2, s2 = az.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["g"], initial_state=x["s0"],
                             return_state=True, chunk_size=4)
    assert rel_err(out, out2) < 1e-12 and rel_err(s, s2) < 1e-12


def _bad() -> list[tuple[str, object, type, str]]:
    return [
        ("unsorted", i32([0, 5, 3, 8]), ValueError, "cu_seqlens"),
        ("beyond N", i32([0, 5, 9]), ValueError, "cu_seqlens"),
        ("short of N", i32([0, 5, 7]), ValueError, "cu_seqlens"),
        ("not from 0", i32([1, 5, 8]), ValueError, "cu_seqlens"),
        ("int64", torch.tensor([0, 5, 8]), TypeError, "cu_seqlens"),
        ("list", [0, 5, 8], TypeError, "cu_seqlens"),
        ("2-d", i32([0, 8]).view(1, 2), ValueError, "cu_seqlens"),
    ]


@pytest.mark.parametrize("case", _bad(), ids=lambda c: c[0])
def test_bad_cu_seqlens_is_named(case: tuple[str, object, type, str]) -> None:
    _, cu, exc, words = case
    q, k, v = torch.randn(1, 2, 8, 3), torch.randn(1, 2, 8, 3), torch.randn(1, 2, 8, 4)
    for call in (lambda: az.delta_rule(q, k, v, torch.rand(1, 2, 8), cu_seqlens=cu),
                 lambda: az.gated_linear_attention(q, k, v, -torch.rand(1, 2, 8, 3), cu_seqlens=cu),
                 lambda: az.retention(q, k, v, torch.full((2,), 0.9), cu_seqlens=cu)):
        with pytest.raises(exc, match=words):
            call()


@pytest.mark.parametrize("cu, exc, words", [
    ([0, 8], TypeError, "must be an int32 tensor [S+1], got list ([0, 8])"),
    (torch.tensor([0, 8]), TypeError,
     "must have dtype torch.int32 (as flash-attn's varlen API), got torch.int64; use .to(torch.int32)"),
    (i32([0, 8]).view(1, 2), ValueError, "must be 1-d [S+1] with S >= 1, got shape (1, 2)"),
    (i32([8]), ValueError, "must be 1-d [S+1] with S >= 1, got shape (1,)"),
], ids=["list", "int64", "2-d", "one entry"])
def test_kernel_and_module_name_a_bad_cu_seqlens_tensor_alike(cu: object, exc: type, words: str) -> None:
    """The kernels' and the modules' packed-input checks share their tensor checks: same text after the owner."""
    q, k, v = torch.randn(1, 2, 8, 3), torch.randn(1, 2, 8, 3), torch.randn(1, 2, 8, 4)
    with pytest.raises(exc) as kernel:
        az.gated_linear_attention(q, k, v, -torch.rand(1, 2, 8, 3), cu_seqlens=cu)
    with pytest.raises(exc) as module:
        az.variants.build_attention("gla", 16, 2)(torch.randn(1, 8, 16), cu_seqlens=cu)
    assert str(kernel.value).startswith("gated_linear_attention: ")
    assert str(module.value).startswith("GatedLinearAttention: ")
    assert str(kernel.value).split(": ", 1)[1] == str(module.value).split(": ", 1)[1] == f"cu_seqlens {words}"


def test_packed_needs_batch_one_and_per_sequence_states() -> None:
    q, k, v = torch.randn(2, 2, 8, 3), torch.randn(2, 2, 8, 3), torch.randn(2, 2, 8, 4)
    with pytest.raises(ValueError, match="B == 1"):
        az.delta_rule(q, k, v, torch.rand(2, 2, 8), cu_seqlens=i32([0, 3, 8]))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[S, Hv, Dk, Dv\]"):
        az.delta_rule(q[:1], k[:1], v[:1], torch.rand(1, 2, 8), cu_seqlens=i32([0, 3, 8]),
                      initial_state=torch.zeros(1, 2, 3, 4))


def test_short_conv_packed_restarts_and_keeps_a_cache_per_sequence() -> None:
    """The short causal convolution on packed sequences equals each sequence alone, from its own previous
    inputs ``prev[i]``, and returns each sequence's last ``kernel - 1`` inputs (shorter ones padded by prev)."""
    from attnzoo.nn.recurrent import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(5, 4, True, {"dtype": torch.float64})
    lengths = [3, 1, 0, 6]
    cu = [0, 3, 4, 4, 10]
    x = torch.randn(1, 10, 5, dtype=torch.float64)
    prev = torch.randn(4, 5, 3, dtype=torch.float64)
    y, last = conv(x, prev, i32(cu))
    assert y.shape == x.shape and last.shape == (4, 5, 3)
    for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
        y1, last1 = conv(x[:, lo:hi], prev[i:i + 1])
        torch.testing.assert_close(y[:, lo:hi], y1, rtol=0, atol=1e-14)
        torch.testing.assert_close(last[i:i + 1], last1, rtol=0, atol=0)
    assert lengths[2] == 0 and torch.equal(last[2], prev[2])


def test_a_packed_module_call_takes_no_cache_or_mask() -> None:
    m = az.variants.build_attention("gated_deltanet", 16, 2)
    x = torch.randn(1, 6, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, cu_seqlens=i32([0, 2, 6]), cache=m.init_cache(1, 8))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, cu_seqlens=i32([0, 2, 6]), mask=torch.ones(1, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch size 1"):
        m(torch.randn(2, 6, 16), cu_seqlens=i32([0, 2, 6]))


@pytest.mark.parametrize("packed", [False, True])
def test_chunk_groups_record_one_split_and_one_cat_not_a_slice_per_group(packed: bool, packing: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Many chunk groups (a tiny group budget) give the gradients of one group, and autograd records no
    slice of a full-length tensor and no in-place write into one: each would make the backward build a
    full-length gradient per group (quadratic in N; 16k tokens spent half their backward filling zeros)."""
    import collections

    import attnzoo.functional.recurrent._chunked_scan as scan

    gen = torch.Generator().manual_seed(0)
    n = 300
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    x = {"q": q, "k": F.normalize(k, dim=-1), "v": v, "beta": torch.rand(1, 2, n, generator=gen, dtype=torch.float64),
         "log_decay": -torch.rand(1, 2, n, 8, generator=gen, dtype=torch.float64)}
    cu = torch.tensor([0, 37, 200, n], dtype=torch.int32) if packed else None

    def grads(budget: int) -> tuple[list[torch.Tensor], collections.Counter[tuple[str, int]]]:
        monkeypatch.setattr(scan, "GROUP_BUDGET_BYTES", budget)
        leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
        out = az.delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], log_decay=leaves["log_decay"],
                            form="chunked", chunk_size=16, cu_seqlens=cu)
        nodes, seen, todo = collections.Counter(), set(), [out.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            sizes = tuple(getattr(fn, "_saved_self_sym_sizes", ()))
            nodes[(type(fn).__name__, max(sizes, default=0))] += 1
            todo.extend(nxt for nxt, _ in fn.next_functions)
        return list(torch.autograd.grad(out.pow(2).sum(), list(leaves.values()))), nodes

    want, _ = grads(scan.GROUP_BUDGET_BYTES)
    got, nodes = grads(1)  # one chunk per group: 19 groups
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not [key for key in nodes if key[0] == "CopySlices"]
    assert not [key for key in nodes if key[0] in ("SliceBackward0", "SelectBackward0") and key[1] >= n]
