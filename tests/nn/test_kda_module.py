"""The frontier recurrent mixers: the ``kda`` variant against its layer written from Kimi Linear's
formulas (float64, the token-loop oracle), grouped value heads (``num_v_heads``) in every mixer that
takes them, decode == full, and half-precision modules against the float32 module (issue 33)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo.nn.kda import KimiDeltaAttention
from attnzoo.variants import VARIANTS, build_attention
from recurrent_oracle import token_loop
from twins import assert_same_forward_and_gradients

C, H = 24, 3  # head_dim 8


def _build(name: str, dtype: torch.dtype = torch.float64, **kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    m = build_attention(name, C, H, **{"chunk_size": 4, **kw}).to(dtype).eval()
    with torch.no_grad():  # move every parameter off its initial value
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _conv_silu(x: Tensor, conv: torch.nn.Module) -> Tensor:
    """Causal depthwise convolution by definition (zeros before the start), then SiLU. ``x [B, N, Ch]``."""
    w, kern = conv.weight[:, 0, :], conv.kernel
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for j in range(kern):
            if t - kern + 1 + j >= 0:
                y[:, t] += w[:, j] * x[:, t - kern + 1 + j]
    return F.silu(y)


def _heads(t: Tensor, d: int) -> Tensor:
    return t.unflatten(-1, (-1, d)).transpose(1, 2)  # [B, N, H D] -> [B, H, N, D]


def _ref_kda(m: KimiDeltaAttention, x: Tensor) -> Tensor:
    """Kimi Linear's layer from its formulas (module docstring), with the float64 token loop."""
    d = m.head_dim
    q, k, v = (_heads(_conv_silu(proj(x), conv), d) for proj, conv in
               ((m.q_proj, m.q_conv), (m.k_proj, m.k_conv), (m.v_proj, m.v_conv)))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    g = -m.A_log.exp()[:, None, None] * F.softplus(_heads(m.f_b_proj(m.f_a_proj(x)) + m.dt_bias, d))
    beta = torch.sigmoid(m.b_proj(x)).transpose(1, 2) * (2.0 if m.allow_neg_eigval else 1.0)  # [0, 2]: neg. eigval
    o, _ = token_loop("delta", q, k, v, g, beta)
    gate = _heads(m.g_b_proj(m.g_a_proj(x)), d)
    o = o / (o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps).sqrt() * m.o_norm.weight * torch.sigmoid(gate)
    return m.out_proj(o.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("kw", [{}, {"num_v_heads": 6}, {"allow_neg_eigval": True}])
def test_kda_module_equals_the_layer_from_its_formulas(kw: dict) -> None:
    m = _build("kda", **kw)
    x = torch.randn(2, 11, C, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = m(x), _ref_kda(m, x)
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-12, f"kda {kw}: rel err {err:.2e}"


def test_kda_is_registered_with_a_cost_and_parameter_names_of_kimi_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = VARIANTS["kda"]
    assert spec.family == "recurrent"
    names = {n for n, _ in build_attention("kda", 32, 4).named_parameters()}
    for want in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "f_a_proj.weight", "f_b_proj.weight",
                 "A_log", "dt_bias", "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight",
                 "out_proj.weight", "q_conv.weight", "k_conv.weight", "v_conv.weight"):
        assert want in names, f"kda lacks {want}: {sorted(names)}"
    from torch.utils.flop_counter import FlopCounterMode

    import attnzoo as az
    import attnzoo.functional.recurrent.gla as gla

    monkeypatch.setattr(gla, "vector_scores", gla._vector_scores)  # the operator's body, visible to the counter
    for n in (40, 300):
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            build_attention("kda", 64, 8).eval()(torch.randn(1, n, 64))
        est, measured = az.cost.estimate("kda", n, 64, 8), fc.get_total_flops()
        # as for every recurrent variant: within 15% (the estimate also counts the triangular solve)
        assert abs(est.flops - measured) <= 0.15 * measured, f"kda N={n}: estimate {est.flops} vs {measured}"
        assert est.params == sum(p.numel() for p in build_attention("kda", 64, 8).parameters())


GVA = [("gla", {"num_v_heads": 6}), ("deltanet", {"num_v_heads": 6}), ("gated_deltanet", {"num_v_heads": 12}),
       ("kda", {"num_v_heads": 6}), ("mamba2", {"ngroups": 1}), ("kda", {}), ("gated_deltanet",
       {"allow_neg_eigval": True}), ("deltanet", {"allow_neg_eigval": True})]


@pytest.mark.parametrize(("name", "kw"), GVA)
def test_cached_decoding_equals_the_full_forward(name: str, kw: dict) -> None:
    m = _build(name, **kw)
    x = torch.randn(2, 13, C, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(x)
        for steps in ([1] * 13, [3, 1, 6, 3], [13]):
            cache = m.init_cache(2, 13)
            got = torch.cat([m(x[:, s:s + n], cache=cache) for s, n in zip([0, *torch.tensor(steps).cumsum(0)[:-1]
                                                                            .tolist()], steps, strict=True)], dim=1)
            assert float((got - full).abs().max()) < 1e-11 * max(1.0, float(full.abs().max())), f"{name} {steps}"


def test_grouped_value_heads_equal_the_expanded_keys() -> None:
    """A GVA gated DeltaNet equals the plain one whose q/k projections and convolutions repeat each key
    head for its value heads (value head j reads key head j // G)."""
    m = _build("gated_deltanet", num_v_heads=6)
    plain = build_attention("gated_deltanet", C, 6, head_dim=8, chunk_size=4).double().eval()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    for name in ("q_proj.weight", "k_proj.weight", "q_conv.weight", "k_conv.weight"):
        sd[name] = sd[name].unflatten(0, (H, 8)).repeat_interleave(2, dim=0).flatten(0, 1)
    plain.load_state_dict(sd)
    x = torch.randn(2, 9, C, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), plain(x), rtol=1e-12, atol=1e-12)


def test_bad_num_v_heads_is_named() -> None:
    with pytest.raises(ValueError, match="num_v_heads"):
        build_attention("gated_deltanet", C, H, num_v_heads=4)


@pytest.mark.parametrize("name", sorted(n for n, s in VARIANTS.items() if s.family == "recurrent"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("amp", [10.0, 30.0])
def test_half_modules_stay_finite_and_near_the_float32_module(name: str, dtype: torch.dtype, amp: float) -> None:
    """Issue 33: ``build_attention(name, 64, 4).half()`` on ``randn(2, 40, 64) * 30`` gave NaN. The kernels now
    run in float32 and the norms normalise the float32 output; the error is the half projections' rounding."""
    torch.manual_seed(0)
    m32 = build_attention(name, 64, 4).eval()
    mh = build_attention(name, 64, 4).eval()
    mh.load_state_dict(m32.state_dict())
    mh = mh.to(dtype)
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3)) * amp
    with torch.no_grad():
        ref = m32(x.to(dtype).float())
        got = mh(x.to(dtype))
    assert got.dtype == dtype and torch.isfinite(got).all(), f"{name} {dtype} x{amp}: non-finite output"
    err = float((got.float() - ref).abs().max() / ref.abs().max())
    bound = 0.05 if dtype == torch.float16 else 0.2  # relative to max |out|: half rounding of the projections
    assert err < bound, f"{name} {dtype} x{amp}: rel err {err:.3f}"


def _kept(*groups: str, dtype: torch.dtype = torch.float32) -> KimiDeltaAttention:
    torch.manual_seed(0)
    return KimiDeltaAttention(C, H, chunk_size=4, dtype=dtype).keep_in_float32(*groups).eval()


def test_keep_in_float32_keeps_the_decay_and_convolutions_through_half_casts() -> None:
    """``keep_in_float32`` (transformers' ``_keep_in_fp32_modules_strict``: ``dt_bias``, ``A_log``,
    ``conv1d``): those parameters float32 when built in bfloat16 and after ``.half()`` /
    ``.bfloat16()`` / ``.to()``, the same ``nn.Parameter`` with its exact value; the others follow
    the casts; only the named groups are kept; wider casts apply as usual."""
    ref = _kept()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    kept = ("A_log", "dt_bias", "q_conv.weight", "k_conv.weight", "v_conv.weight")
    built = _kept("dt_bias", "A_log", "conv", dtype=torch.bfloat16)
    assert sorted(built.float32_params) == sorted(kept)
    assert {n for n, p in built.named_parameters() if p.dtype == torch.float32} == set(kept)
    built.load_state_dict(ref.state_dict())
    m = _kept("dt_bias", "A_log", "conv")
    m.load_state_dict(ref.state_dict())
    params = {n: m.get_parameter(n) for n in kept}
    for cast, dtype in ((m.half, torch.float16), (m.bfloat16, torch.bfloat16), (lambda: m.to(torch.float16), torch.float16)):
        cast()
        for n in kept:
            assert m.get_parameter(n) is params[n] and params[n].dtype == torch.float32
            assert torch.equal(params[n], ref.get_parameter(n)) and torch.equal(built.get_parameter(n), params[n])
        assert m.q_proj.weight.dtype == m.o_norm.weight.dtype == dtype
    assert m.double().dt_bias.dtype == torch.float64
    only = _kept("dt_bias").bfloat16()  # Kimi Linear keeps dt_bias alone
    assert only.float32_params == ("dt_bias",) and only.A_log.dtype == only.q_conv.weight.dtype == torch.bfloat16
    assert _kept().bfloat16().dt_bias.dtype == torch.bfloat16  # none by default
    with pytest.raises(ValueError, match=r"groups must be among .* got 'conv1d'"):
        _kept("conv1d")


def test_keep_in_float32_leaves_float32_unchanged_and_widens_half_inputs() -> None:
    """In float32 the kept module equals the plain one bit for bit (forward and gradients); in
    bfloat16 the output is bfloat16, the float32 convolutions convolve and apply SiLU in float32 and
    round once (the inputs they keep for the cache in bfloat16), decoding through the cache equals
    the full forward, and gradients reach the float32 parameters."""
    plain, kept = _kept(), _kept("dt_bias", "A_log", "conv")
    kept.load_state_dict(plain.state_dict())
    x = torch.randn(2, 9, C, generator=torch.Generator().manual_seed(4))
    assert_same_forward_and_gradients(plain, kept, x)
    kept.zero_grad()
    kept.bfloat16()
    t = kept.q_proj(x.bfloat16())
    new: dict[str, Tensor] = {}
    y = kept.short_conv("q", t, None, {}, new)
    want = F.silu(F.conv1d(F.pad(t.float().transpose(1, 2), (kept.conv_size - 1, 0)), kept.q_conv.weight,
                           groups=t.shape[-1])).transpose(1, 2).bfloat16()
    assert y.dtype == new["q"].dtype == torch.bfloat16 and torch.equal(y, want)
    xb = x.bfloat16()
    with torch.no_grad():
        full = kept(xb)
        cache = kept.init_cache(2, 9)
        steps = torch.cat([kept(xb[:, :4], cache=cache)] + [kept(xb[:, s:s + 1], cache=cache) for s in range(4, 9)], 1)
    assert full.dtype == torch.bfloat16 and torch.isfinite(full).all()
    torch.testing.assert_close(steps, full, rtol=2e-2, atol=2e-2)
    kept(xb).float().square().sum().backward()
    for n in kept.float32_params:
        grad = kept.get_parameter(n).grad
        assert grad is not None and grad.dtype == torch.float32 and float(grad.abs().sum()) > 0, n
