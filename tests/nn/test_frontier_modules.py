"""Softmax-frontier modules (issue 15): learnable sinks, StreamingLLM, differential attention,
QK-norm / output gates / sigmoid scores, packed sequences. Every item against a float64 reference
written from its definition, forward and backward, and cached decoding == the full forward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnzoo as az
from attnzoo.nn.attention import build_softmax
from attnzoo.nn.differential import DifferentialAttention, lambda_init
from attnzoo.nn.parts import AttentionParts, OutputGate, Scores, qk_rmsnorm, sink_logits
from attnzoo.variants import VARIANTS, build_attention

DT = torch.float64


# --------------------------------------------------------------------------- float64 references
def rope_ref(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Half-split RoPE (LLaMA): ``x [B, h, N, D]`` rotated at ``pos [N]``."""
    D = x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=DT) / D)  # [D/2]
    ang = pos.to(DT)[:, None] * inv[None]  # [N, D/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def softmax_ref(q, k, v, allowed, scale=None, sinks=None, softcap=None):
    """``q [B, H, N, D]``, ``k, v [B, Hkv, M, D]``, ``allowed`` bool broadcastable to ``[B, H, N, M]``;
    scores capped ``c * tanh(s / c)`` with ``softcap``; a sink logit per head joins each row's
    softmax and is dropped; empty rows give zeros."""
    H = q.shape[1]
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    s = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.view(1, H, 1, 1).expand(*s.shape[:3], 1)), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p[..., : v.shape[2]] @ v


def rms_ref(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def mha_ref(m, x, allowed, pos=None):
    """The float64 forward of a :class:`MultiHeadAttention` from its weights and options."""
    B, N, _ = x.shape
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    wq, wk, wv = m.qkv_weights()
    bq, bk, bv = m.qkv_biases() or (None, None, None)

    def heads(t, h):
        return t.view(B, N, h, D).transpose(1, 2)

    q, k, v = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)  # [B, N, h*D]
    fr = m.frontier
    qk_norm = None if fr.q_norm is None else "all" if fr.q_norm.over_heads else "head"
    eps = None if fr.q_norm is None else fr.q_norm.eps
    if qk_norm == "all":  # OLMo2: over all heads of a token
        q, k = rms_ref(q, fr.q_norm_weight, eps), rms_ref(k, fr.k_norm_weight, eps)
    q, k, v = heads(q, H), heads(k, Hkv), heads(v, Hkv)
    if qk_norm == "head":  # Qwen3 / Gemma3: per head
        q, k = rms_ref(q, fr.q_norm_weight, eps), rms_ref(k, fr.k_norm_weight, eps)
    if m.rope is not None:
        p = torch.arange(N) if pos is None else pos
        q, k = rope_ref(q, p), rope_ref(k, p)
    if isinstance(m, az.SigmoidAttention):
        H_ = q.shape[1]
        kk, vv = k.repeat_interleave(H_ // Hkv, 1), v.repeat_interleave(H_ // Hkv, 1)
        w = torch.sigmoid(q @ kk.transpose(-1, -2) / math.sqrt(D) + m.sigmoid_bias) * allowed
        out = w @ vv
    else:
        out = softmax_ref(q, k, v, allowed, m.scale, m.sinks, m.scores.softcap)  # [B, H, N, D]
    if fr.gate_proj is not None:
        g = torch.sigmoid(F.linear(x, fr.gate_proj.weight))  # [B, N, H] or [B, N, H*D]
        out = out * g.view(B, N, H, -1).transpose(1, 2)
    return m.out_proj(out.transpose(1, 2).reshape(B, N, H * D))


def causal_allowed(n, window=None):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    ok = j <= i
    return ok & (i - j <= window) if window is not None else ok


def decode(m, x, chunk, **kw):
    cache = m.init_cache(x.shape[0], x.shape[1], **kw)
    return torch.cat([m(x[:, s:s + chunk], cache=cache) for s in range(0, x.shape[1], chunk)], dim=1), cache


def grads(loss, params):
    return torch.autograd.grad(loss, params, retain_graph=True)


def matches_reference(m, x):
    """Causal forward and every parameter's gradient of ``m`` on ``x`` equal :func:`mha_ref`'s; returns the output."""
    out, ref = m(x), mha_ref(m, x, causal_allowed(x.shape[1]))
    torch.testing.assert_close(out, ref)
    params = list(m.parameters())
    for a, b in zip(grads(out.sum(), params), grads(ref.sum(), params), strict=True):
        torch.testing.assert_close(a, b)
    return out


def _randomise(m):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


# --------------------------------------------------------------------------- 1. learnable sinks
@pytest.mark.parametrize(("kind", "kw"), [("mha", {}), ("gqa", {"num_kv_heads": 2}), ("sliding", {"window": 3})])
def test_sinks_forward_backward_match_reference(kind, kw) -> None:
    torch.manual_seed(0)
    m = _randomise(build_attention(kind, 16, 4, rope=True, sinks=True, **kw).to(DT))
    assert m.sinks is not None and m.sinks.shape == (4,)
    x = torch.randn(2, 9, 16, dtype=DT)
    allowed = causal_allowed(9, kw.get("window"))
    out, ref = m(x), mha_ref(m, x, allowed)
    torch.testing.assert_close(out, ref)
    params = list(m.parameters())
    for a, b in zip(grads(out.square().sum(), params), grads(ref.square().sum(), params), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk", [1, 4])
def test_sinks_decode_equals_full(chunk) -> None:
    torch.manual_seed(0)
    m = _randomise(build_softmax(az.GroupedQueryAttention, 16, 4, num_kv_heads=2, causal=True, rope=True,
                                 sinks=True)).eval()
    x = torch.randn(2, 13, 16)
    with torch.no_grad():
        torch.testing.assert_close(decode(m, x, chunk)[0], m(x), atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- 4. qk_norm, output_gate, score
@pytest.mark.parametrize("qk_norm", ["head", "all"])
@pytest.mark.parametrize("gate", [None, "head", "element"])
def test_qk_norm_and_output_gate_match_reference(qk_norm, gate) -> None:
    torch.manual_seed(0)
    m = _randomise(build_softmax(az.MultiHeadAttention, 16, 4, num_kv_heads=2, causal=True, rope=True,
                                 qk_norm=qk_norm, output_gate=gate).to(DT))
    matches_reference(m, torch.randn(2, 7, 16, dtype=DT))
    want = {"head": (4,), "all": (16,)}[qk_norm]  # Qwen3: [D]; OLMo2: [H*D]
    assert m.frontier.q_norm_weight.shape == want


@pytest.mark.parametrize("qk_norm", ["head", "all"])
def test_qk_norm_eps_and_softcap_match_reference_and_decode(qk_norm) -> None:
    torch.manual_seed(0)
    m = _randomise(build_softmax(az.MultiHeadAttention, 16, 4, num_kv_heads=2, causal=True, rope=True,
                                 qk_norm=qk_norm, qk_norm_eps=0.5, softcap=0.7, sinks=True).to(DT))
    assert m.frontier.q_norm.eps == 0.5 and "softcap=0.7" in repr(m)
    x = torch.randn(2, 7, 16, dtype=DT)
    out = matches_reference(m, x)
    with torch.no_grad():
        torch.testing.assert_close(decode(m, x, 3)[0], out)
    plain = build_softmax(az.MultiHeadAttention, 16, 4, num_kv_heads=2, causal=True, rope=True, qk_norm=qk_norm,
                          sinks=True).to(DT)
    plain.load_state_dict(m.state_dict())
    assert not torch.allclose(plain(x), out)  # the eps and the cap both matter at these sizes


def test_qk_norm_all_differs_from_head() -> None:
    torch.manual_seed(0)
    a = build_softmax(az.MultiHeadAttention, 16, 4, causal=True, qk_norm="head").to(DT)
    b = build_softmax(az.MultiHeadAttention, 16, 4, causal=True, qk_norm="all").to(DT)
    b.load_state_dict({k: v for k, v in a.state_dict().items() if "norm" not in k}, strict=False)
    x = torch.randn(1, 5, 16, dtype=DT)
    assert not torch.allclose(a(x), b(x))


def test_sigmoid_score_matches_reference_and_decodes() -> None:
    torch.manual_seed(0)
    m = _randomise(build_softmax(az.SigmoidAttention, 16, 4, causal=True, rope=True, sigmoid_bias=-1.5,
                                 qk_norm="head").to(DT))
    x = torch.randn(2, 8, 16, dtype=DT)
    out, ref = m(x), mha_ref(m, x, causal_allowed(8))
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads(out.sum(), list(m.parameters())), grads(ref.sum(), list(m.parameters())), strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(decode(m, x, 3)[0], m(x))
    free = az.SigmoidAttention(16, 4, causal=True)  # bias -log(Nk) of each call
    with pytest.raises(ValueError, match="sigmoid_bias"):
        free(x.float()[:, :1], cache=free.init_cache(2, 8))


def test_all_options_together_decode_equals_full() -> None:
    torch.manual_seed(0)
    m = _randomise(build_softmax(az.SlidingWindowAttention, 24, 6, window=4, num_kv_heads=2, rope=True, sinks=True,
                                 qk_norm="all", output_gate="element")).eval()
    x = torch.randn(2, 17, 24)
    with torch.no_grad():
        full = m(x)
        for chunk in (1, 5):
            torch.testing.assert_close(decode(m, x, chunk)[0], full, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("kw", "exc", "words"),
    [({"qk_norm": "layer"}, ValueError, "qk_norm"), ({"output_gate": True}, ValueError, "output_gate"),
     ({"score": "relu"}, ValueError, "score"), ({"sinks": 1}, TypeError, "sinks"),
     ({"score": "sigmoid", "sinks": True}, ValueError, "sigmoid"),
     ({"sigmoid_bias": -1.0}, TypeError, "sigmoid_bias"),
     ({"score": "sigmoid", "sigmoid_bias": float("nan")}, ValueError, "sigmoid_bias"),
     ({"score": "sigmoid", "backend": "sdpa"}, ValueError, "backend"), ({"qk_norms": "head"}, TypeError, "qk_norms"),
     ({"qk_norm_eps": 1e-5}, ValueError, "qk_norm_eps"), ({"qk_norm": "head", "qk_norm_eps": 0.0}, ValueError,
                                                          "qk_norm_eps"),
     ({"softcap": 0.0}, ValueError, "softcap"), ({"softcap": float("inf")}, ValueError, "softcap")],
)
def test_bad_options(kw, exc, words) -> None:
    """The builders' keyword settings (what attention_kwargs dicts carry) are checked by name."""
    with pytest.raises(exc, match=words):
        build_attention("mha", 16, 4, causal=True, **kw)


# --------------------------------------------------------------------------- 2. StreamingLLM
def streaming_allowed(n_q, n, w):
    m = az.masks.causal() & (az.masks.sliding_window(w, 0) | az.masks.global_tokens(list(range(n))))
    return m.materialize(1, 1, n_q, n_q)[0, 0]


def streaming_cache_ref(m, x):
    """The StreamingLLM paper's convention, literally: for each query ``p`` the cache holds
    ``S(p)`` (sinks + window) in order, keys rotated at their slot, the query at the last slot."""
    B, N, _ = x.shape
    n, w, H, Hkv, D = m.sink_tokens, m.window_size, m.num_heads, m.num_kv_heads, m.head_dim
    wq, wk, wv = m.qkv_weights()
    bq, bk, bv = m.qkv_biases()
    q = F.linear(x, wq, bq).view(B, N, H, D).transpose(1, 2)
    k = F.linear(x, wk, bk).view(B, N, Hkv, D).transpose(1, 2)
    v = F.linear(x, wv, bv).view(B, N, Hkv, D).transpose(1, 2)
    rows = []
    for p in range(N):
        held = [j for j in range(p + 1) if j < n or p - j <= w]
        idx = torch.tensor(held)
        slots = torch.arange(len(held))
        kr = rope_ref(k[:, :, idx], slots)
        qr = rope_ref(q[:, :, p:p + 1], slots[-1:])
        allowed = torch.ones(1, len(held), dtype=torch.bool)
        rows.append(softmax_ref(qr, kr, v[:, :, idx], allowed, None, m.sinks))
    out = torch.cat(rows, dim=2)  # [B, H, N, D]
    return m.out_proj(out.transpose(1, 2).reshape(B, N, H * D))


@pytest.mark.parametrize(("sinks", "softcap"), [(False, None), (True, None), (True, 0.8)])
def test_streaming_absolute_matches_the_mask_reference(sinks, softcap) -> None:
    torch.manual_seed(0)
    m = _randomise(build_softmax(az.SlidingWindowAttention, 16, 4, window=5, sink_tokens=3, num_kv_heads=2,
                                 rope=True, sinks=sinks, softcap=softcap).to(DT))
    x = torch.randn(2, 30, 16, dtype=DT)
    out, ref = m(x), mha_ref(m, x, streaming_allowed(30, 3, 5))
    torch.testing.assert_close(out, ref)
    ps = list(m.parameters())
    for a, b in zip(grads(out.sum(), ps), grads(ref.sum(), ps), strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # the cached path attends in two parts (sinks, window): the cap reaches both
        torch.testing.assert_close(decode(m, x, 4)[0], out)


@pytest.mark.parametrize("sinks", [False, True])
def test_streaming_cache_convention_matches_the_literal_reference(sinks) -> None:
    torch.manual_seed(0)
    m = _randomise(build_softmax(az.SlidingWindowAttention, 16, 4, window=5, sink_tokens=3, num_kv_heads=2,
                                 rope=True, sinks=sinks, position_mode="cache").to(DT))
    x = torch.randn(2, 30, 16, dtype=DT)
    out, ref = m(x), streaming_cache_ref(m, x)
    torch.testing.assert_close(out, ref)
    ps = list(m.parameters())
    for a, b in zip(grads(out.sum(), ps), grads(ref.sum(), ps), strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # the cached steps are the paper's re-rotation; chunks use the merged form
        torch.testing.assert_close(decode(m, x, 1)[0], ref)
        torch.testing.assert_close(decode(m, x, 7)[0], ref)
    absolute = build_softmax(az.SlidingWindowAttention, 16, 4, window=5, sink_tokens=3, num_kv_heads=2, rope=True,
                             sinks=sinks).to(DT)
    absolute.load_state_dict(m.state_dict())
    same = absolute(x)
    torch.testing.assert_close(same[:, :9], out[:, :9])  # nothing evicted yet: the conventions agree
    assert not torch.allclose(same[:, 9:], out[:, 9:])  # then the sinks sit at different distances


@pytest.mark.parametrize("mode", ["absolute", "cache"])
def test_streaming_decode_equals_full_over_2000_tokens(mode) -> None:
    torch.manual_seed(0)
    n, w, N = 4, 24, 2100
    m = build_softmax(az.SlidingWindowAttention, 8, 2, window=w, sink_tokens=n, rope=True, position_mode=mode,
                      sinks=True).to(DT)
    m = _randomise(m).eval()
    x = torch.randn(1, N, 8, dtype=DT)
    with torch.no_grad():
        full = m(x)
        cache = m.init_cache(1, N)
        assert isinstance(cache, az.SinkWindowKVCache) and cache.k.shape[2] == n + w
        outs = []
        for t in range(N):
            outs.append(m(x[:, t:t + 1], cache=cache))
            assert cache.num_cached <= n + w
        torch.testing.assert_close(torch.cat(outs, 1), full)
        torch.testing.assert_close(decode(m, x, 97)[0], full)
    if mode == "absolute":  # == the pattern of the issue under absolute positions
        ref = az.attention(*(t for t in _qkv_abs(m, x)), mask=az.masks.causal() & (
            az.masks.sliding_window(w, 0) | az.masks.global_tokens(range(n))), sinks=m.sinks, backend="tiled")
        torch.testing.assert_close(full, m.out_proj(ref.transpose(1, 2).reshape(1, N, -1)))


def _qkv_abs(m, x):
    q, k, v = m.project_qkv(x)
    pos = torch.arange(x.shape[1])
    return rope_ref(q, pos), rope_ref(k, pos), v


def test_sink_window_cache_holds_sinks_and_ring_and_rolls_back() -> None:
    c = az.SinkWindowKVCache(1, 2, 3, 1, 1)
    assert c.capacity == 5  # n + w: the query's own key comes with the call
    k = torch.arange(10.0).view(1, 1, 10, 1)
    _, _, pos = c.update(k[:, :, :7], k[:, :, :7])
    assert pos.tolist() == list(range(7))  # a chunk gets everything it may need
    assert c.held_positions().tolist() == [0, 1, 4, 5, 6]
    _, kk, pos = c.update(k[:, :, 7:8], k[:, :, 7:8])
    assert pos.tolist() == [0, 1, 4, 5, 6, 7] and kk.flatten().tolist() == [0, 1, 4, 5, 6, 7]
    mark = c.mark()
    c.update(k[:, :, 8:9], k[:, :, 8:9])
    c.rollback(mark)
    assert c.length == 8 and c.held_positions().tolist() == [0, 1, 5, 6, 7]
    assert c.update(k[:, :, 8:9], k[:, :, 8:9])[0].flatten().tolist() == [0, 1, 5, 6, 7, 8]


def test_streaming_spec_bounds_the_cache() -> None:
    spec = VARIANTS["streaming"]
    est = az.cost.estimate("streaming", 10**6, 64, 4, window=32, global_tokens=(0, 1, 2, 3))
    assert est.kv_cache_max_tokens == 4 + 32
    assert est.kv_cache_bytes == 36 * est.kv_cache_bytes_per_token
    m = build_attention("streaming", 32, 4, **spec.check)
    assert m.sink_tokens == 2 and m.window_size == 4
    with pytest.raises(ValueError, match="global_tokens"):
        build_attention("streaming", 32, 4, global_tokens=(0, 5))


@pytest.mark.parametrize(
    ("kw", "exc", "words"),
    [({"sink_tokens": -1}, ValueError, "sink_tokens"), ({"sink_tokens": 1.5}, TypeError, "sink_tokens"),
     ({"sink_tokens": 2, "causal": False}, ValueError, "causal"),
     ({"sink_tokens": 2, "position_mode": "relative"}, ValueError, "position_mode"),
     ({"position_mode": "cache"}, TypeError, "position_mode"),  # sink_tokens=0: a plain sliding window
     ({"sink_tokens": 2, "parts": AttentionParts(scores=Scores(alibi=True))}, ValueError, "alibi")],
)
def test_streaming_bad_input(kw, exc, words) -> None:
    with pytest.raises(exc, match=words):
        az.SlidingWindowAttention(16, 4, window=3, **kw)


def test_streaming_wrong_cache_and_unsupported_calls() -> None:
    m = az.SlidingWindowAttention(16, 4, window=3, sink_tokens=2, position_mode="cache", rope=True)
    x = torch.randn(1, 4, 16)
    with pytest.raises(TypeError, match="SinkWindowKVCache"):
        m(x, cache=az.KVCache(1, 8, 4, 4))
    with pytest.raises(ValueError, match="positions"):
        m(x, positions=torch.arange(4))
    plain = az.SlidingWindowAttention(16, 4, window=3)
    with pytest.raises(TypeError, match="sink_tokens=0"):
        plain(x, cache=m.init_cache(1, 8))
    cache = m.init_cache(1, 8)
    with pytest.raises(ValueError, match="mask"):
        m(x, cache=cache, mask=torch.ones(5, 9, dtype=torch.bool))
    assert cache.length == 0


# --------------------------------------------------------------------------- 3. differential attention
def diff_ref(m, x):
    """DIFF Transformer (Ye et al., 2024) from the paper, per head, float64."""
    B, N, _ = x.shape
    H, Hkv, d = m.diff_heads, m.diff_kv_heads, m.head_dim
    q = F.linear(x, m.q_proj.weight).view(B, N, H, 2, d)
    k = F.linear(x, m.k_proj.weight).view(B, N, Hkv, 2, d)
    v = F.linear(x, m.v_proj.weight).view(B, N, Hkv, 2 * d)
    pos = torch.arange(N)
    lam = (torch.exp((m.lambda_q1 * m.lambda_k1).sum()) - torch.exp((m.lambda_q2 * m.lambda_k2).sum())
           + m.lambda_init)
    mask = causal_allowed(N)
    heads = []
    for h in range(H):
        g = h // (H // Hkv)
        maps = []
        for i in range(2):
            qi = q[:, :, h, i].unsqueeze(1)  # [B, 1, N, d]
            ki = k[:, :, g, i].unsqueeze(1)
            if m.rope is not None:
                qi, ki = rope_ref(qi, pos), rope_ref(ki, pos)
            s = (qi @ ki.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float("-inf"))
            maps.append(torch.softmax(s, dim=-1)[:, 0])  # [B, N, N]
        o = (maps[0] - lam * maps[1]) @ v[:, :, g]  # [B, N, 2d]
        heads.append((1 - m.lambda_init) * rms_ref(o, m.subln_weight, 1e-5))
    return m.out_proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_differential_matches_the_paper(kv) -> None:
    torch.manual_seed(0)
    m = _randomise(DifferentialAttention(32, 4, num_kv_heads=kv, layer_index=3, rope=True).to(DT))
    x = torch.randn(2, 11, 32, dtype=DT)
    out, ref = m(x), diff_ref(m, x)
    torch.testing.assert_close(out, ref)
    ps = [m.lambda_q1, m.lambda_k2, m.subln_weight, m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]
    for a, b in zip(grads(out.square().sum(), ps), grads(ref.square().sum(), ps), strict=True):
        torch.testing.assert_close(a, b)


def test_differential_lambda_init_and_shapes() -> None:
    assert lambda_init(0) == pytest.approx(0.2)
    assert lambda_init(5) == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * 5))
    m = az.DifferentialAttention(64, 4, num_kv_heads=2)
    assert m.head_dim == 8 and m.q_proj.weight.shape == (64, 64) and m.v_proj.weight.shape == (32, 64)
    assert m.lambda_init == pytest.approx(0.2)
    assert "diff" in VARIANTS and VARIANTS["diff"].exact


@pytest.mark.parametrize("chunk", [1, 4])
def test_differential_decode_equals_full(chunk) -> None:
    torch.manual_seed(0)
    m = _randomise(az.DifferentialAttention(32, 4, num_kv_heads=2, rope=True, layer_index=1)).eval()
    x = torch.randn(2, 13, 32)
    with torch.no_grad():
        torch.testing.assert_close(decode(m, x, chunk)[0], m(x), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("args", "kw", "exc", "words"),
    [((30, 4), {}, ValueError, "2 \\* num_heads"), ((32, 4), {"num_kv_heads": 3}, ValueError, "divisible"),
     ((32, 4), {"layer_index": -1}, ValueError, "layer_index"), ((32, 4), {"window": 3}, TypeError, "window")],
)
def test_differential_bad_input(args, kw, exc, words) -> None:
    with pytest.raises(exc, match=words):
        az.DifferentialAttention(*args, **kw)
    m = az.DifferentialAttention(32, 4, causal=False)
    with pytest.raises(ValueError, match="causal"):
        m(torch.randn(1, 2, 32), cache=m.init_cache(1, 4))
    with pytest.raises(ValueError, match="return_weights"):
        m(torch.randn(1, 2, 32), return_weights=True)


# --------------------------------------------------------------------------- 5. packed sequences
def _norms(mode, H, Hkv, D, eps=1e-6):
    q_norm, k_norm = qk_rmsnorm(mode, H, Hkv, D, eps)
    return {"q_norm": q_norm, "k_norm": k_norm}


PACKED = [
    ("mha", lambda: az.MultiHeadAttention(16, 4, causal=True, rope=True, parts=AttentionParts(
        sinks=sink_logits(4), output_gate=OutputGate(16, 4, 4, "head"), **_norms("head", 4, 4, 4)))),
    ("gqa", lambda: az.GroupedQueryAttention(16, 4, 2, causal=True, rope=True)),
    ("softcap", lambda: az.GroupedQueryAttention(16, 4, 2, causal=True, rope=True, parts=AttentionParts(
        scores=Scores(softcap=0.8), **_norms("all", 4, 2, 4, eps=0.3)))),
    ("bidirectional", lambda: az.MultiHeadAttention(16, 4, rope=True, parts=AttentionParts(scores=Scores(alibi=True)))),
    ("sliding", lambda: az.SlidingWindowAttention(16, 4, window=2, rope=True)),
    ("diff", lambda: az.DifferentialAttention(16, 2, num_kv_heads=1, rope=True)),
]


@pytest.mark.parametrize(("name", "make"), PACKED)
def test_packed_equals_each_sequence_alone(name, make) -> None:
    torch.manual_seed(0)
    m = _randomise(make().to(DT))
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    x = torch.randn(1, 14, 16, dtype=DT)
    packed = m(x, cu_seqlens=cu)
    alone = torch.cat([m(x[:, a:b]) for a, b in ((0, 5), (5, 6), (6, 14))], dim=1)
    torch.testing.assert_close(packed, alone)
    ps = [p for p in m.parameters() if p.requires_grad]
    for a, b in zip(grads(packed.square().sum(), ps), grads(alone.square().sum(), ps), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("attention", ["gqa", "sliding", "diff"])
def test_decoder_lm_packed_equals_each_document(attention) -> None:
    torch.manual_seed(0)
    cfg = az.models.DecoderConfig(40, 16, 2, 2, attention=attention, max_seq_len=32,
                                  attention_kwargs={"window": 3} if attention == "sliding" else None)
    lm = az.DecoderLM(config=cfg).to(DT)
    tokens = torch.randint(0, 40, (1, 20))
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    packed = lm(tokens, cu_seqlens=cu)
    alone = torch.cat([lm(tokens[:, a:b]) for a, b in ((0, 7), (7, 8), (8, 20))], dim=1)
    torch.testing.assert_close(packed, alone)
    loss = F.cross_entropy(packed[0], tokens[0])
    loss.backward()
    assert lm.tok_emb.weight.grad is not None


@pytest.mark.parametrize(
    ("cu", "x_shape", "kw", "exc", "words"),
    [(torch.tensor([0, 3, 6]), (1, 6, 16), {}, TypeError, "int32"),
     (torch.tensor([0, 3, 5], dtype=torch.int32), (1, 6, 16), {}, ValueError, r"end at 6 \(the number of packed tokens\)"),
     (torch.tensor([0, 4, 3, 6], dtype=torch.int32), (1, 6, 16), {}, ValueError, "non-decreasing"),
     (torch.tensor([0, 3, 6], dtype=torch.int32), (2, 6, 16), {}, ValueError, "batch size 1"),
     (torch.tensor([0, 3, 6], dtype=torch.int32), (1, 6, 16), {"return_weights": True}, ValueError, "return_weights"),
     ([0, 3, 6], (1, 6, 16), {}, TypeError, "cu_seqlens")],
)
def test_packed_bad_input(cu, x_shape, kw, exc, words) -> None:
    m = az.MultiHeadAttention(16, 4, causal=True)
    with pytest.raises(exc, match=words):
        m(torch.randn(*x_shape), cu_seqlens=cu, **kw)


def test_packed_refuses_caches_and_patterns() -> None:
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    x = torch.randn(1, 6, 16)
    m = az.MultiHeadAttention(16, 4, causal=True)
    with pytest.raises(ValueError, match="cache"):
        m(x, cu_seqlens=cu, cache=m.init_cache(1, 6))
    with pytest.raises(ValueError, match="cu_seqlens"):
        az.SlidingWindowAttention(16, 4, window=2, sink_tokens=1)(x, cu_seqlens=cu)
    lm = az.DecoderLM(40, 16, 1, 2, pos="learned", max_seq_len=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        lm(torch.randint(0, 40, (1, 6)), cu_seqlens=torch.tensor([0, 1, 6], dtype=torch.int32))


def test_docs_draw_the_streaming_pattern_and_its_positions() -> None:
    """docs/softmax-frontier.md's StreamingLLM table is the mask, the keys each decoding query reads
    from the cache (held keys + its own) and both conventions."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "softmax-frontier.md").read_text()
    rows = re.findall(r"^query (\d)\s+((?:[1.] ){6}[1.])\s+\[([\d ]+)\]\s+q (\d), k ([\d ]+?)\s+q (\d), k ([\d ]+)$",
                      text, flags=re.M)
    assert len(rows) == 7
    allowed = streaming_allowed(7, 2, 2)
    cache = az.SinkWindowKVCache(1, 2, 2, 1, 1)
    for p, (qs, drawn, held, qa, ka, qc, kc) in enumerate(rows):
        assert int(qs) == p and [c == "1" for c in drawn.split()] == allowed[p].tolist()
        read = cache.update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))[2]
        keys = [int(j) for j in held.split()]
        assert keys == read.tolist() == [j for j in range(7) if allowed[p, j]]
        assert cache.num_cached <= 2 + 2
        assert (int(qa), [int(j) for j in ka.split()]) == (p, keys)
        assert (int(qc), [int(j) for j in kc.split()]) == (min(p, 2 + 2), list(range(len(keys))))


@pytest.mark.parametrize("mode", ["absolute", "cache"])
@pytest.mark.parametrize("kind", ["bool", "float", "Mask"])
def test_streaming_user_masks_decode_equals_full(mode, kind) -> None:
    """A user mask over absolute keys reaches the held keys (columns gathered / Mask evaluated)."""
    torch.manual_seed(0)
    m = _randomise(az.SlidingWindowAttention(16, 4, window=3, sink_tokens=2, rope=True, position_mode=mode)).eval()
    N = 20
    x = torch.randn(2, N, 16)
    keep = torch.rand(2, N) > 0.25
    keep[:, 0] = True
    if kind == "Mask":
        mask = az.masks.key_padding(keep)
    elif kind == "bool":
        mask = keep[:, None, None, :]
    else:
        mask = torch.where(keep, 0.0, -0.7)[:, None, None, :]
    with torch.no_grad():
        full = m(x, mask=mask)
        for chunk in (1, 6):
            cache, outs = m.init_cache(2, N), []
            for s in range(0, N, chunk):
                e = min(N, s + chunk)
                outs.append(m(x[:, s:e], cache=cache, mask=mask if kind == "Mask" else mask[..., :e]))
            torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-6, rtol=1e-5)


def test_streaming_is_its_own_class() -> None:
    """StreamingLLM is a class of its own (the `streaming` variant builds it); the pinned call
    SlidingWindowAttention(..., sink_tokens=n) returns one, and it survives pickling and copying."""
    import copy
    import pickle

    m = az.SlidingWindowAttention(16, 4, window=3, sink_tokens=2)
    assert type(m) is az.StreamingAttention and isinstance(m, az.SlidingWindowAttention)
    assert type(az.SlidingWindowAttention(16, 4, window=3)) is az.SlidingWindowAttention
    assert type(az.variants.build_attention("streaming", 16, 4)) is az.StreamingAttention
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(clone) is az.StreamingAttention and clone.sink_tokens == 2
        x = torch.randn(1, 7, 16)
        torch.testing.assert_close(clone(x), m(x))
    with pytest.raises(ValueError, match="sink_tokens must be >= 1"):
        az.StreamingAttention(16, 4, window=3, sink_tokens=0)


def test_sigmoid_is_its_own_class() -> None:
    """SigmoidAttention carries the sigmoid score (the `sigmoid` variant; build_attention("mha", score="sigmoid")
    builds one), and the softmax classes take no score keyword (a TypeError, not an ignored setting)."""
    m = az.SigmoidAttention(16, 4, causal=True, sigmoid_bias=-1.0)
    assert type(build_attention("mha", 16, 4, score="sigmoid", sigmoid_bias=-1.0)) is az.SigmoidAttention
    assert type(m) is az.SigmoidAttention
    assert type(az.variants.build_attention("sigmoid", 16, 4)) is az.SigmoidAttention
    x = torch.randn(2, 6, 16)
    q, k, v = m.project_qkv(x)
    want = az.sigmoid_attention(q, k, v, bias=-1.0, causal=True)
    torch.testing.assert_close(m(x), m.merge_heads(want))
    for make in (lambda: az.SlidingWindowAttention(16, 4, 3, score="sigmoid"),
                 lambda: az.GroupedQueryAttention(16, 4, 2, score="sigmoid")):
        with pytest.raises(TypeError, match="score"):
            make()
    with pytest.raises(ValueError, match="score"):
        build_attention("sliding", 16, 4, score="sigmoid")  # only MultiHeadAttention's builder turns sigmoid
    with pytest.raises(ValueError, match="fixed sigmoid_bias"):
        free = az.SigmoidAttention(16, 4, causal=True)
        free(x, cache=free.init_cache(2, 6))
