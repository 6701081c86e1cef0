"""MultiHeadAttention family: decoding contract, equality with torch/MHA, and input validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnzoo as az
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.parts import AttentionParts, Scores
from attnzoo.variants import build_attention

DIM, HEADS = 32, 4


def build(variant: str, *, rope: bool = False, alibi: bool = False, backend: str = "auto", **kw) -> nn.Module:
    common = dict(causal=True, rope=rope or None, backend=backend, parts=AttentionParts(scores=Scores(alibi=alibi)),
                  **kw)
    if variant == "mha":
        return az.MultiHeadAttention(DIM, HEADS, **common)
    if variant == "gqa":
        return az.GroupedQueryAttention(DIM, HEADS, num_kv_heads=2, **common)
    if variant == "mqa":
        return az.MultiQueryAttention(DIM, HEADS, **common)
    if variant == "sliding":
        return az.SlidingWindowAttention(DIM, HEADS, window=3, **common)
    if variant == "local_global":
        return az.LocalGlobalAttention(DIM, HEADS, window=2, global_tokens=(0, 5), **common)
    raise ValueError(variant)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


VARIANTS = ["mha", "gqa", "mqa", "sliding", "local_global"]


# ----------------------------------------------------------------------------- decoding contract
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("alibi", [False, True])
def test_decode_equals_full_forward(variant: str, rope: bool, alibi: bool) -> None:
    torch.manual_seed(0)
    m = build(variant, rope=rope, alibi=alibi).eval()
    x = torch.randn(2, 13, DIM)  # longer than 2 x the sliding window: the ring wraps around
    with torch.no_grad():
        full = m(x)
        # token by token
        cache = m.init_cache(2, 16)
        steps = torch.cat([m(x[:, i:i + 1], cache=cache) for i in range(13)], dim=1)
        assert cache.length == 13
        # chunked prefill (uneven chunks, one longer than the ring) + decode
        cache.reset()
        parts = [m(x[:, :5], cache=cache), m(x[:, 5:6], cache=cache), m(x[:, 6:11], cache=cache)]
        parts += [m(x[:, i:i + 1], cache=cache) for i in range(11, 13)]
        chunked = torch.cat(parts, dim=1)
    err_steps, err_chunked = max_err(steps, full), max_err(chunked, full)
    assert err_steps < 1e-5, f"{variant} rope={rope} alibi={alibi}: token-by-token max error {err_steps:.2e}"
    assert err_chunked < 1e-5, f"{variant} rope={rope} alibi={alibi}: chunked max error {err_chunked:.2e}"


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("variant", ["gqa", "sliding", "local_global"])
def test_decode_contract_per_backend(variant: str, backend: str) -> None:
    torch.manual_seed(1)
    m = build(variant, rope=True, backend=backend).eval()
    ref = build(variant, rope=True, backend="reference").eval()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(1, 10, DIM)
    with torch.no_grad():
        full = ref(x)
        cache = m.init_cache(1, 10)
        out = torch.cat([m(x[:, :4], cache=cache)] + [m(x[:, i:i + 1], cache=cache) for i in range(4, 10)], dim=1)
    assert max_err(out, full) < 1e-5, f"{variant}/{backend}: {max_err(out, full):.2e}"


def test_windowed_module_with_a_full_kv_cache() -> None:
    """A window over a full KVCache (keys left of the window are skipped as a view) == full forward,
    also with a key mask whose columns must be skipped with them."""
    torch.manual_seed(14)
    m = az.MultiHeadAttention(DIM, HEADS, num_kv_heads=2, causal=True, window=3, rope=True,
                              parts=AttentionParts(scores=Scores(alibi=True))).eval()
    x = torch.randn(2, 12, DIM)
    real = torch.ones(2, 12, dtype=torch.bool)
    real[1, 7] = False
    with torch.no_grad():
        full = m(x, mask=real[:, None, None, :])
        cache = az.KVCache(2, 12, 2, DIM // HEADS)
        outs = [m(x[:, :5], cache=cache, mask=real[:, None, None, :5])]
        outs += [m(x[:, i:i + 1], cache=cache, mask=real[:, None, None, : i + 1]) for i in range(5, 12)]
    assert max_err(torch.cat(outs, 1), full) < 1e-5


def test_sliding_cache_memory_stays_at_window() -> None:
    torch.manual_seed(2)
    w = 4
    m = az.SlidingWindowAttention(DIM, HEADS, window=w, num_kv_heads=2).eval()
    cache = m.init_cache(1, 64)
    assert isinstance(cache, az.SlidingWindowKVCache)
    ptr, nbytes = cache.k.data_ptr(), cache.nbytes
    with torch.no_grad():
        m(torch.randn(1, 7, DIM), cache=cache)
        for _ in range(5 * w):
            m(torch.randn(1, 1, DIM), cache=cache)
    assert cache.length == 7 + 5 * w
    assert cache.k.shape == (1, 2, w, DIM // HEADS) and cache.v.shape == (1, 2, w, DIM // HEADS)
    assert cache.nbytes == nbytes and cache.k.data_ptr() == ptr, "the ring buffer was reallocated"
    assert sorted(cache.slot_positions.tolist()) == list(range(cache.length - w, cache.length))


def test_decode_with_left_padding_positions_and_mask() -> None:
    """Batched generation with left padding: per-row RoPE positions + key padding == each row alone."""
    torch.manual_seed(3)
    for m in (az.MultiHeadAttention(DIM, HEADS, num_kv_heads=2, causal=True, rope=True).eval(),
              az.SlidingWindowAttention(DIM, HEADS, window=3, rope=True).eval()):
        pad = 3
        short = torch.randn(1, 6, DIM)
        other = torch.randn(1, 9, DIM)
        x = torch.cat([torch.cat([torch.zeros(1, pad, DIM), short], dim=1), other])  # [2, 9, C]
        real = torch.ones(2, 9, dtype=torch.bool)
        real[0, :pad] = False
        pos = (real.long().cumsum(-1) - 1).clamp(min=0)  # [2, 9]
        with torch.no_grad():
            alone = [m(short), m(other)]
            cache = m.init_cache(2, 9)
            outs = [m(x[:, :5], cache=cache, positions=pos[:, :5], mask=real[:, None, None, :5])]
            for i in range(5, 9):
                outs.append(m(x[:, i:i + 1], cache=cache, positions=pos[:, i:i + 1],
                              mask=real[:, None, None, : i + 1]))
        out = torch.cat(outs, dim=1)
        assert max_err(out[0, pad:], alone[0][0]) < 1e-5
        assert max_err(out[1], alone[1][0]) < 1e-5


def test_mask_object_with_caches() -> None:
    torch.manual_seed(4)
    lengths = torch.tensor([7, 4])
    mask = az.masks.key_padding(lengths) | az.masks.global_tokens([1])
    for m in (build("gqa", rope=True).eval(), build("sliding", alibi=True).eval()):
        x = torch.randn(2, 9, DIM)
        with torch.no_grad():
            full = m(x, mask=mask)
            cache = m.init_cache(2, 9)
            out = torch.cat([m(x[:, :3], cache=cache, mask=mask)]
                            + [m(x[:, i:i + 1], cache=cache, mask=mask) for i in range(3, 9)], dim=1)
        assert max_err(out, full) < 1e-5


def test_cross_attention_cache_reuses_projected_context() -> None:
    torch.manual_seed(5)
    m = az.MultiHeadAttention(DIM, HEADS, num_kv_heads=2, kv_dim=24).eval()
    x, ctx = torch.randn(2, 5, DIM), torch.randn(2, 7, 24)
    with torch.no_grad():
        full = m(x, ctx)
        cache = m.init_cache(2, 7)
        out = torch.cat([m(x[:, :1], ctx, cache=cache)] + [m(x[:, i:i + 1], cache=cache) for i in range(1, 5)], dim=1)
    assert cache.length == 7
    assert max_err(out, full) < 1e-5


# ----------------------------------------------------------------------------- vs torch MHA
def _torch_mha(batch_first: bool = True, kdim: int | None = None) -> nn.MultiheadAttention:
    return nn.MultiheadAttention(DIM, HEADS, batch_first=batch_first, kdim=kdim, vdim=kdim).eval()


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_equals_torch_multihead_attention(causal: bool) -> None:
    torch.manual_seed(6)
    ref = _torch_mha()
    m = az.MultiHeadAttention(DIM, HEADS, causal=causal, backend="reference").eval()
    with torch.no_grad():  # same layout: in_proj_weight rows are [q; k; v]
        m.qkv_proj.weight.copy_(ref.in_proj_weight)
        m.qkv_proj.bias.copy_(ref.in_proj_bias)
        m.out_proj.load_state_dict(ref.out_proj.state_dict())
    x = torch.randn(3, 8, DIM)
    kpm = torch.zeros(3, 8, dtype=torch.bool)  # torch: True = ignore
    kpm[0, 6:] = True
    kpm[2, 3:] = True
    attn_mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1) if causal else None
    with torch.no_grad():
        want, want_w = ref(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=False)
        got, got_w = m(x, mask=~kpm[:, None, None, :], return_weights=True)
    assert max_err(got, want) < 1e-5 and max_err(got_w, want_w) < 1e-6


def test_cross_attention_equals_torch_multihead_attention() -> None:
    torch.manual_seed(7)
    ref = _torch_mha(kdim=24)
    m = az.MultiHeadAttention(DIM, HEADS, kv_dim=24).eval()
    with torch.no_grad():
        m.load_qkv(ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight, *ref.in_proj_bias.chunk(3))
        m.out_proj.load_state_dict(ref.out_proj.state_dict())
    x, ctx = torch.randn(2, 5, DIM), torch.randn(2, 9, 24)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 4:] = True
    with torch.no_grad():
        want, _ = ref(x, ctx, ctx, key_padding_mask=kpm)
        got = m(x, ctx, mask=~kpm[:, None, None, :])
    assert max_err(got, want) < 1e-5


def test_cross_attention_on_fused_self_module_equals_torch() -> None:
    """Context of the model's width through the fused qkv_proj (weight slices, no copy)."""
    torch.manual_seed(8)
    ref = _torch_mha()
    m = az.MultiHeadAttention(DIM, HEADS).eval()
    with torch.no_grad():
        m.qkv_proj.weight.copy_(ref.in_proj_weight)
        m.qkv_proj.bias.copy_(ref.in_proj_bias)
        m.out_proj.load_state_dict(ref.out_proj.state_dict())
    x, ctx = torch.randn(2, 5, DIM), torch.randn(2, 6, DIM)
    with torch.no_grad():
        assert max_err(m(x, ctx), ref(x, ctx, ctx)[0]) < 1e-5


@pytest.mark.parametrize("rope", [False, True])
def test_gqa_with_duplicated_kv_weights_equals_mha(rope: bool) -> None:
    torch.manual_seed(9)
    H, Hkv, D = 8, 2, 6
    gqa = az.GroupedQueryAttention(DIM, H, num_kv_heads=Hkv, head_dim=D, causal=True, rope=rope or None).eval()
    mha = az.MultiHeadAttention(DIM, H, head_dim=D, causal=True, rope=rope or None).eval()
    wq, wk, wv = gqa.qkv_weights()
    bq, bk, bv = gqa.qkv_biases()
    group = H // Hkv

    def dup(t: torch.Tensor) -> torch.Tensor:  # KV head h // group serves query head h
        return t.reshape(Hkv, D, *t.shape[1:]).repeat_interleave(group, dim=0).reshape(H * D, *t.shape[1:])

    mha.load_qkv(wq, dup(wk), dup(wv), bq, dup(bk), dup(bv))
    mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 7, DIM)
    with torch.no_grad():
        assert max_err(gqa(x), mha(x)) < 1e-5


def test_auto_backend_matches_reference_and_weights() -> None:
    torch.manual_seed(10)
    m = az.MultiHeadAttention(DIM, HEADS, num_kv_heads=2, causal=True, window=3, parts=AttentionParts(scores=Scores(alibi=True))).eval()
    ref = az.MultiHeadAttention(DIM, HEADS, num_kv_heads=2, causal=True, window=3, backend="reference",
                                parts=AttentionParts(scores=Scores(alibi=True))).eval()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 12, DIM, dtype=torch.float32)
    with torch.no_grad():
        out, w = ref(x, return_weights=True)
        assert max_err(m(x), out) < 1e-5
    assert w.shape == (2, HEADS, 12, 12)
    assert torch.allclose(w.sum(-1), torch.ones(2, HEADS, 12))
    i, j = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
    hidden = (j > i) | (j < i - 3)
    assert (w[..., hidden] == 0).all()


def test_float64_and_head_dim_independent_of_width() -> None:
    torch.manual_seed(11)
    m = az.MultiHeadAttention(20, 3, head_dim=8, bias=False, causal=True).to(torch.float64)
    assert m.qkv_proj.weight.shape == (3 * 3 * 8, 20) and m.qkv_proj.bias is None
    x = torch.randn(2, 5, 20, dtype=torch.float64)
    y = m(x)
    assert y.shape == x.shape and y.dtype == torch.float64
    cache = m.init_cache(2, 5)
    assert cache.dtype == torch.float64
    with torch.no_grad():
        steps = torch.cat([m(x[:, i:i + 1], cache=cache) for i in range(5)], dim=1)
    assert max_err(steps, y) < 1e-12


def test_dropout_only_in_training() -> None:
    torch.manual_seed(12)
    m = az.MultiHeadAttention(DIM, HEADS, dropout=0.5)
    plain = az.MultiHeadAttention(DIM, HEADS)
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, 6, DIM)
    m.eval()
    assert max_err(m(x), plain(x)) == 0.0
    m.train()
    assert max_err(m(x), plain(x)) > 1e-3


def test_gradients_flow() -> None:
    torch.manual_seed(13)
    m = build("gqa", rope=True, alibi=True)
    x = torch.randn(2, 6, DIM, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in m.parameters())


# ----------------------------------------------------------------------------- bad input
def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match=r"dim .*30.* divisible by num_heads .*4"):
        az.MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match=r"num_heads .*8.* divisible by num_kv_heads .*3"):
        az.GroupedQueryAttention(32, 8, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"even head_dim.*5"):
        az.MultiHeadAttention(20, 4, rope=True)
    with pytest.raises(ValueError, match="rope was built for head dim 4"):
        az.MultiHeadAttention(32, 4, rope=az.RotaryEmbedding(4))
    with pytest.raises(TypeError, match="num_kv_heads"):
        az.MultiQueryAttention(32, 4, num_kv_heads=2)
    with pytest.raises(TypeError, match="window must be an int"):
        az.SlidingWindowAttention(32, 4, window=(2, 0))
    with pytest.raises(ValueError, match="backend"):
        az.MultiHeadAttention(32, 4, backend="fast")
    with pytest.raises(ValueError, match="dropout"):
        az.MultiHeadAttention(32, 4, dropout=1.0)
    with pytest.raises(ValueError, match="cross-attention module"):
        az.MultiHeadAttention(32, 4, kv_dim=16, causal=True)
    with pytest.raises(TypeError, match="num_heads must be an int"):
        az.MultiHeadAttention(32, 4.0)


def test_bad_forward_inputs() -> None:
    m = az.MultiHeadAttention(DIM, HEADS, causal=True)
    with pytest.raises(ValueError, match=r"C = dim = 32.*\(2, 5, 16\)"):
        m(torch.randn(2, 5, 16))
    with pytest.raises(TypeError, match="x must be a tensor"):
        m([[1.0]])
    with pytest.raises(ValueError, match="positions"):
        m(torch.randn(2, 5, DIM), positions=torch.arange(4))
    cross = az.MultiHeadAttention(DIM, HEADS, kv_dim=24)
    with pytest.raises(ValueError, match=r"context must have shape \[B, M, kv_dim\] = \[2, M, 24\].*\(2, 7, 16\)"):
        cross(torch.randn(2, 5, DIM), torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match="pass context"):
        cross(torch.randn(2, 5, DIM))
    with pytest.raises(ValueError, match=r"does not take|not supported"):
        m(torch.randn(2, 5, DIM), torch.randn(2, 3, DIM))


def test_bad_cache_use() -> None:
    m = az.MultiHeadAttention(DIM, HEADS, num_kv_heads=2, causal=True)
    cache = m.init_cache(2, 6)
    with pytest.raises(ValueError, match=r"built for batch size 2.*batch size 3"):
        m(torch.randn(3, 1, DIM), cache=cache)
    m(torch.randn(2, 4, DIM), cache=cache)
    with pytest.raises(ValueError, match="max_len=6"):
        m(torch.randn(2, 3, DIM), cache=cache)
    with pytest.raises(ValueError, match="causal=True"):
        az.MultiHeadAttention(DIM, HEADS)(torch.randn(2, 1, DIM), cache=cache)
    with pytest.raises(TypeError, match="KVCache"):
        m(torch.randn(2, 1, DIM), cache={"k": None})
    s = az.SlidingWindowAttention(DIM, HEADS, window=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="window=3"):
        s(torch.randn(1, 1, DIM), cache=az.SlidingWindowKVCache(1, 3, 2, DIM // HEADS))
    sc = s.init_cache(1, 10)
    with pytest.raises(ValueError, match=r"cache.length"):
        s(torch.randn(1, 2, DIM), cache=sc, mask=torch.ones(1, 1, 2, 5, dtype=torch.bool))


def test_registry_builds_these_modules() -> None:
    from attnzoo.variants import build_attention

    for name, cls in [("mha", az.MultiHeadAttention), ("mqa", az.MultiQueryAttention),
                      ("gqa", az.GroupedQueryAttention), ("sliding", az.SlidingWindowAttention),
                      ("local_global", az.LocalGlobalAttention)]:
        m = build_attention(name, DIM, HEADS)
        assert isinstance(m, cls) and isinstance(m, MultiHeadAttention)
        assert m(torch.randn(1, 5, DIM)).shape == (1, 5, DIM)


def test_docs_modules_examples_run() -> None:
    """Every python block of docs/modules.md runs as written."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "modules.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5
    for i, code in enumerate(blocks):
        torch.manual_seed(i)
        exec(compile(code, f"docs/modules.md[block {i}]", "exec"), {})


# ----------------------------------------------------------------------------- a failed call changes nothing
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bad", ["mask_shape", "mask_dtype", "backend"])
def test_failed_call_leaves_the_cache_exactly_as_it_was(variant: str, bad: str) -> None:
    """Issue 14, defect 1: decode 5 tokens, make a call that raises, then keep decoding: the cache
    (length, buffers, ring slots) is unchanged and later outputs still equal the full forward."""
    torch.manual_seed(11)
    m = build(variant, rope=True).eval()
    x = torch.randn(2, 9, DIM)
    with torch.no_grad():
        full = m(x)
        cache = m.init_cache(2, 9)
        outs = [m(x[:, :5], cache=cache)]
        # what the cache holds: a KVCache its first `length` slots (later slots are unused), a ring all
        before = {n: t.clone() for n, t in _held(cache).items()}
        call = {"mask_shape": dict(mask=torch.ones(2, 1, 1, 3, dtype=torch.bool)),
                "mask_dtype": dict(mask=torch.ones(2, 1, 1, 6, dtype=torch.int64)),
                "backend": dict(return_weights=True)}[bad]
        if bad == "backend":
            m.backend = "sdpa"  # sdpa cannot return weights: the core raises after the keys were written
        with pytest.raises((ValueError, TypeError)):
            m(x[:, 5:6], cache=cache, **call)
        m.backend = "auto"
        assert cache.length == 5, f"{variant}/{bad}: length moved to {cache.length}"
        for n, t in _held(cache).items():
            assert torch.equal(before[n], t), f"{variant}/{bad}: cache.{n} changed"
        outs += [m(x[:, i:i + 1], cache=cache) for i in range(5, 9)]
    assert max_err(torch.cat(outs, dim=1), full) < 1e-5


def _held(cache) -> dict[str, torch.Tensor]:
    if isinstance(cache, az.KVCache):
        return {"k": cache.k[:, :, :cache.length], "v": cache.v[:, :, :cache.length]}
    return {"k": cache.k, "v": cache.v, "slot_positions": cache.slot_positions}


# ----------------------------------------------------------------------------- issue 14: module inputs
ALL_MODULES = [
    lambda: az.MultiHeadAttention(DIM, HEADS, causal=True, rope=True, parts=AttentionParts(scores=Scores(alibi=True))),
    lambda: az.MultiHeadAttention(DIM, HEADS, kv_dim=24),
    lambda: az.GroupedQueryAttention(DIM, HEADS, num_kv_heads=2, causal=True),
    lambda: az.MultiQueryAttention(DIM, HEADS, causal=True),
    lambda: az.SlidingWindowAttention(DIM, HEADS, window=3),
    lambda: az.LocalGlobalAttention(DIM, HEADS, window=2, global_tokens=(0, 5), causal=True),
    lambda: az.LinearAttention(DIM, HEADS, causal=True),
    lambda: az.PerformerAttention(DIM, HEADS, num_features=16, seed=0),
    lambda: az.InfiniAttention(DIM, HEADS, segment_len=4),
]


@pytest.mark.parametrize("make", ALL_MODULES)
def test_every_module_pickles_and_deep_copies(make) -> None:
    import copy
    import pickle

    torch.manual_seed(0)
    m = make().eval()
    x = torch.randn(1, 6, DIM)
    args = (x, torch.randn(1, 3, 24)) if getattr(m, "kv_dim", None) else (x,)
    with torch.no_grad():
        want = m(*args)
        for twin in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
            assert torch.equal(twin(*args), want), type(m).__name__


@pytest.mark.parametrize("make", ALL_MODULES)
def test_integer_x_is_a_type_error_naming_x(make) -> None:
    with pytest.raises(TypeError, match=r"\bx must be a floating-point tensor"):
        make()(torch.ones(1, 4, DIM, dtype=torch.int64))


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -1.0, 0.0])
def test_bad_scale_rejected_at_construction(scale) -> None:
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        Scores(scale=scale)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        build_attention("mha", 64, 4, scale=scale)
    with pytest.raises(TypeError, match="scale must be a float"):
        Scores(scale="1")


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        az.MultiHeadAttention(64, 4, windw=3)


def test_attend_seam_is_the_only_way_to_the_core() -> None:
    """Swapping ``attend_fn`` (what context parallelism does) changes every softmax call; the
    default is attnzoo.attention and receives exactly its keywords."""
    import inspect

    keywords = set(inspect.signature(az.attention).parameters) - {"q", "k", "v"}
    torch.manual_seed(1)
    for variant in VARIANTS:
        m = build(variant, alibi=True).eval()
        assert m.attend_fn is az.attention
        seen: list[set[str]] = []

        def spy(q, k, v, seen=seen, **kw):
            seen.append(set(kw))
            return az.attention(q, k, v, **kw)

        x = torch.randn(1, 7, DIM)
        with torch.no_grad():
            want = m(x)
            m.attend_fn = spy
            cache = m.init_cache(1, 7)
            got = torch.cat([m(x[:, :4]), m(x[:, :4], cache=cache)[:, :0], m(x[:, 4:], cache=cache)], dim=1)
        assert len(seen) == 3 and all(s <= keywords for s in seen), (variant, seen)
        assert max_err(got[:, 4:], want[:, 4:]) < 1e-5 and max_err(got[:, :4], want[:, :4]) < 1e-5


def test_sliding_cache_with_a_mask_over_absolute_keys() -> None:
    """The sliding cache hands back only the keys it holds; a user mask over every written key
    (a tensor, or a Mask that is not a function of q - k) is sliced / shifted to them."""
    torch.manual_seed(5)
    m = build("sliding", alibi=True).eval()
    x = torch.randn(2, 10, DIM)
    keep = torch.rand(2, 10) > 0.3
    keep[:, 0] = True
    first = az.masks.Mask(lambda b, h, q, k: (k != 7) | (q != 9), "hide key 7 from query 9")
    with torch.no_grad():
        for full_mask, mask_at in ((keep[:, None, None, :], lambda n: keep[:, None, None, :n]),
                                   (first, lambda n: first)):
            full = m(x, mask=full_mask)
            cache = m.init_cache(2, 10)
            out = torch.cat([m(x[:, :4], cache=cache, mask=mask_at(4))]
                            + [m(x[:, i:i + 1], cache=cache, mask=mask_at(i + 1)) for i in range(4, 10)], dim=1)
            assert max_err(out, full) < 1e-5
