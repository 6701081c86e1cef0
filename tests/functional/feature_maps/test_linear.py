"""Linear attention: quadratic == chunked == recurrent, carried state, causality, padding, module decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.tools.test_docs import run_blocks

import attnzoo as az
from attnzoo.functional.feature_maps.linear import FEATURE_MAPS
from attnzoo.variants import build_attention


def qkv(b: int = 2, h: int = 3, n: int = 37, d: int = 8, dv: int | None = None, dtype: torch.dtype = torch.float32,
        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, h, n, dv or d, generator=g, dtype=dtype)
    return q, k, v


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi, causal: bool, eps: float = 1e-6) -> torch.Tensor:
    """out_i = sum_j phi(q_i).phi(k_j) v_j / (sum_j phi(q_i).phi(k_j) + eps), written as loops (float64)."""
    q, k, v = q.double(), k.double(), v.double()
    fq, fk = phi(q), phi(k)
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for i in range(q.shape[2]):
        js = range(i + 1) if causal else range(k.shape[2])
        num = sum((fq[:, :, i] * fk[:, :, j]).sum(-1, keepdim=True) * v[:, :, j] for j in js)
        den = sum((fq[:, :, i] * fk[:, :, j]).sum(-1, keepdim=True) for j in js)
        out[:, :, i] = num / (den + eps)
    return out


# ------------------------------------------------------------------ the forms agree
@pytest.mark.parametrize("fmap", ["elu", "relu"])
@pytest.mark.parametrize("causal", [True, False])
def test_quadratic_form_matches_definition(fmap: str, causal: bool) -> None:
    q, k, v = qkv(n=9, dtype=torch.float64)
    phi = FEATURE_MAPS[fmap]
    out = az.linear_attention(q, k, v, feature_map=fmap, causal=causal, form="quadratic")
    ref = naive(q, k, v, phi, causal)
    assert rel(out, ref) < 1e-12, f"quadratic form vs definition: rel err {rel(out, ref):.2e}"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fmap", ["elu", "relu"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 12, 48, 100])  # 4, 12, 48 divide N=48; 7, 100 do not
def test_chunked_equals_quadratic(causal: bool, fmap: str, chunk: int) -> None:
    q, k, v = qkv(n=48, dv=5)
    ref = az.linear_attention(q, k, v, feature_map=fmap, causal=causal, form="quadratic")
    out = az.linear_attention(q, k, v, feature_map=fmap, causal=causal, form="chunked", chunk_size=chunk)
    assert rel(out, ref) < 1e-4, f"chunk={chunk} causal={causal}: rel err {rel(out, ref):.2e} shape {tuple(q.shape)}"


@pytest.mark.parametrize("causal", [True, False])
def test_recurrent_equals_quadratic(causal: bool) -> None:
    q, k, v = qkv(n=23)
    ref = az.linear_attention(q, k, v, causal=causal, form="quadratic")
    out = az.linear_attention(q, k, v, causal=causal, form="recurrent")
    assert rel(out, ref) < 1e-4, f"recurrent: rel err {rel(out, ref):.2e}"


def test_custom_callable_feature_map_with_more_features() -> None:
    q, k, v = qkv(n=20, dtype=torch.float64)

    def phi(x: torch.Tensor) -> torch.Tensor:  # F = 2 D
        return torch.cat([F.elu(x) + 1, F.elu(-x) + 1], dim=-1)

    ref = naive(q, k, v, phi, causal=True)
    for form in ("quadratic", "chunked", "recurrent"):
        out = az.linear_attention(q, k, v, feature_map=phi, causal=True, form=form, chunk_size=6)
        assert rel(out, ref) < 1e-12, f"{form}: rel err {rel(out, ref):.2e}"
    _, (s, z) = az.linear_attention(q, k, v, feature_map=phi, causal=True, return_state=True)
    assert s.shape == (2, 3, 16, 8) and z.shape == (2, 3, 16)


# ------------------------------------------------------------------ state
@pytest.mark.parametrize("form", ["chunked", "recurrent", "quadratic"])
@pytest.mark.parametrize("split", [1, 13, 32])
def test_state_two_calls_equal_one_call(form: str, split: int) -> None:
    q, k, v = qkv(n=45)
    full, (s_full, z_full) = az.linear_attention(q, k, v, causal=True, chunk_size=8, return_state=True)
    a, st = az.linear_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], causal=True, chunk_size=8,
                                form=form, return_state=True)
    b, (s2, z2) = az.linear_attention(q[:, :, split:], k[:, :, split:], v[:, :, split:], causal=True, chunk_size=8,
                                      form=form, state=st, return_state=True)
    out = torch.cat([a, b], dim=2)
    assert rel(out, full) < 1e-4, f"split at {split} ({form}): rel err {rel(out, full):.2e}"
    assert rel(s2, s_full) < 1e-5 and rel(z2, z_full) < 1e-5
    assert s2.dtype == torch.float32 and z2.dtype == torch.float32


def test_noncausal_state_adds_earlier_keys() -> None:
    q, k, v = qkv(n=30)
    full = az.linear_attention(q[:, :, 20:], k, v)  # queries of the last 10 tokens see all 30 keys
    _, st = az.linear_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], return_state=True)
    out = az.linear_attention(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], state=st)
    assert rel(out, full) < 1e-5


# ------------------------------------------------------------------ causality and padding
@pytest.mark.parametrize("form", ["chunked", "recurrent", "quadratic"])
@pytest.mark.parametrize("t", [0, 10, 17])
def test_causality_perturbation(form: str, t: int) -> None:
    q, k, v = qkv(n=24)
    base = az.linear_attention(q, k, v, causal=True, form=form, chunk_size=8)
    g = torch.Generator().manual_seed(99)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, t + 1:] += 3 * torch.randn(x[:, :, t + 1:].shape, generator=g)
    out = az.linear_attention(q2, k2, v2, causal=True, form=form, chunk_size=8)
    torch.testing.assert_close(out[:, :, : t + 1], base[:, :, : t + 1], rtol=1e-6, atol=1e-7,
                               msg=lambda m: f"outputs at <= {t} changed ({form}): {m}")
    assert not torch.allclose(out[:, :, t + 1:], base[:, :, t + 1:])  # the perturbation is real


@pytest.mark.parametrize("causal", [True, False])
def test_key_padding_equals_truncation(causal: bool) -> None:
    q, k, v = qkv(b=2, n=20)
    lengths = [20, 13]
    pad = torch.arange(20)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]
    k_garbage, v_garbage = k.clone(), v.clone()
    k_garbage[1, :, 13:] = 50.0  # padded inputs are garbage: their features must be zeroed
    v_garbage[1, :, 13:] = 1e4
    out = az.linear_attention(q, k_garbage, v_garbage, causal=causal, chunk_size=6, key_padding_mask=pad)
    rows = slice(0, 13) if causal else slice(None)  # causal: the real tokens; bidirectional: every query
    ref1 = az.linear_attention(q[1:, :, rows], k[1:, :, :13], v[1:, :, :13], causal=causal)
    assert rel(out[1:, :, rows], ref1) < 1e-5
    ref0 = az.linear_attention(q[:1], k[:1], v[:1], causal=causal)
    assert rel(out[:1], ref0) < 1e-6


def test_all_keys_padded_returns_zeros() -> None:
    q, k, v = qkv(b=1, n=6)
    out = az.linear_attention(q, k, v, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


# ------------------------------------------------------------------ dtypes and gradients
def test_bfloat16_close_to_float32_and_state_float32() -> None:
    q, k, v = qkv(n=40)
    ref = az.linear_attention(q, k, v, causal=True)
    out, (s, z) = az.linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, return_state=True)
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32 and z.dtype == torch.float32
    assert rel(out.float(), ref) < 2e-2


def test_chunked_gradients_match_numerical() -> None:
    q, k, v = (t.requires_grad_() for t in qkv(b=1, h=1, n=7, d=3, dtype=torch.float64))
    assert torch.autograd.gradcheck(
        lambda a, b, c: az.linear_attention(a, b, c, causal=True, chunk_size=3), (q, k, v))


# ------------------------------------------------------------------ bad input
def test_bad_inputs() -> None:
    q, k, v = qkv(n=10)
    with pytest.raises(ValueError, match="feature_map"):
        az.linear_attention(q, k, v, feature_map="softmax")
    with pytest.raises(TypeError, match="feature_map"):
        az.linear_attention(q, k, v, feature_map=3)
    with pytest.raises(ValueError, match="chunk_size"):
        az.linear_attention(q, k, v, causal=True, chunk_size=0)
    with pytest.raises(ValueError, match="form"):
        az.linear_attention(q, k, v, form="fast")
    s_bad = torch.zeros(2, 3, 7, 8)
    with pytest.raises(ValueError, match=r"state S .*\[2, 3, 8, 8\]"):
        az.linear_attention(q, k, v, causal=True, state=(s_bad, torch.zeros(2, 3, 8)))
    with pytest.raises(ValueError, match="state z"):
        az.linear_attention(q, k, v, causal=True, state=(torch.zeros(2, 3, 8, 8), torch.zeros(2, 8)))
    with pytest.raises(TypeError, match="state"):
        az.linear_attention(q, k, v, state=torch.zeros(2, 3, 8, 8))
    with pytest.raises(ValueError, match="key_padding_mask"):
        az.linear_attention(q, k, v, key_padding_mask=torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="Nq == Nk"):
        az.linear_attention(q[:, :, :4], k, v, causal=True)
    with pytest.raises(ValueError, match="heads"):
        az.linear_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="feature_map"):
        az.linear_attention(q, k, v, feature_map=lambda x: x.sum(-1))
    with pytest.raises(ValueError, match="rank 4"):
        az.linear_attention(q[0], k[0], v[0])


# ------------------------------------------------------------------ module
def test_module_decode_equals_full_forward() -> None:
    torch.manual_seed(0)
    m = az.LinearAttention(32, 4, causal=True, chunk_size=4).double()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    full = m(x)
    cache = m.init_cache(2, 11)
    nbytes = cache.nbytes
    steps = [m(x[:, i:i + 1], cache=cache) for i in range(11)]
    assert cache.length == 11 and cache.nbytes == nbytes  # O(1) memory per token
    assert rel(torch.cat(steps, 1), full) < 1e-12
    cache.reset()
    chunks = [m(x[:, :5], cache=cache), m(x[:, 5:], cache=cache)]
    assert rel(torch.cat(chunks, 1), full) < 1e-12


def test_module_padding_mask_forms_and_cross_attention() -> None:
    torch.manual_seed(0)
    m = az.LinearAttention(16, 2)
    x = torch.randn(2, 7, 16)
    ctx = torch.randn(2, 5, 16)
    lengths = torch.tensor([5, 3])
    pad = torch.arange(5)[None] < lengths[:, None]
    a = m(x, ctx, mask=pad)
    b = m(x, ctx, mask=az.masks.key_padding(lengths))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, m(x, ctx, mask=pad[:, None, None, :]))
    # cross-attention = the functional call on the projections
    h = lambda t: t.view(2, -1, 2, 8).transpose(1, 2)  # noqa: E731
    ref = az.linear_attention(h(m.q_proj(x)), h(m.k_proj(ctx)), h(m.v_proj(ctx)), key_padding_mask=pad)
    torch.testing.assert_close(a, m.out_proj(ref.transpose(1, 2).reshape(2, 7, 16)))


def test_module_bad_inputs() -> None:
    m = az.LinearAttention(16, 2, causal=True)
    x = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="return_weights"):
        m(x, return_weights=True)
    with pytest.raises(ValueError, match="key padding"):
        m(x, mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key padding"):
        m(x, mask=az.masks.causal())
    with pytest.raises(ValueError, match="causal=False"):
        m(x, context=torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match=r"\[B, N, C\]"):
        m(torch.randn(1, 4, 8))
    with pytest.raises(ValueError, match="batch size"):
        m(x, cache=m.init_cache(2, 8))
    with pytest.raises(ValueError, match="causal=True"):
        az.LinearAttention(16, 2)(x, cache=m.init_cache(1, 8))
    with pytest.raises(ValueError, match="feature_map"):
        az.LinearAttention(16, 2, feature_map="tanh")
    with pytest.raises(ValueError, match="chunk_size"):
        az.LinearAttention(16, 2, chunk_size=0)


def test_registry_builds_linear() -> None:
    m = build_attention("linear", dim=16, num_heads=2)
    assert isinstance(m, az.LinearAttention) and m.causal
    assert m(torch.randn(1, 5, 16)).shape == (1, 5, 16)


def test_efficient_docs_examples_run() -> None:
    run_blocks("docs/efficient.md", minimum=4)


@pytest.mark.parametrize("form", ["auto", "quadratic", "chunked", "recurrent"])
def test_causal_linear_attention_of_no_tokens_keeps_the_state(form: str) -> None:
    """Zero new tokens (an empty prefill chunk): every form returns ``[B, H, 0, Dv]`` and the state it
    was given (the chunked and recurrent forms used to fail: a division by zero, an empty stack)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
    _, state = az.linear_attention(q, k, v, causal=True, return_state=True)
    empty = q[:, :, :0]
    out, (s, z) = az.linear_attention(empty, empty, empty, causal=True, state=state, return_state=True, form=form)
    assert out.shape == (1, 2, 0, 4)
    torch.testing.assert_close(s, state[0], rtol=0, atol=0)
    torch.testing.assert_close(z, state[1], rtol=0, atol=0)
