"""Issue 33, item 9: the auto policy's fallback, NSA's FLOP count and FlexAttention across shapes."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import attnzoo as az
from attnzoo.cost import estimate
from attnzoo.functional.backends import flex
from attnzoo.functional.softmax.nsa import NSAConfig, num_compressed, window_chunk
from attnzoo.nn.nsa import QUERY_CHUNK, nsa_computed_pairs
from attnzoo.variants import build_attention

F64 = torch.float64


def _inputs(requires: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=g, dtype=F64, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 1, 9, 9, generator=g, dtype=F64, requires_grad=requires == "float mask")
    slopes = torch.rand(4, generator=g, dtype=F64, requires_grad=requires == "alibi")
    return q, k, v, bias, slopes


@pytest.mark.parametrize("grad_of", ["float mask", "alibi"])
@pytest.mark.parametrize("feature", ["sinks", "softcap", "return_lse"])
def test_auto_falls_back_to_reference_for_bias_gradients(grad_of: str, feature: str) -> None:
    """Before: ``backend 'tiled' does not support: float mask gradient (use backend='auto' ...)``
    raised by auto itself. Now auto serves the call; outputs and every gradient equal reference."""
    q, k, v, bias, slopes = _inputs(grad_of)
    extra = {"mask": bias} if grad_of == "float mask" else {"alibi_slopes": slopes, "causal": True}
    extra |= {"sinks": {"sinks": torch.linspace(-1, 1, 4, dtype=F64)}, "softcap": {"softcap": 3.0},
              "return_lse": {"return_lse": True}}[feature]
    results = {}
    for backend in ("auto", "reference"):
        out = az.attention(q.float(), k.float(), v.float(), backend=backend,
                           **{n: (t.float() if isinstance(t, torch.Tensor) else t) for n, t in extra.items()})
        first = out[0] if isinstance(out, tuple) else out
        leaves = (q, k, v, bias if grad_of == "float mask" else slopes)
        results[backend] = (first, *torch.autograd.grad(first.square().sum(), leaves))
    for got, want in zip(results["auto"], results["reference"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _cpu_flash(query_shape, key_shape, value_shape, *args, out_shape=None, **kw):  # type: ignore[no-untyped-def]
    return sdpa_flop_count(query_shape, key_shape, value_shape)  # torch has no formula for its CPU flash kernel


@pytest.mark.parametrize(("n", "dim", "heads"), [(100, 64, 8), (300, 64, 8), (1024, 64, 8), (700, 128, 4)])
def test_nsa_flops_equal_flop_counter(n: int, dim: int, heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: 27-29% under FlopCounterMode at N = 1024 (visible pairs counted for dense slabs)."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")  # FlopCounterMode cannot see the compiled kernels' sgemm calls
    torch.manual_seed(0)
    mod = build_attention("nsa", dim, heads).eval()
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as fc:
        mod(torch.randn(1, n, dim))
    for backend in ("auto", "reference"):
        est = estimate("nsa", n, dim, heads, backend=backend)
        assert abs(est.flops - fc.get_total_flops()) <= 0.05 * fc.get_total_flops()
        assert est.flops_useful <= est.flops_attention


def _counted(n: int, cfg: NSAConfig, chunk: int) -> tuple[int, int, int]:
    """The fast form's pairs by walking its chunks as ``attnzoo.functional.softmax.nsa`` does."""
    cmp = slc = win = 0
    for a in range(0, n, chunk):
        t1 = min(n, a + chunk)
        cmp += (t1 - a) * num_compressed(t1, cfg.block_len, cfg.block_stride)
        slc += (t1 - a) * min(cfg.num_selected, (t1 - 1) // cfg.select_len + 1) * cfg.select_len
    cw = window_chunk(chunk, cfg.window)
    for _ in range(0, n, cw):  # one banded call: every block (the last one padded) scores c + w - 1 keys
        win += cw * (cw + cfg.window - 1)
    return cmp, slc, win


@pytest.mark.parametrize("cfg", [NSAConfig(32, 16, 64, 16, 512), NSAConfig(4, 2, 4, 4, 4), NSAConfig(5, 3, 7, 3, 9),
                                 NSAConfig(6, 6, 6, 3, 5)])
@pytest.mark.parametrize("chunk", [1, 7, 16, QUERY_CHUNK])
def test_nsa_computed_pairs_closed_form_equals_the_chunk_walk(cfg: NSAConfig, chunk: int) -> None:
    for n in [*range(1, 140), 1000, 1024, 4099]:
        assert nsa_computed_pairs(n, cfg, chunk) == _counted(n, cfg, chunk), n
    assert estimate("nsa", 10**9, 4096, 32).flops > 0  # closed form: instant at N = 10^9


@pytest.mark.slow
def test_flex_runs_fused_past_eight_shapes() -> None:
    """Before: the 9th sequence length hit torch's recompile limit and ran unfused with a warning."""
    if not flex.CAPABILITIES.available(torch.device("cpu")):
        pytest.skip("FlexAttention is not available")
    flex._compiled.clear()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (128, 160, 192, 200, 256, 300, 320, 384, 400, 448):
            q = torch.randn(1, 2, n, 16)
            with torch.no_grad():
                got = az.attention(q, q, q, causal=True, backend="flex")
            torch.testing.assert_close(got, az.attention(q, q, q, causal=True, backend="reference"))
    unfused = [str(w.message) for w in caught if "without torch.compile" in str(w.message)]
    assert not unfused, unfused[0]
