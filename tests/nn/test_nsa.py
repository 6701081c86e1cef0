"""Native sparse attention: fast form == dense float64 reference, causality, decode == full, cost."""

from __future__ import annotations

import copy

import pytest
import torch

import attnzoo as az
from attnzoo.cost import estimate
from attnzoo.functional.softmax.nsa import NSAConfig, nsa_attention, num_compressed, pick_blocks
from attnzoo.nn.nsa import BlockCompressor, NativeSparseAttention, NSACache, nsa_pairs
from attnzoo.variants import VARIANTS, build_attention, resolve_config

F64 = torch.float64

#: (l, d, l', n, w): paper-like overlap (l = 2d), compressed blocks longer than selection blocks,
#: non-overlapping compression (d = l) with wider selection blocks.
CONFIGS = [NSAConfig(4, 2, 4, 4, 4), NSAConfig(6, 3, 3, 4, 5), NSAConfig(4, 4, 8, 3, 6)]


def _inputs(cfg: NSAConfig, B: int, H: int, G: int, Nq: int, Nk: int, seed: int = 0, D: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g, dtype=F64)
    k = torch.randn(B, G, Nk, D, generator=g, dtype=F64)
    v = torch.randn(B, G, Nk, D, generator=g, dtype=F64)
    gates = torch.rand(B, H, Nq, 3, generator=g, dtype=F64)
    torch.manual_seed(seed)
    comp = BlockCompressor(D, cfg.block_len, cfg.block_stride, {"dtype": F64})
    return q, k, v, gates, comp


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize(("H", "G", "Nq", "Nk"), [(4, 2, 23, 23), (3, 1, 9, 30), (2, 2, 1, 17)])
def test_fast_equals_reference_forward_and_backward(cfg: NSAConfig, H: int, G: int, Nq: int, Nk: int) -> None:
    q, k, v, gates, comp = _inputs(cfg, 2, H, G, Nq, Nk)
    leaves = [t.requires_grad_() for t in (q, k, v, gates)]
    outs, grads = [], []
    for form, chunk in (("reference", 128), ("fast", 5)):
        comp.zero_grad()
        out = nsa_attention(q, k, v, comp(k), comp(v), gates, cfg, form=form, query_chunk=chunk)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=F64)).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in leaves] + [p.grad.clone() for p in comp.parameters()])
        for t in leaves:
            t.grad = None
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_pick_blocks_takes_first_and_local_blocks_and_only_causal_ones() -> None:
    cfg = NSAConfig(4, 2, 4, 5, 4)
    g = torch.Generator().manual_seed(1)
    t = torch.arange(40)
    scores = torch.rand(2, 3, 40, 10, generator=g, dtype=F64)
    idx, ok = pick_blocks(scores, t, cfg)
    for b in range(2):
        for grp in range(3):
            for i in range(40):
                chosen = set(idx[b, grp, i][ok[b, grp, i]].tolist())
                cur = i // 4
                valid = list(range(cur + 1))
                assert chosen <= set(valid) and len(chosen) == min(5, len(valid))
                assert {0, cur, max(cur - 1, 0)} <= chosen
                rest = [j for j in valid if j not in (0, cur, cur - 1)]
                best = sorted(rest, key=lambda j: -float(scores[b, grp, i, j]))[:5 - len({0, cur, max(cur - 1, 0)})]
                assert set(best) <= chosen


def test_selection_is_shared_by_the_heads_of_a_group() -> None:
    """With Hkv = 1 the selected set follows the group's summed importance, not each head's own:
    swapping the queries of two heads of one group leaves the picks (hence each head's output
    under its own query) the same up to the swap."""
    cfg = NSAConfig(4, 2, 4, 4, 4)
    q, k, v, gates, comp = _inputs(cfg, 1, 4, 1, 30, 30, seed=3)
    gates = torch.zeros_like(gates)
    gates[..., 1] = 1.0  # the selected branch alone
    out = nsa_attention(q, k, v, comp(k), comp(v), gates, cfg, form="fast", query_chunk=7)
    perm = [1, 0, 3, 2]
    out_p = nsa_attention(q[:, perm], k, v, comp(k), comp(v), gates, cfg, form="fast", query_chunk=7)
    torch.testing.assert_close(out_p, out[:, perm], rtol=0, atol=1e-13)


@pytest.mark.parametrize("branch", [0, 1, 2, None])
def test_no_output_sees_the_future(branch: int | None) -> None:
    """Perturbing tokens after ``t`` never changes outputs at positions ``<= t`` (each branch alone
    and the full module)."""
    cfg = NSAConfig(4, 2, 4, 4, 5)
    N = 26
    for t in (0, 2, 3, 4, 9, 17, 24):
        if branch is None:
            torch.manual_seed(0)
            mod = NativeSparseAttention(16, 4, num_kv_heads=2, block_len=4, block_stride=2, select_len=4,
                                        num_selected=4, window=5).double()
            x = torch.randn(2, N, 16, dtype=F64)
            x2 = x.clone()
            x2[:, t + 1:] += 10 * torch.randn_like(x2[:, t + 1:])
            a, b = mod(x), mod(x2)
        else:
            q, k, v, gates, comp = _inputs(cfg, 2, 4, 2, N, N, seed=t)
            gates = torch.zeros_like(gates)
            gates[..., branch] = 1.0
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            for z in (q2, k2, v2):
                z[:, :, t + 1:] += 10 * torch.randn_like(z[:, :, t + 1:])
            a = nsa_attention(q, k, v, comp(k), comp(v), gates, cfg, query_chunk=4)
            b = nsa_attention(q2, k2, v2, comp(k2), comp(v2), gates, cfg, query_chunk=4)
            a, b = a.transpose(1, 2), b.transpose(1, 2)
        torch.testing.assert_close(b[:, :t + 1], a[:, :t + 1], rtol=0, atol=1e-12)
        assert not torch.allclose(b[:, t + 1:], a[:, t + 1:])


def _module(**kw) -> NativeSparseAttention:
    torch.manual_seed(0)
    settings = {"block_len": 4, "block_stride": 2, "select_len": 4, "num_selected": 4, "window": 5, **kw}
    return NativeSparseAttention(32, 4, **settings).double().eval()


@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("kv", [1, 2])
def test_decode_with_cache_equals_full_forward(chunk: int, kv: int) -> None:
    mod = _module(num_kv_heads=kv)
    mod.query_chunk = 4
    x = torch.randn(2, 29, 32, dtype=F64)
    with torch.no_grad():
        full = mod(x)
        cache = mod.init_cache(2, 29)
        outs = [mod(x[:, s:s + chunk], cache=cache) for s in range(0, 29, chunk)]
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-12, atol=1e-12)
    assert isinstance(cache, NSACache) and cache.length == 29 and cache.num_blocks == num_compressed(29, 4, 2)


def test_failed_decode_call_leaves_the_cache_as_it_was() -> None:
    mod = _module()
    x = torch.randn(1, 10, 32, dtype=F64)
    cache = mod.init_cache(1, 10)
    with torch.no_grad():
        mod(x[:, :7], cache=cache)
        with pytest.raises(ValueError, match="max_len"):
            mod(x, cache=cache)
        assert (cache.length, cache.num_blocks) == (7, num_compressed(7, 4, 2))
        last = mod(x[:, 7:], cache=cache)
    torch.testing.assert_close(last, mod(x)[:, 7:], rtol=1e-12, atol=1e-12)
    cache.reset()
    assert cache.length == 0 and cache.nbytes > 0


def test_module_arguments_are_checked() -> None:
    mod = _module()
    x = torch.randn(1, 6, 32)
    with pytest.raises(ValueError, match="mask"):
        mod.float()(x, mask=torch.ones(1, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="context"):
        mod(x, context=x)
    with pytest.raises(ValueError, match="return_weights"):
        mod(x, return_weights=True)
    with pytest.raises(ValueError, match="num_selected"):
        NativeSparseAttention(32, 4, num_selected=2)
    with pytest.raises(ValueError, match="block_stride"):
        NativeSparseAttention(32, 4, block_len=4, block_stride=8)
    with pytest.raises(ValueError, match="causal"):
        build_attention("nsa", 32, 4, causal=False)


def test_functional_arguments_are_checked() -> None:
    cfg = NSAConfig(4, 2, 4, 4, 4)
    q, k, v, gates, comp = _inputs(cfg, 1, 4, 2, 8, 8)
    kc, vc = comp(k), comp(v)
    with pytest.raises(ValueError, match="gates must have shape"):
        nsa_attention(q, k, v, kc, vc, gates[..., :2], cfg)
    with pytest.raises(ValueError, match="k must have shape"):
        nsa_attention(q, k[:, :, :, :4], v, kc, vc, gates, cfg)
    with pytest.raises(TypeError, match="q must be a floating"):
        nsa_attention(q.long(), k, v, kc, vc, gates, cfg)
    with pytest.raises(ValueError, match="form"):
        nsa_attention(q, k, v, kc, vc, gates, cfg, form="dense")
    with pytest.raises(ValueError, match="q_offset"):
        nsa_attention(q, k, v, kc, vc, gates, cfg, q_offset=3)
    with pytest.raises(TypeError, match="config"):
        nsa_attention(q, k, v, kc, vc, gates, (4, 2, 4, 4, 4))  # type: ignore[arg-type]


@pytest.mark.parametrize("cfg", [*CONFIGS, NSAConfig(32, 16, 64, 16, 512)])
@pytest.mark.parametrize("n", [1, 5, 13, 40, 130])
def test_closed_form_pairs_equal_counting_the_reference_masks(cfg: NSAConfig, n: int) -> None:
    """``nsa_pairs`` == the pairs the dense definition lets attend (every query picks the same count)."""
    t = torch.arange(n)
    ends = torch.arange(num_compressed(n, cfg.block_len, cfg.block_stride)) * cfg.block_stride + cfg.block_len - 1
    cmp = int((ends[None, :] <= t[:, None]).sum())
    ns = -(-n // cfg.select_len)
    idx, ok = pick_blocks(torch.rand(1, 1, n, ns, dtype=F64), t, cfg)
    chosen = torch.zeros(n, ns, dtype=torch.bool).scatter(-1, idx[0, 0], ok[0, 0])
    key = torch.arange(n)
    slc = int((chosen[:, key // cfg.select_len] & (key[None, :] <= t[:, None])).sum())
    win = int(((key[None, :] <= t[:, None]) & (key[None, :] > t[:, None] - cfg.window)).sum())
    got = nsa_pairs(n, cfg)
    assert got[:3] == (cmp, slc, win)
    assert got[3] == cfg.select_len * int(ok[0, 0].sum())


def test_registered_everywhere() -> None:
    spec = VARIANTS["nsa"]
    assert not spec.exact and spec.causal_modes == (True,)
    mod = build_attention("nsa", 64, 8)
    cfg = resolve_config("nsa", 64, 8)
    assert (mod.num_kv_heads, cfg.num_kv_heads) == (2, 2)  # GQA groups of 4 heads, as published
    est = estimate("nsa", 10**9, 4096, 32)
    dense = estimate("gqa", 10**9, 4096, 32, num_kv_heads=8)
    assert 0 < est.flops_attention < dense.flops_attention / 8  # ~N^2 / (2 d) compressed pairs dominate
    assert est.params == sum(p.numel() for n_, p in build_attention("nsa", 4096, 32).named_parameters()
                             if not n_.endswith("bias"))


def test_selected_branch_work_is_n_l_prime_keys_a_query() -> None:
    """The fast form's selected branch multiplies each query by its ``n l'`` gathered keys only:
    its FLOPs are linear in N (4x the tokens, 4x the FLOPs), not quadratic."""
    from torch.utils.flop_counter import FlopCounterMode

    from attnzoo.functional.softmax.nsa import _blocks, _chunk_selected

    cfg = NSAConfig(4, 2, 4, 4, 4)
    flops = []
    for n in (64, 256):
        q, k, v, _, _ = _inputs(cfg, 1, 4, 2, n, n)
        t = torch.arange(n)
        idx, ok = pick_blocks(torch.rand(1, 2, n, n // 4, dtype=F64), t, cfg)
        with FlopCounterMode(display=False) as fc:
            _chunk_selected(q.unflatten(1, (2, 2)), _blocks(k, 4), _blocks(v, 4), idx, ok, t, cfg, 1.0)
        flops.append(fc.get_total_flops())
    assert flops[0] == 2 * 2 * 4 * 64 * (4 * 4) * 8  # 2 products x 2 x H x N x (n l') x D
    assert flops[1] == 4 * flops[0]


@pytest.mark.parametrize(("h", "g", "nq", "nk", "w"), [(4, 2, 45, 48, 8), (2, 1, 30, 30, 7), (4, 4, 5, 40, 16),
                                                       (2, 2, 1, 9, 4), (2, 1, 40, 40, 1)])
@pytest.mark.parametrize("block", [None, 3, 16])
def test_banded_window_equals_window_attention(h: int, g: int, nq: int, nk: int, w: int, block: int | None) -> None:
    """The window branch (one call over blocks of ``block`` queries, default ``w``, and their
    ``block + w - 1``-key slabs) equals ``az.attention(window=(w - 1, 0), causal=True)`` in float64:
    ragged blocks, GQA, a ``q_offset``, one query, blocks shorter and longer than the window."""
    from attnzoo.functional.softmax.nsa import _window_banded

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, h, nq, 8, generator=gen, dtype=F64)
    k, v = (torch.randn(2, g, nk, 8, generator=gen, dtype=F64) for _ in range(2))
    want = az.attention(q, k, v, causal=True, window=(w - 1, 0), q_offset=nk - nq, scale=0.3, backend="reference")
    got = _window_banded(q, k, v, w, nk - nq, 0.3, "auto", block)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_inference_block_major_with_value_width_unlike_key_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough queries for the block-major inference branch and ``Dv != D``: torch's CPU flash kernel
    (its tiles) takes equal widths only, so the branch must fall back to its matmul tiles."""
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")  # the PyTorch path, whether or not the compiled one is built
    cfg = NSAConfig(4, 2, 4, 4, 4)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 300, 8, generator=g, dtype=F64), torch.randn(1, 1, 320, 8, generator=g, dtype=F64)
    v = torch.randn(1, 1, 320, 12, generator=g, dtype=F64)
    gates = torch.rand(1, 2, 300, 3, generator=g, dtype=F64)
    torch.manual_seed(0)
    kc = BlockCompressor(8, cfg.block_len, cfg.block_stride, {"dtype": F64})(k).detach()
    vc = BlockCompressor(12, cfg.block_len, cfg.block_stride, {"dtype": F64})(v).detach()
    ref = nsa_attention(q, k, v, kc, vc, gates, cfg, form="reference")
    with torch.no_grad():
        out = nsa_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), gates.float(), cfg)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_docs_examples_run() -> None:
    """Every python block of docs/nsa.md runs as written."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "nsa.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for i, code in enumerate(blocks):
        torch.manual_seed(i)
        exec(compile(code, f"docs/nsa.md[block {i}]", "exec"), {})


def test_float16_scores_are_scaled_before_they_can_overflow() -> None:
    """The selected branch scales the queries before the product (unscaled float16 scores of inputs
    ~150 overflow to inf and gave NaN rows); its output follows the float64 run on the same rounded
    weights and input."""
    torch.manual_seed(0)
    m64 = build_attention("nsa", 32, 4, causal=True, **VARIANTS["nsa"].check).double().eval()
    x = (150 * torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)).half()
    with torch.no_grad():
        y, ref = copy.deepcopy(m64).half()(x), m64(x.double())
    assert torch.isfinite(y).all()
    # at this scale a few float16 roundings flip a block's top-k rank (a discontinuity), so compare
    # in the mean: most rows pick the same blocks and agree to float16 rounding
    assert (y.double() - ref).abs().median() / ref.abs().median() < 30 * torch.finfo(torch.float16).eps
