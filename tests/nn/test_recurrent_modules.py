"""The recurrent mixers (retnet, gla, deltanet, gated_deltanet, mamba2): float64 references written
from the papers as per-token loops, cached decoding == full forward (one token and chunks, odd
lengths, across chunk boundaries), the cache protocol, key padding, gradients, bad inputs, costs."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from tests.tools.test_docs import run_blocks
from torch import Tensor

import attnzoo as az
import attnzoo.nn.recurrent as recurrent_module
from attnzoo.masks import key_padding
from attnzoo.nn.deltanet import DeltaNet, GatedDeltaNet
from attnzoo.nn.gla import GatedLinearAttention
from attnzoo.nn.mamba2 import GatedRMSNorm, Mamba2
from attnzoo.nn.recurrent import RecurrentCache
from attnzoo.nn.retnet import MultiScaleRetention
from attnzoo.variants import VARIANTS, build_attention

NAMES = ["retnet", "gla", "deltanet", "gated_deltanet", "mamba2"]
C, H = 24, 3  # head_dim 8


def _build(name: str, dtype: torch.dtype = torch.float64, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    m = build_attention(name, C, H, **{"chunk_size": 4, **kw}).to(dtype).eval()
    with torch.no_grad():  # move every parameter off its initial value (norm scales, biases, D, ...)
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


# --------------------------------------------------------------------------- float64 references
def _conv(x: Tensor, conv) -> Tensor:
    """Causal depthwise convolution by definition, then SiLU. ``x [B, N, Ch]``."""
    if conv is None:
        return F.silu(x)
    w, k = conv.weight[:, 0, :], conv.kernel  # [Ch, K]
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for j in range(k):
            s = t - k + 1 + j
            if s >= 0:
                y[:, t] += w[:, j] * x[:, s]
    return F.silu(y if conv.bias is None else y + conv.bias)


def _loop(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor | None, scale: float) -> Tensor:
    """``S_t = decay_t * S_{t-1} + k v^T`` (or the delta rule with ``beta``), ``o_t = scale q_t^T S_t``.
    ``q, k [B, H, N, Dk]``, ``v [B, H, N, Dv]``, ``decay [B, H, N, Dk]`` (multiplicative)."""
    b, h, n, dk = q.shape
    S = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for t in range(n):
        S = decay[:, :, t, :, None] * S
        if beta is None:
            S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
        else:
            err = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
            S = S + beta[:, :, t, None, None] * k[:, :, t, :, None] * err[:, :, None, :]
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(out, dim=2)


def _heads(t: Tensor, h: int) -> Tensor:
    return t.unflatten(-1, (h, -1)).transpose(1, 2)  # [B, N, h*D] -> [B, h, N, D]


def _merge(o: Tensor) -> Tensor:
    return o.transpose(1, 2).flatten(2)


def _rms(o: Tensor, w: Tensor, eps: float = 1e-5) -> Tensor:
    return o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w


def _ref_retnet(m: MultiScaleRetention, x: Tensor) -> Tensor:
    q, k, v = (_heads(p(x), H) for p in (m.q_proj, m.k_proj, m.v_proj))
    gamma = 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float64))
    o = _loop(q, k, v, gamma[None, :, None, None].expand_as(q), None, q.shape[-1] ** -0.5)
    mu, var = o.mean(-1, keepdim=True), o.var(-1, unbiased=False, keepdim=True)
    o = (o - mu) / torch.sqrt(var + 1e-5) * m.norm.weight[:, None] + m.norm.bias[:, None]  # group norm
    return m.out_proj(F.silu(m.g_proj(x)) * _merge(o))


def _ref_gla(m: GatedLinearAttention, x: Tensor) -> Tensor:
    convs = [getattr(m, f"{n}_conv", None) for n in "qkv"]
    pre = [p(x) for p in (m.q_proj, m.k_proj, m.v_proj)]
    q, k, v = (_heads(t if c is None else _conv(t, c), H) for t, c in zip(pre, convs, strict=True))
    alpha = torch.sigmoid(m.gk_proj[1](m.gk_proj[0](x))) ** (1 / 16)  # sigmoid(.)^(1/tau)
    o = _loop(q, k, v, _heads(alpha, H), None, q.shape[-1] ** -0.5)
    return m.out_proj(F.silu(m.g_proj(x)) * _merge(_rms(o, m.norm.weight[:, None])))


def _ref_deltanet(m: DeltaNet, x: Tensor) -> Tensor:
    q, k, v = (_heads(_conv(p(x), getattr(m, f"{n}_conv", None)), H)
               for n, p in (("q", m.q_proj), ("k", m.k_proj), ("v", m.v_proj)))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(m.b_proj(x)).transpose(1, 2)
    a = torch.ones_like(beta)
    if isinstance(m, GatedDeltaNet):
        a = torch.exp(-F.softplus(m.a_proj(x) + m.dt_bias) * m.A_log.exp()).transpose(1, 2)
    o = _merge(_rms(_loop(q, k, v, a[..., None].expand_as(q), beta, q.shape[-1] ** -0.5), m.norm.weight[:, None]))
    return m.out_proj(o if m.g_proj is None else F.silu(m.g_proj(x)) * o)


def _ref_mamba2(m: Mamba2, x: Tensor) -> Tensor:
    xs = _heads(_conv(m.v_proj(x), getattr(m, "x_conv", None)), H)  # [B, H, N, P]
    bm, cm = (_conv(p(x), getattr(m, f"{n}_conv", None)) for n, p in (("B", m.k_proj), ("C", m.q_proj)))
    per = H // m.ngroups
    group = torch.arange(H) // per  # head -> group
    bm, cm = (_heads(t, m.ngroups)[:, group] for t in (bm, cm))  # [B, H, N, N_s]
    dt = F.softplus(m.dt_proj(x) + m.dt_bias).transpose(1, 2)  # [B, H, N]
    decay = torch.exp(dt * -m.A_log.exp()[:, None])
    y = _loop(cm, bm, xs * dt[..., None], decay[..., None].expand_as(bm), None, 1.0) + m.D[:, None, None] * xs
    y, gate = _merge(y), F.silu(m.z_proj(x))
    if m.norm.place != "before_gate":  # gate, then RMSNorm per group (or no norm)
        y = y * gate
    if m.norm.weight is not None:
        y = _rms(y.unflatten(-1, (m.ngroups, -1)), m.norm.weight, m.norm.eps).flatten(-2)
    if m.norm.place == "before_gate":  # RMSNorm per group, then gate
        y = y * gate
    return m.out_proj(y)


REFS = {"retnet": _ref_retnet, "gla": _ref_gla, "deltanet": _ref_deltanet, "gated_deltanet": _ref_deltanet,
        "mamba2": _ref_mamba2}


@pytest.mark.parametrize(("name", "kw"), [(n, {}) for n in NAMES] + [
    ("gla", {"conv_size": 4}), ("deltanet", {"conv_size": 0, "output_gate": True}),
    ("gated_deltanet", {"conv_size": 2, "output_gate": False}), ("mamba2", {"ngroups": 3, "state_size": 5}),
    ("mamba2", {"conv_size": 3, "expand": 1})])
@pytest.mark.parametrize("n", [1, 9, 13])
def test_module_equals_the_float64_recurrence_from_the_paper(name: str, kw: dict, n: int) -> None:
    m = _build(name, **kw)
    x = torch.randn(2, n, C, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        torch.testing.assert_close(m(x), REFS[name](m, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("place", "eps", "conv_bias"), [("before_gate", 1e-5, True), ("none", 1e-5, False),
                                                         ("after_gate", 1e-3, False)])
def test_mamba2_norm_and_convolution_parts_equal_the_recurrence(place: str, eps: float, conv_bias: bool) -> None:
    """The parts a family swaps in (the gated norm's place and epsilon, convolutions without
    biases) against the float64 reference."""
    m = _build("mamba2", ngroups=3)
    m.norm = GatedRMSNorm(3, m.num_heads * m.inner_head_dim // 3, place=place, eps=eps, dtype=torch.float64)
    with torch.no_grad():
        if m.norm.weight is not None:
            m.norm.weight.add_(0.1 * torch.randn_like(m.norm.weight))
    if not conv_bias:
        for name in m.conv_channels:
            getattr(m, f"{name}_conv").bias = None
    x = torch.randn(2, 9, C, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(m(x), _ref_mamba2(m, x), rtol=1e-10, atol=1e-10)
    cache = m.init_cache(2, 9)
    with torch.no_grad():
        steps = torch.cat([m(x[:, :4], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(4, 9)], 1)
        torch.testing.assert_close(steps, m(x), rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------- decoding
def _decode(m: torch.nn.Module, x: Tensor, steps: list[int]) -> tuple[Tensor, RecurrentCache]:
    cache = m.init_cache(x.shape[0], x.shape[1])
    outs, s = [], 0
    for step in steps:
        outs.append(m(x[:, s:s + step], cache=cache))
        s += step
    assert s == x.shape[1] and cache.length == s
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_cached_decoding_equals_the_full_forward(name: str, dtype: torch.dtype, tol: float) -> None:
    """Token by token and in chunks that straddle the kernel's 4-token chunks; N = 23 (odd)."""
    m = _build(name, dtype)
    x = torch.randn(2, 23, C, dtype=dtype, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(x)
        for steps in ([1] * 23, [3, 1, 6, 5, 1, 7], [23], [9, 14]):
            got, _ = _decode(m, x, steps)
            err = float((got - full).abs().max())
            assert err <= tol * max(1.0, float(full.abs().max())), f"{name} {dtype} {steps}: {err}"


@pytest.mark.parametrize(("name", "kw"), [("deltanet", {"conv_size": 0}), ("gla", {"conv_size": 3}),
                                          ("mamba2", {"conv_size": 0, "output_gate": False})])
def test_decoding_with_the_convolution_and_gate_options(name: str, kw: dict) -> None:
    m = _build(name, **kw)
    x = torch.randn(1, 11, C, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(_decode(m, x, [1, 1, 2, 7])[0], m(x), rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("name", NAMES)
def test_cache_protocol_constant_size_reset_and_rollback(name: str) -> None:
    m = _build(name, torch.float32)
    x = torch.randn(2, 12, C)
    small, big = m.init_cache(2, 4), m.init_cache(2, 100_000)
    assert small.nbytes == big.nbytes > 0 and small.batch_size == 2 and big.length == 0
    with torch.no_grad():
        ref, cache = _decode(m, x, [5, 7])
        assert cache.nbytes == small.nbytes  # the state does not grow with the tokens
        est = az.cost.estimate(name, 12, C, H, batch=2, chunk_size=4)
        if name != "mamba2":  # mamba2's estimate assumes its default state_size; checked below
            assert est.kv_cache_bytes == cache.nbytes and est.kv_cache_bytes_per_token == 0
        cache.reset()
        assert cache.length == 0
        again = torch.cat([m(x[:, :5], cache=cache), m(x[:, 5:], cache=cache)], dim=1)
        torch.testing.assert_close(again, ref)
        # a call that raises leaves the cache exactly as it was
        cache.reset()
        m(x[:, :4], cache=cache)
        before = (cache.length, cache.state.clone(), {k: t.clone() for k, t in cache.conv.items()})
        with pytest.raises(ValueError):
            m(torch.randn(2, 3, C + 1), cache=cache)
        with pytest.raises(ValueError, match="max_len"):
            m(torch.randn(2, 9, C), cache=cache)  # 4 + 9 > 12
        mark = cache.mark()
        m(x[:, 4:6], cache=cache)
        cache.rollback(mark)
        assert cache.length == before[0] and torch.equal(cache.state, before[1])
        assert all(torch.equal(cache.conv[k], t) for k, t in before[2].items())
        torch.testing.assert_close(m(x[:, 4:], cache=cache), ref[:, 4:])
        with pytest.raises(ValueError, match="batch size"):
            m(x[:1, :1], cache=m.init_cache(2, 4))


def test_mamba2_cost_matches_its_cache_at_the_default_state_size() -> None:
    m = build_attention("mamba2", 64, 4)
    for n in (10, 10_000):
        est = az.cost.estimate("mamba2", n, 64, 4, batch=3)
        assert est.kv_cache_bytes == m.init_cache(3, n).nbytes and est.kv_cache_bytes_per_token == 0


@pytest.mark.parametrize("name", NAMES)
def test_left_padding_skips_the_padded_tokens(name: str) -> None:
    m = _build(name)
    x = torch.randn(2, 9, C, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False
    with torch.no_grad():
        out = m(x, mask=mask)
        torch.testing.assert_close(out[1, 4:], m(x[1:, 4:])[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out[0], m(x[:1])[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(m(x, mask=key_padding(mask)), out)
        cache = m.init_cache(2, 9)  # with a cache the mask covers the cached tokens too
        parts = [m(x[:, :5], cache=cache, mask=mask[:, :5]), m(x[:, 5:], cache=cache, mask=mask)]
        torch.testing.assert_close(torch.cat(parts, dim=1), out, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_backward_reaches_every_parameter(name: str) -> None:
    m = _build(name, torch.float32).train()
    x = torch.randn(2, 10, C, requires_grad=True)
    m(x).square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for pname, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


def test_gradcheck_of_the_chunked_module_in_float64() -> None:
    torch.manual_seed(0)
    m = build_attention("gated_deltanet", 8, 2, chunk_size=2, conv_size=2).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)  # chunks 2, 2, 1
    assert torch.autograd.gradcheck(lambda t: m(t), (x,), eps=1e-6, atol=1e-6, fast_mode=True)


# --------------------------------------------------------------------------- errors and registry
@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_raise(name: str) -> None:
    m = _build(name, torch.float32)
    with pytest.raises(ValueError, match="C = dim"):
        m(torch.randn(1, 4, C + 1))
    with pytest.raises(TypeError, match="floating"):
        m(torch.ones(1, 4, C, dtype=torch.long))
    with pytest.raises(ValueError, match="cross-attention"):
        m(torch.randn(1, 4, C), torch.randn(1, 4, C))
    with pytest.raises(ValueError, match="return_weights"):
        m(torch.randn(1, 4, C), return_weights=True)
    with pytest.raises(TypeError, match="RecurrentCache"):
        m(torch.randn(1, 4, C), cache=az.KVCache(1, 8, H, C // H))
    with pytest.raises(ValueError, match="mask"):
        m(torch.randn(1, 4, C), mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal"):
        build_attention(name, C, H, causal=False)
    with pytest.raises(ValueError, match="chunk_size"):
        build_attention(name, C, H, chunk_size=0)
    other = build_attention(name, C, 2 * H)
    with pytest.raises(ValueError, match="init_cache"):
        m(torch.randn(1, 1, C), cache=other.init_cache(1, 4))


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2(C, H, ngroups=2)
    with pytest.raises(ValueError, match="place"):
        GatedRMSNorm(1, 4, place="middle")
    with pytest.raises(ValueError, match="eps"):
        GatedRMSNorm(1, 4, eps=-1.0)
    with pytest.raises(ValueError, match="groups"):
        GatedRMSNorm(0, 4)
    with pytest.raises(ValueError, match=r"y must be \[B, N, 8\]"):
        GatedRMSNorm(2, 4)(torch.randn(1, 3, 6))
    with pytest.raises(ValueError, match="gate must have"):
        GatedRMSNorm(2, 4)(torch.randn(1, 3, 8), torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="conv_size"):
        DeltaNet(C, H, conv_size=-1)
    with pytest.raises(TypeError, match="output_gate"):
        GatedLinearAttention(C, H, output_gate=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dim"):
        MultiScaleRetention(25, H)


@pytest.mark.parametrize("name", NAMES)
def test_registered_everywhere_with_a_closed_form_cost(name: str) -> None:
    spec = VARIANTS[name]
    assert spec.family == "recurrent" and not spec.exact
    small, huge = (az.cost.estimate(name, n, 512, 8) for n in (4096, 10**9))
    assert small.kv_cache_bytes == huge.kv_cache_bytes > 0  # decode state constant in N
    assert small.kv_cache_bytes_per_token == 0 and huge.flops > small.flops > 0
    ratio = huge.flops_attention / small.flops_attention
    assert 0.9 * 10**9 / 4096 < ratio < 1.1 * 10**9 / 4096  # linear in N
    with pytest.raises(ValueError, match="do not apply"):
        az.cost.estimate(name, 64, 64, 8, window=8)


def test_the_recurrent_docs_examples_run() -> None:
    run_blocks("docs/recurrent.md", minimum=2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [40, 300])  # one quadratic chunk; chunked with a partial last chunk
def test_flops_estimate_against_the_flop_counter(name: str, n: int) -> None:
    """Matmul FLOPs within 15% (the estimate also counts the delta rule's triangular solve and the
    GLA's elementwise diagonal blocks, which FlopCounterMode does not see)."""
    from torch.utils.flop_counter import FlopCounterMode

    m = build_attention(name, 64, 8).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m(torch.randn(1, n, 64))
    measured, est = fc.get_total_flops(), az.cost.estimate(name, n, 64, 8).flops
    assert abs(est - measured) <= 0.15 * measured, f"{name} N={n}: estimate {est} vs measured {measured}"


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "gated_deltaproduct", "kda"])
def test_float16_zero_heads_stay_finite_and_match_float64(name: str) -> None:
    """A zero query/key head (a left-padded token, an all-zero input token) is L2-normalised in
    float32: F.normalize's floor of 1e-12 is 0 in float16, which made 0/0 = NaN spread through
    the state. The float16 module equals its float64 copy on the same rounded weights and input."""
    torch.manual_seed(0)
    m = build_attention(name, 32, 4, chunk_size=8).half().eval()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).half()
    x[0, 0] = 0
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, :5] = False  # row 1 left-padded by 5
    m64 = copy.deepcopy(m).double()
    with torch.no_grad():
        for kw in ({}, {"mask": mask}):
            y, ref = m(x, **kw), m64(x.double(), **kw)
            assert torch.isfinite(y).all(), kw
            err = (y.double() - ref).abs().max() / ref.abs().max()
            assert err < 30 * torch.finfo(torch.float16).eps, (kw, float(err))


@pytest.mark.parametrize("name", ["mamba2", "retnet"])  # RMS and layer head norms
def test_head_norm_survives_outputs_whose_squares_overflow_float32(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mamba-2's head output reaches ~1e20 for inputs ~1e5, whose float32 squares overflow: the
    RMS/layer head norm gave zeros. Rows are now scaled by a power of two first; the float32
    module equals its float64 copy, and at ordinary scales the new norm equals the plain formula."""
    torch.manual_seed(0)
    m64 = build_attention(name, 32, 4, **VARIANTS[name].check).double().eval()
    m32 = copy.deepcopy(m64).float()
    for scale in (1.0, 1e4, 1e5):
        x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * scale
        with torch.no_grad():
            y, ref = m32(x.float()).double(), m64(x)
        assert (ref.abs().amax(-1) > 0).all()
        assert (y - ref).abs().max() / ref.abs().max() < 1e-4, (name, scale)
    norm = m32.norm  # ordinary rows: bit for bit the norm without the guard
    o = torch.randn(2, *norm.weight.shape[:1], 5, norm.weight.shape[1]) * 3
    if norm.kind == "layer":
        plain = F.layer_norm(o, o.shape[-1:], eps=norm.eps)
    else:
        plain = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm.eps)
    plain = plain * norm.weight[:, None, :]
    plain = plain if norm.bias is None else plain + norm.bias[:, None, :]
    head_norm = functools.partial(recurrent_module.HeadNorm.forward, norm)  # Mamba-2's GatedRMSNorm is one too
    assert torch.equal(head_norm(o), plain)
    monkeypatch.setattr(recurrent_module, "_may_overflow", lambda t: True)  # the path traced / accelerator calls take
    assert torch.equal(head_norm(o), plain)  # ordinary rows are divided by exactly 1
    with torch.no_grad():
        big = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 1e5
        y, ref = m32(big.float()).double(), m64(big)
    assert (y - ref).abs().max() / ref.abs().max() < 1e-4
