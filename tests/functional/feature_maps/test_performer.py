"""Performer (FAVOR+): forms agree, state, causality, padding, approximation quality, module redraws."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnzoo as az
from attnzoo.variants import build_attention


def qkv(b: int = 2, h: int = 2, n: int = 40, d: int = 16, amp: float = 0.5, dtype: torch.dtype = torch.float32,
        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = amp * torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k = amp * torch.randn(b, h, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    return q, k, v


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


# ------------------------------------------------------------------ projection
def test_projection_shape_seed_and_orthogonality() -> None:
    w1 = az.draw_performer_projection(40, 16, seed=3)
    w2 = az.draw_performer_projection(40, 16, seed=3)
    w3 = az.draw_performer_projection(40, 16, seed=4)
    assert w1.shape == (40, 16) and w1.dtype == torch.float32
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(az.draw_performer_projection(40, 16, generator=g), w1)
    block = w1[:16].double()
    unit = block / block.norm(dim=1, keepdim=True)
    torch.testing.assert_close(unit @ unit.T, torch.eye(16, dtype=torch.float64), atol=1e-5, rtol=0)
    iid = az.draw_performer_projection(40, 16, orthogonal=False, seed=3)
    gram = (iid[:16] / iid[:16].norm(dim=1, keepdim=True)) @ (iid[:16] / iid[:16].norm(dim=1, keepdim=True)).T
    assert (gram - torch.eye(16)).abs().max() > 0.05  # i.i.d. rows are not orthogonal


def test_projection_bad_inputs() -> None:
    with pytest.raises(ValueError, match="num_features"):
        az.draw_performer_projection(0, 16)
    with pytest.raises(ValueError, match="head_dim"):
        az.draw_performer_projection(8, 0)
    with pytest.raises(TypeError, match="num_features"):
        az.draw_performer_projection(8.0, 16)
    with pytest.raises(ValueError, match="either generator or seed"):
        az.draw_performer_projection(8, 16, generator=torch.Generator(), seed=1)


# ------------------------------------------------------------------ forms and state
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 8, 40, 64])  # 5, 8, 40 divide N=40; 1 trivially; 64 > N
def test_chunked_equals_quadratic(causal: bool, chunk: int) -> None:
    q, k, v = qkv()
    w = az.draw_performer_projection(32, 16, seed=0)
    ref = az.performer_attention(q, k, v, w, causal=causal, form="quadratic")
    out = az.performer_attention(q, k, v, w, causal=causal, form="chunked", chunk_size=chunk)
    assert rel(out, ref) < 1e-4, f"chunk={chunk} causal={causal}: rel err {rel(out, ref):.2e}"


@pytest.mark.parametrize("chunk", [3, 7])
def test_recurrent_equals_chunked_equals_quadratic_nondividing(chunk: int) -> None:
    q, k, v = qkv(n=23)
    w = az.draw_performer_projection(24, 16, seed=1)
    ref = az.performer_attention(q, k, v, w, causal=True, form="quadratic")
    for form in ("recurrent", "chunked"):
        out = az.performer_attention(q, k, v, w, causal=True, form=form, chunk_size=chunk)
        assert rel(out, ref) < 1e-4, f"{form}: rel err {rel(out, ref):.2e}"


@pytest.mark.parametrize("split", [1, 17, 32])
def test_state_two_calls_equal_one_call(split: int) -> None:
    q, k, v = qkv(n=45)
    w = az.draw_performer_projection(32, 16, seed=2)
    full = az.performer_attention(q, k, v, w, causal=True, chunk_size=8)
    a, st = az.performer_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], w, causal=True,
                                   chunk_size=8, return_state=True)
    b = az.performer_attention(q[:, :, split:], k[:, :, split:], v[:, :, split:], w, causal=True, chunk_size=8,
                               state=st)
    assert st[0].shape == (2, 2, 32, 16) and st[1].shape == (2, 2, 32)
    out = torch.cat([a, b], dim=2)
    assert rel(out, full) < 1e-4, f"split {split}: rel err {rel(out, full):.2e}"


def test_key_stabiliser_cancels() -> None:
    # bidirectional stateless calls subtract the max key exponent; stateful ones do not: same result
    q, k, v = qkv(amp=1.5)
    w = az.draw_performer_projection(64, 16, seed=5)
    stab = az.performer_attention(q, k, v, w)
    plain, _ = az.performer_attention(q, k, v, w, return_state=True)
    assert rel(stab, plain) < 1e-5


# ------------------------------------------------------------------ causality and padding
@pytest.mark.parametrize("t", [0, 9, 30])
def test_causality_perturbation(t: int) -> None:
    q, k, v = qkv(n=36)
    w = az.draw_performer_projection(32, 16, seed=0)
    base = az.performer_attention(q, k, v, w, causal=True, chunk_size=8)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, t + 1:] = 5.0 * torch.randn(x[:, :, t + 1:].shape, generator=torch.Generator().manual_seed(7))
    out = az.performer_attention(q2, k2, v2, w, causal=True, chunk_size=8)
    torch.testing.assert_close(out[:, :, : t + 1], base[:, :, : t + 1], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(out[:, :, t + 1:], base[:, :, t + 1:])


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_contribute_nothing(causal: bool) -> None:
    q, k, v = qkv(b=2, n=20)
    w = az.draw_performer_projection(32, 16, seed=0)
    pad = torch.ones(2, 20, dtype=torch.bool)
    pad[1, 12:] = False
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, :, 12:] = 30.0  # would dominate (and overflow) the key stabiliser if not masked
    v_bad[1, :, 12:] = 1e4
    out = az.performer_attention(q, k_bad, v_bad, w, causal=causal, key_padding_mask=pad)
    rows = slice(0, 12) if causal else slice(None)
    ref = az.performer_attention(q[1:, :, rows], k[1:, :, :12], v[1:, :, :12], w, causal=causal)
    assert torch.isfinite(out).all()
    assert rel(out[1:, :, rows], ref) < 1e-5


# ------------------------------------------------------------------ approximation quality
def _mean_error(num_features: int, orthogonal: bool, causal: bool = False, seeds: int = 8) -> float:
    errs = []
    for s in range(seeds):
        q, k, v = qkv(b=1, h=2, n=64, d=16, amp=0.5, dtype=torch.float64, seed=100 + s)
        exact = az.attention(q, k, v, causal=causal, backend="reference")
        w = az.draw_performer_projection(num_features, 16, orthogonal=orthogonal, seed=s, dtype=torch.float64)
        errs.append(rel(az.performer_attention(q, k, v, w, causal=causal), exact))
    return sum(errs) / len(errs)


@pytest.mark.parametrize("causal", [False, True])
def test_error_falls_with_more_features(causal: bool) -> None:
    e16, e64, e256 = (_mean_error(f, True, causal) for f in (16, 64, 256))
    assert e16 > e64 > e256, f"mean relative error vs softmax: F=16 {e16:.3f}, F=64 {e64:.3f}, F=256 {e256:.3f}"
    assert e256 < 0.2


@pytest.mark.parametrize("num_features", [16, 64])
def test_orthogonal_beats_iid(num_features: int) -> None:
    orth, iid = _mean_error(num_features, True), _mean_error(num_features, False)
    assert orth < iid, f"F={num_features}: orthogonal {orth:.3f} vs iid {iid:.3f}"


# ------------------------------------------------------------------ bad input
def test_bad_inputs() -> None:
    q, k, v = qkv(n=8)
    w = az.draw_performer_projection(8, 16, seed=0)
    with pytest.raises(ValueError, match="projection"):
        az.performer_attention(q, k, v, w[:, :8])
    with pytest.raises(TypeError, match="projection"):
        az.performer_attention(q, k, v, None)
    with pytest.raises(ValueError, match="chunk_size"):
        az.performer_attention(q, k, v, w, causal=True, chunk_size=-1)
    with pytest.raises(ValueError, match="state S"):
        az.performer_attention(q, k, v, w, causal=True, state=(torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16)))
    with pytest.raises(ValueError, match="scale"):
        az.performer_attention(q, k, v, w, scale=0.0)
    with pytest.raises(ValueError, match="num_features"):
        az.PerformerAttention(32, 2, num_features=0)


# ------------------------------------------------------------------ module
def test_module_decode_equals_full_forward() -> None:
    torch.manual_seed(0)
    m = az.PerformerAttention(32, 2, num_features=24, causal=True, chunk_size=4, seed=0).double()
    x = 0.5 * torch.randn(2, 10, 32, dtype=torch.float64)
    full = m(x)
    cache = m.init_cache(2, 10)
    nbytes = cache.nbytes
    steps = [m(x[:, i:i + 1], cache=cache) for i in range(10)]
    assert cache.nbytes == nbytes == 2 * 2 * 24 * 17 * 8
    assert rel(torch.cat(steps, 1), full) < 1e-12


def test_module_redraw_schedule_and_seed() -> None:
    a = az.PerformerAttention(16, 2, num_features=8, redraw_interval=2, seed=11)
    b = az.PerformerAttention(16, 2, num_features=8, redraw_interval=2, seed=11)
    assert torch.equal(a.projection, b.projection)
    x = torch.randn(1, 3, 16)
    p0 = a.projection.clone()
    a.train()
    a(x)
    a(x)
    assert torch.equal(a.projection, p0)  # two calls on the first draw
    a(x)
    assert not torch.equal(a.projection, p0)  # the third call redraws
    b.redraw_projection()
    assert torch.equal(a.projection, b.projection)  # reproducible: draw i uses seed + i
    a.eval()
    p1 = a.projection.clone()
    for _ in range(5):
        a(x)
    assert torch.equal(a.projection, p1)  # never in eval mode
    assert "projection" in a.state_dict()


def test_a_restored_module_continues_the_redraw_schedule(tmp_path: Path) -> None:
    """The schedule (draws so far, calls since the last) was not in the state dict: a module
    restored mid-training restarted it and trained on other projections than the original."""
    x = torch.randn(1, 6, 32)

    def make() -> az.PerformerAttention:
        return az.PerformerAttention(32, 4, num_features=16, causal=True, redraw_interval=2, seed=0).train()

    a = make()
    for _ in range(5):
        a(x)
    sd = a.state_dict()
    assert sd["redraw_schedule"].tolist() == [3, 1]
    b = make()
    b.load_state_dict(sd)
    for _ in range(4):
        assert torch.equal(a(x), b(x))
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file

    save_file(b.state_dict(), str(tmp_path / "m.safetensors"))  # every entry a tensor
    c = make()
    c.load_state_dict(load_file(str(tmp_path / "m.safetensors")))
    assert torch.equal(c(x), b(x))
    old = {k: v for k, v in sd.items() if k != "redraw_schedule"}  # saved before the schedule was
    make().load_state_dict(old)
    with pytest.raises(RuntimeError, match="redraw_schedule"):
        make().load_state_dict({**sd, "redraw_schedule": torch.zeros(3)})


def test_module_stale_cache_after_redraw() -> None:
    m = az.PerformerAttention(16, 2, num_features=8, causal=True, seed=0)
    cache = m.init_cache(1, 8)
    m(torch.randn(1, 2, 16), cache=cache)
    m.redraw_projection()
    with pytest.raises(ValueError, match="redrawn"):
        m(torch.randn(1, 1, 16), cache=cache)
    cache.reset()
    m(torch.randn(1, 1, 16), cache=cache)


def test_registry_builds_performer() -> None:
    m = build_attention("performer", dim=16, num_heads=2, num_features=8)
    assert isinstance(m, az.PerformerAttention) and m.causal and m.num_features == 8
    assert m(torch.randn(1, 5, 16)).shape == (1, 5, 16)


def test_chunked_gradients_match_numerical() -> None:
    q, k, v = (t.requires_grad_() for t in qkv(b=1, h=1, n=7, d=4, dtype=torch.float64))
    w = az.draw_performer_projection(6, 4, seed=0, dtype=torch.float64)
    pad = torch.tensor([[True] * 5 + [False] * 2])
    assert torch.autograd.gradcheck(
        lambda a, b, c: az.performer_attention(a, b, c, w, causal=True, chunk_size=3, key_padding_mask=pad),
        (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: az.performer_attention(a, b, c, w), (q, k, v))


def test_half_casts_keep_the_projection_in_float32() -> None:
    """The projection is float32 at construction in any dtype (docs/efficient.md); ``.to(bfloat16)``
    rounded it, so a cast module and one built in bfloat16 gave different outputs (1e-3)."""
    a = az.PerformerAttention(32, 4, num_features=16, causal=True, seed=0)
    b = az.PerformerAttention(32, 4, num_features=16, causal=True, seed=0, dtype=torch.bfloat16)
    b.load_state_dict(a.state_dict())
    a16 = a.to(torch.bfloat16)
    assert a16.projection.dtype == b.projection.dtype == torch.float32
    x = torch.randn(1, 8, 32).bfloat16()
    assert torch.equal(a16(x), b(x))
