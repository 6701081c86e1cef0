"""Issue 33, item 4: empty in, empty out, in every module and every functional call.

``x [B, N, C]`` with ``N = 0`` or ``B = 0`` gives an empty ``[B, N, C]`` output in every registered
variant (with and without a cache; a cache is left as it was, and decoding continues as if the
call had not been made), and gradients flow (empty). The functional calls follow
``docs/conventions.md``: ``Nk = 0`` gives zeros (LSE ``-inf``), ``Nq = 0`` or ``B = 0`` empty outputs,
on every backend, for ``attention`` (with and without ``sinks``) and ``sigmoid_attention``.
"""

from __future__ import annotations

import pytest
import torch

import attnzoo as az
from attnzoo.variants import VARIANTS, build_attention

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

DIM, HEADS = 32, 4
EMPTY_SHAPES = [(2, 0, DIM), (0, 5, DIM), (0, 0, DIM)]


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_attention(name, DIM, HEADS, causal=True, **VARIANTS[name].check)


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=lambda s: f"B{s[0]}N{s[1]}")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_module_maps_empty_input_to_empty_output(name: str, shape: tuple[int, int, int]) -> None:
    m = build(name).train()
    x = torch.randn(shape, requires_grad=True)
    y = m(x)
    assert y.shape == shape and y.dtype == x.dtype, f"{name}: {tuple(y.shape)} {y.dtype}"
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == shape
    with pytest.raises(TypeError, match=r"\bx\b"):
        m(x.detach().double())  # still checked like any input
    with pytest.raises(ValueError, match="C = dim"):
        m(torch.randn(shape[0], shape[1], DIM + 1))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_an_empty_cached_call_changes_nothing(name: str) -> None:
    """Prefill, an empty call (``N = 0``), then decoding: the cache length stays and the outputs equal
    a run without the empty call."""
    m = build(name).eval()
    x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_cache, cache = m.init_cache(2, 8), m.init_cache(2, 8)
        ref = torch.cat([m(x[:, :4], cache=ref_cache)] + [m(x[:, i:i + 1], cache=ref_cache) for i in range(4, 8)], 1)
        outs = [m(x[:, :4], cache=cache)]
        empty = m(x[:, :0], cache=cache)
        assert empty.shape == (2, 0, DIM) and cache.length == 4, f"{name}: length {cache.length}"
        outs += [m(x[:, i:i + 1], cache=cache) for i in range(4, 8)]
        first = m.init_cache(2, 8)
        assert m(x[:, :0], cache=first).shape == (2, 0, DIM) and first.length == 0  # also on a fresh cache
    assert (torch.cat(outs, 1) - ref).abs().max().item() <= 1e-6, name


def test_empty_call_returns_empty_weights() -> None:
    m = az.MultiHeadAttention(DIM, HEADS, causal=True)
    y, w = m(torch.randn(2, 0, DIM), return_weights=True)
    assert y.shape == (2, 0, DIM) and w.shape == (2, HEADS, 0, 0)
    cross = az.MultiHeadAttention(DIM, HEADS, kv_dim=24)
    assert cross(torch.randn(2, 0, DIM), torch.randn(2, 5, 24)).shape == (2, 0, DIM)
    out = cross(torch.randn(2, 3, DIM), torch.randn(2, 0, 24))  # no keys: attention zeros, then out_proj
    assert torch.allclose(out, cross.out_proj.bias.expand(2, 3, DIM))


QK_SHAPES = [((1, 2, 0, 4), (1, 2, 5, 4)), ((1, 2, 3, 4), (1, 2, 0, 4)), ((0, 2, 3, 4), (0, 2, 5, 4)),
             ((2, 4, 0, 4), (2, 2, 0, 4))]


@pytest.mark.parametrize(("q_shape", "k_shape"), QK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("call", ["attention", "sinks", "sigmoid"])
def test_functional_calls_on_empty_inputs(call: str, q_shape: tuple, k_shape: tuple) -> None:
    backends = {"attention": az.functional.available_backends("cpu"), "sinks": ["reference", "sdpa", "tiled"],
                "sigmoid": ["reference", "tiled"]}[call]
    backends = [b for b in backends if b != "flash"]
    for backend in backends:
        grad = backend != "flex"  # FlexAttention has no CPU backward
        q = torch.randn(q_shape, requires_grad=grad)
        k = torch.randn(k_shape, requires_grad=grad)
        v = torch.randn(k_shape, requires_grad=grad)
        if call == "sigmoid":
            out = az.sigmoid_attention(q, k, v, causal=True, backend=backend)
        else:
            sinks = torch.zeros(q_shape[1]) if call == "sinks" else None
            out = az.attention(q, k, v, causal=True, sinks=sinks, backend=backend)
        assert out.shape == q_shape, (call, backend, tuple(out.shape))
        assert torch.equal(out, torch.zeros(q_shape)), (call, backend)  # Nk = 0: zeros; else empty
        if grad:
            out.sum().backward()  # gradients exist (zeros) or are None where the output cannot depend on them
            for t in (q, k, v):
                assert t.grad is None or (t.grad.shape == t.shape and not t.grad.any()), (call, backend)
    if call == "attention" and k_shape[2] == 0:
        _, lse = az.attention(torch.randn(q_shape), torch.randn(k_shape), torch.randn(k_shape), return_lse=True)
        assert torch.isneginf(lse).all()


def test_sigmoid_weights_of_no_keys_are_empty() -> None:
    out, w = az.sigmoid_attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4), torch.randn(1, 2, 0, 4),
                                  return_weights=True)
    assert out.shape == (1, 2, 3, 4) and w.shape == (1, 2, 3, 0)


@pytest.mark.parametrize("cache_kind", ["sliding", "sink"])
def test_ring_caches_absorb_zero_tokens(cache_kind: str) -> None:
    """``update`` with ``n = 0`` returns the held keys and changes nothing (it was an internal error)."""
    from attnzoo.nn.cache import SinkWindowKVCache

    def make() -> az.SlidingWindowKVCache | SinkWindowKVCache:
        return az.SlidingWindowKVCache(1, 3, 2, 4) if cache_kind == "sliding" else SinkWindowKVCache(1, 2, 3, 2, 4)

    zero = torch.zeros(1, 2, 0, 4)
    a, b = make(), make()
    k, _, pos = b.update(zero, zero)
    assert k.shape == (1, 2, 0, 4) and pos.numel() == 0 and b.length == 0
    chunk, step = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 1, 4)
    a.update(chunk, chunk)
    b.update(chunk, chunk)
    k, _, pos = b.update(zero, zero)
    held = (torch.arange(4, 7) if cache_kind == "sliding" else b.held_positions())  # the window: 3 keys
    assert b.length == 7 and torch.equal(pos, held) and torch.equal(k, chunk[:, :, pos])
    for x, y in zip(a.update(step, step), b.update(step, step), strict=True):
        assert torch.equal(x, y)  # the zero-token call left no trace
