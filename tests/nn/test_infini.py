"""Infini-attention: against a plain reference, streaming == one call, decode == full, bounded memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnzoo as az
from attnzoo.functional.feature_maps.infini import InfiniState, infini_attention
from attnzoo.variants import build_attention


def qkv(b: int = 2, h: int = 2, n: int = 23, d: int = 8, dtype: torch.dtype = torch.float64,
        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3))  # type: ignore[return-value]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, seg: int,
              update: str) -> torch.Tensor:
    """The paper's equations, one segment and one batch element at a time, dense softmax."""
    b, h, n, d = q.shape
    out = torch.zeros_like(q)
    sig = lambda x: F.elu(x) + 1  # noqa: E731
    g = torch.sigmoid(gate)
    for bi in range(b):
        for hi in range(h):
            mem = torch.zeros(d, d, dtype=q.dtype)
            z = torch.zeros(d, dtype=q.dtype)
            for lo in range(0, n, seg):
                qs, ks, vs = q[bi, hi, lo:lo + seg], k[bi, hi, lo:lo + seg], v[bi, hi, lo:lo + seg]
                s = qs @ ks.T / d**0.5
                s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
                local = torch.softmax(s, dim=-1) @ vs
                den = sig(qs) @ z
                a_mem = (sig(qs) @ mem) / den[:, None] if lo > 0 else torch.zeros_like(local)
                out[bi, hi, lo:lo + seg] = g[hi] * a_mem + (1 - g[hi]) * local
                if update == "linear":
                    mem = mem + sig(ks).T @ vs
                else:
                    prev = (sig(ks) @ mem) / (sig(ks) @ z)[:, None] if lo > 0 else torch.zeros_like(vs)
                    mem = mem + sig(ks).T @ (vs - prev)
                z = z + sig(ks).sum(0)
    return out


# ------------------------------------------------------------------ the functional kernel
@pytest.mark.parametrize("update", ["linear", "delta"])
@pytest.mark.parametrize(("n", "seg"), [(23, 5), (20, 5), (7, 16), (9, 1)])
def test_matches_reference(update: str, n: int, seg: int) -> None:
    q, k, v = qkv(n=n)
    gate = torch.tensor([0.3, -1.2], dtype=torch.float64)
    out = infini_attention(q, k, v, gate, segment_len=seg, update=update)
    ref = reference(q, k, v, gate, seg, update)
    assert rel(out, ref) < 1e-12, f"n={n} seg={seg} {update}: rel err {rel(out, ref):.2e}"


def test_first_segment_is_gated_local_attention() -> None:
    q, k, v = qkv(n=6)
    gate = torch.tensor([0.0, 2.0], dtype=torch.float64)
    out = infini_attention(q, k, v, gate, segment_len=8)
    local = az.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, (1 - torch.sigmoid(gate)).view(1, 2, 1, 1) * local)


@pytest.mark.parametrize("update", ["linear", "delta"])
@pytest.mark.parametrize("pieces", [[5, 5, 5, 5, 3], [3, 4, 1, 9, 6], [1] * 23, [23]])
def test_streaming_equals_single_call(update: str, pieces: list[int]) -> None:
    q, k, v = qkv(n=23)
    gate = torch.tensor([0.5, -0.5], dtype=torch.float64)
    full = infini_attention(q, k, v, gate, segment_len=5, update=update)
    st: InfiniState | None = None
    outs, lo = [], 0
    for p in pieces:
        o, st = infini_attention(q[:, :, lo:lo + p], k[:, :, lo:lo + p], v[:, :, lo:lo + p], gate, segment_len=5,
                                 update=update, state=st, return_state=True)
        outs.append(o)
        lo += p
    assert rel(torch.cat(outs, 2), full) < 1e-12, f"pieces {pieces}: rel err {rel(torch.cat(outs, 2), full):.2e}"


def test_causality_perturbation() -> None:
    q, k, v = qkv(n=21)
    gate = torch.tensor([0.1, 0.7], dtype=torch.float64)
    base = infini_attention(q, k, v, gate, segment_len=4, update="delta")
    for t in (0, 3, 4, 13):
        q2, k2, v2 = (x.clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[:, :, t + 1:] += 2.0
        out = infini_attention(q2, k2, v2, gate, segment_len=4, update="delta")
        torch.testing.assert_close(out[:, :, : t + 1], base[:, :, : t + 1], rtol=1e-12, atol=1e-12)
        assert not torch.allclose(out[:, :, t + 1:], base[:, :, t + 1:])


def test_memory_is_per_batch_element() -> None:
    q, k, v = qkv(b=2, n=15)
    gate = torch.zeros(2, dtype=torch.float64)
    base = infini_attention(q, k, v, gate, segment_len=4)
    k2 = k.clone()
    k2[1] = torch.randn_like(k2[1])
    out = infini_attention(q, k2, v, gate, segment_len=4)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=0)
    assert not torch.allclose(out[1], base[1])


def test_padded_keys_hidden_from_local_and_memory() -> None:
    q, k, v = qkv(b=2, n=14)
    gate = torch.tensor([0.2, -0.3], dtype=torch.float64)
    pad = torch.ones(2, 14, dtype=torch.bool)
    pad[1, :5] = False  # left padding spanning a whole segment and part of the next
    base = infini_attention(q, k, v, gate, segment_len=4, key_padding_mask=pad)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, :5] = 40.0
    v2[1, :, :5] = 1e3
    out = infini_attention(q, k2, v2, gate, segment_len=4, key_padding_mask=pad)
    torch.testing.assert_close(out[:, :, 5:], base[:, :, 5:], rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_local_backend_and_window(backend: str) -> None:
    q, k, v = qkv(n=17, dtype=torch.float32)
    gate = torch.tensor([0.4, -0.1])
    ref = infini_attention(q, k, v, gate, segment_len=6, window=2, backend="reference")
    out = infini_attention(q, k, v, gate, segment_len=6, window=2, backend=backend)
    assert rel(out, ref) < 1e-5
    no_window = infini_attention(q, k, v, gate, segment_len=6, backend="reference")
    assert rel(no_window, ref) > 1e-3  # the window reaches the local attention


def test_bad_inputs() -> None:
    q, k, v = qkv(n=8)
    gate = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="segment_len"):
        infini_attention(q, k, v, gate, segment_len=0)
    with pytest.raises(ValueError, match="update"):
        infini_attention(q, k, v, gate, segment_len=4, update="hebbian")
    with pytest.raises(ValueError, match="gate"):
        infini_attention(q, k, v, torch.zeros(3), segment_len=4)
    bad = InfiniState.empty(2, 2, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"state.memory"):
        infini_attention(q, k, v, gate, segment_len=4, state=bad)
    with pytest.raises(ValueError, match="segment_len"):
        az.InfiniAttention(16, 2, segment_len=0)
    with pytest.raises(ValueError, match="update"):
        az.InfiniAttention(16, 2, update="sum")


# ------------------------------------------------------------------ the module
@pytest.mark.parametrize("update", ["linear", "delta"])
def test_module_decode_equals_full(update: str) -> None:
    torch.manual_seed(0)
    m = az.InfiniAttention(16, 2, segment_len=4, update=update).double()
    with torch.no_grad():
        m.gate.copy_(torch.tensor([0.8, -0.4]))
    x = torch.randn(2, 15, 16, dtype=torch.float64)
    full = m(x)
    cache = m.init_cache(2, 15)
    steps = [m(x[:, i:i + 1], cache=cache) for i in range(15)]
    assert cache.length == 15
    assert rel(torch.cat(steps, 1), full) < 1e-12
    cache.reset()
    chunks = [m(x[:, :6], cache=cache), m(x[:, 6:13], cache=cache), m(x[:, 13:], cache=cache)]
    assert rel(torch.cat(chunks, 1), full) < 1e-12


def test_module_memory_independent_of_length() -> None:
    m = az.InfiniAttention(16, 2, segment_len=4)
    cache = m.init_cache(1, 1000)
    sizes = []
    with torch.no_grad():
        for i in range(40):  # 10 segments
            m(torch.randn(1, 1, 16), cache=cache)
            assert cache.nbytes <= cache.max_nbytes()
            if (i + 1) % 4 == 0:
                sizes.append(cache.nbytes)
    assert len(set(sizes)) == 1 and cache.memory.shape == (1, 2, 8, 8)  # same after 1 or 10 segments


def test_module_gate_learns_and_bad_calls() -> None:
    m = az.InfiniAttention(16, 2, segment_len=3)
    x = torch.randn(1, 7, 16)
    m(x).sum().backward()
    assert m.gate.grad is not None and m.gate.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="context"):
        m(x, context=x)
    with pytest.raises(ValueError, match="return_weights"):
        m(x, return_weights=True)
    with pytest.raises(ValueError, match="key padding"):
        m(x, mask=az.masks.sliding_window(2, 0))
    with pytest.raises(TypeError, match="InfiniCache"):
        m(x, cache=az.LinearAttention(16, 2, causal=True).init_cache(1, 7))
    pad = torch.ones(1, 7, dtype=torch.bool)
    torch.testing.assert_close(m(x, mask=pad), m(x))


def test_registry_builds_infini() -> None:
    m = build_attention("infini", dim=16, num_heads=2, segment_len=4)
    assert isinstance(m, az.InfiniAttention)
    assert m(torch.randn(1, 9, 16)).shape == (1, 9, 16)
