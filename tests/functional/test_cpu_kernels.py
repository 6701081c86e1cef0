"""The CPU fast paths of issue 37 against the PyTorch reference: split-KV decoding, the
local_global decode gather, NSA's block-major selected branch and varlen's split path.

Each test states one equivalence (fast path == reference, forward and backward) and fails with the
shapes and the max error. Tolerances are relative to a float64 reference."""

from __future__ import annotations

import pytest
import torch

import attnzoo as az
import attnzoo.functional.softmax.nsa as nsa_mod
from attnzoo.functional.backends import decode
from attnzoo.functional.core._request import build_request
from attnzoo.functional.softmax.nsa import NSAConfig, nsa_attention
from attnzoo.functional.softmax.varlen_split import split_applies
from attnzoo.nn.nsa import BlockCompressor

F64 = torch.float64


def _qkv(B: int, H: int, Hkv: int, Nq: int, Nk: int, D: int = 16, Dv: int = 12, dtype=F64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g, dtype=F64).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=F64).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Nk, Dv, generator=g, dtype=F64).to(dtype).requires_grad_()
    return q, k, v


def _grads(out: torch.Tensor, lse: torch.Tensor | None, inputs) -> tuple[torch.Tensor, ...]:
    loss = (out.double() ** 2).sum()
    if lse is not None:
        loss = loss + lse.double().masked_fill(~torch.isfinite(lse), 0).sum()
    return torch.autograd.grad(loss, inputs)


# ------------------------------------------------------------------ split-KV decoding
DECODE_CASES = [  # B, H, Hkv, Nq, Nk, causal, window, q_offset, softcap, chunk
    (2, 8, 2, 1, 1000, False, None, None, None, 256),   # GQA 4, one token, 4 chunks (last partial)
    (1, 4, 4, 3, 777, True, (100, 0), None, None, 128),  # MHA, window: only its keys read
    (1, 6, 2, 5, 513, True, None, None, 30.0, 64),       # softcap, causal edge in the last chunk
    (1, 4, 1, 2, 300, True, (10, 0), 50, None, 64),      # MQA, a q_offset inside the cache
    (1, 4, 2, 2, 300, True, (10, 0), -40, None, 64),     # no query sees any key: zeros, LSE -inf
    (1, 2, 1, 1, 1, False, None, None, None, None),      # a cache of one key
    (1, 8, 2, 4, 257, False, (3, 2), 100, None, 256),    # a two-sided window
]


@pytest.mark.parametrize("case", DECODE_CASES)
def test_split_kv_decode_equals_the_reference_float64(case) -> None:
    B, H, Hkv, Nq, Nk, causal, window, q_offset, softcap, chunk = case
    q, k, v = _qkv(B, H, Hkv, Nq, Nk)
    kw = dict(causal=causal, window=window, q_offset=q_offset, softcap=softcap, return_lse=True)
    out, lse = decode.decode_attention(q, k, v, chunk=chunk, **kw)
    ref, ref_lse = az.attention(q, k, v, backend="reference", **kw)
    assert (out - ref).abs().max() < 1e-12, f"{case}: out error {(out - ref).abs().max():.2e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"{case}: empty rows differ"
    fin = torch.isfinite(ref_lse)
    assert (lse - ref_lse).masked_fill(~fin, 0).abs().max() < 1e-12, f"{case}: lse error"
    for name, a, b in zip("qkv", _grads(out, lse, (q, k, v)), _grads(ref, ref_lse, (q, k, v)), strict=True):
        assert (a - b).abs().max() < 1e-11, f"{case}: d{name} error {(a - b).abs().max():.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_decode_low_precision_is_as_good_as_eager(dtype: torch.dtype) -> None:
    """fp32 / bf16 within twice plain eager attention's error in that dtype (float64 reference)."""
    q, k, v = _qkv(2, 8, 2, 2, 2000, D=32, Dv=32, dtype=dtype, seed=3)
    ref = az.attention(*(t.double() for t in (q, k, v)), causal=True, backend="reference")
    out = decode.decode_attention(q, k, v, causal=True, chunk=512)
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)  # plain eager math in dtype
    s = (q @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    eager = torch.softmax(s.masked_fill(~torch.ones(2, 2000, dtype=torch.bool).tril(1998), float("-inf")), -1) @ vv
    err, err_eager = (out.double() - ref).abs().max(), (eager.double() - ref).abs().max()
    assert out.dtype == dtype and err <= 2 * err_eager + 1e-6, f"{dtype}: {err:.2e} vs eager {err_eager:.2e}"
    g = _grads(out, None, (q, k, v))
    g_ref = _grads(ref, None, (q, k, v))
    for name, a, b in zip("qkv", g, g_ref, strict=True):
        rel = (a.double() - b).abs().max() / b.abs().max()
        assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"{dtype}: d{name} relative error {rel:.2e}"


def test_auto_sends_gqa_decoding_to_split_kv_and_mha_to_sdpa() -> None:
    """The measured policy: GQA from MIN_KEYS keys; MHA stays with SDPA; masks never; auto equals
    the reference on the decode path."""
    q, k, v = _qkv(1, 8, 2, 1, decode.MIN_KEYS, dtype=torch.float32)
    r = build_request(q, k, v, mask=None, causal=False, window=None, q_offset=None, scale=None, softcap=None,
                      alibi_slopes=None, dropout_p=0.0, return_lse=False, return_weights=False)
    assert decode.use_split_kv(r, "sdpa")
    short = build_request(q, k[:, :, :64], v[:, :, :64], mask=None, causal=False, window=None, q_offset=None,
                          scale=None, softcap=None, alibi_slopes=None, dropout_p=0.0, return_lse=False,
                          return_weights=False)
    assert not decode.use_split_kv(short, "sdpa")
    mha = build_request(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), mask=None, causal=False,
                        window=None, q_offset=None, scale=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                        return_lse=False, return_weights=False)
    assert not decode.use_split_kv(mha, "sdpa")
    masked = build_request(q, k, v, mask=torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool), causal=False,
                           window=None, q_offset=None, scale=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                           return_lse=False, return_weights=False)
    assert not decode.use_split_kv(masked, "sdpa")
    got = az.attention(q, k, v)
    want = az.attention(*(t.double() for t in (q, k, v)), backend="reference")
    assert (got.double() - want).abs().max() < 1e-5


def test_split_kv_argument_errors() -> None:
    q, k, v = _qkv(1, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="chunk"):
        decode.decode_attention(q, k, v, chunk=0)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        decode.decode_attention(q[:, :3], k, v)


def test_split_kv_non_finite_hidden_key_stays_hidden() -> None:
    """A NaN in a key outside every query's window changes nothing (through auto's guard)."""
    q, k, v = (t.detach().float() for t in _qkv(1, 8, 2, 1, 4096))
    k[:, :, 10] = float("nan")
    out = az.attention(q, k, v, causal=True, window=(100, 0))  # split-KV: window hides half the cache
    ref = az.attention(q.double(), k.double(), v.double(), causal=True, window=(100, 0), backend="reference")
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < 1e-5


# ------------------------------------------------------------------ local_global decoding
@pytest.mark.parametrize("glob", [(0,), (0, 3, 40)])
@pytest.mark.parametrize("kv", [4, 2])
def test_local_global_decode_equals_full_forward(glob: tuple[int, ...], kv: int) -> None:
    """Token-by-token decoding (the gathered window + global keys) equals the full forward, global
    query positions (which see everything) included."""
    torch.manual_seed(0)
    m = az.LocalGlobalAttention(32, 4, window=5, global_tokens=glob, causal=True, num_kv_heads=kv).eval().double()
    x = torch.randn(2, 48, 32, dtype=F64)
    with torch.no_grad():
        full = m(x)
        cache = m.init_cache(2, 48)
        steps = [m(x[:, :7], cache=cache)] + [m(x[:, i:i + 1], cache=cache) for i in range(7, 48)]
    got = torch.cat(steps, dim=1)
    assert (got - full).abs().max() < 1e-12, f"max error {(got - full).abs().max():.2e}"


# ------------------------------------------------------------------ NSA block-major selected branch
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300, 0), (1, 4, 1, 260, 301, None), (1, 6, 3, 257, 257, 0)])
def test_nsa_block_major_equals_reference_forward_and_backward(shape, monkeypatch) -> None:
    """Many queries (the block-major path, passes of 100 queries) == the dense float64 reference."""
    B, H, G, Nq, Nk, q_offset = shape
    monkeypatch.setattr(nsa_mod, "BLOCK_MAJOR_CHUNK", 100)
    cfg = NSAConfig(block_len=8, block_stride=4, select_len=8, num_selected=4, window=16)
    q, k, v = _qkv(B, H, G, Nq, Nk, D=16, Dv=16)
    gates = torch.rand(B, H, Nq, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    torch.manual_seed(0)
    comp = BlockCompressor(16, 8, 4, {"dtype": F64})
    assert Nq >= nsa_mod.BLOCK_MAJOR_MIN_QUERIES
    fast = nsa_attention(q, k, v, comp(k), comp(v), gates, cfg, form="fast", query_chunk=32, q_offset=q_offset)
    ref = nsa_attention(q, k, v, comp(k), comp(v), gates, cfg, form="reference", q_offset=q_offset)
    assert (fast - ref).abs().max() < 1e-12, f"{shape}: error {(fast - ref).abs().max():.2e}"
    for name, a, b in zip("qkv", _grads(fast, None, (q, k, v)), _grads(ref, None, (q, k, v)), strict=True):
        assert (a - b).abs().max() < 1e-10, f"{shape}: d{name} error {(a - b).abs().max():.2e}"


def test_nsa_block_major_float32() -> None:
    cfg = NSAConfig(block_len=8, block_stride=4, select_len=8, num_selected=4, window=16)
    q, k, v = _qkv(1, 4, 2, 300, 300, D=16, Dv=16, dtype=torch.float32, seed=2)
    gates = torch.rand(1, 4, 300, 3)
    torch.manual_seed(0)
    comp = BlockCompressor(16, 8, 4, {})
    fast = nsa_attention(q, k, v, comp(k), comp(v), gates, cfg, form="fast")
    ref = nsa_attention(*(t.double() for t in (q, k, v, comp(k), comp(v), gates)), cfg, form="reference")
    assert (fast.double() - ref).abs().max() < 1e-5



@pytest.mark.parametrize("tiles", [(64, 4096), (4, 100)])
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300, 0), (1, 4, 1, 260, 301, None), (1, 6, 3, 257, 257, 0)])
def test_nsa_inference_tiles_equal_reference(shape, tiles, monkeypatch) -> None:
    """Inference (no autograd): the selected branch as tiles of torch's CPU flash kernel merged by
    their log-sum-exps (``_selected_tiles``; own-block tiles masked) == the dense float64 reference,
    with the default tiles and with tiles of 4 queries in passes of 100 (many tiles, ragged passes)."""
    B, H, G, Nq, Nk, q_offset = shape
    monkeypatch.setattr(nsa_mod, "SDPA_TILE", tiles[0])
    monkeypatch.setattr(nsa_mod, "SDPA_PASS", tiles[1])
    calls = []
    monkeypatch.setattr(nsa_mod, "_selected_block_major", lambda *a: calls.append(a))  # must not run
    cfg = NSAConfig(block_len=8, block_stride=4, select_len=8, num_selected=4, window=16)
    q, k, v = _qkv(B, H, G, Nq, Nk, D=16, Dv=16)
    gates = torch.rand(B, H, Nq, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    torch.manual_seed(0)
    comp = BlockCompressor(16, 8, 4, {"dtype": F64})
    with torch.no_grad():
        fast = nsa_attention(q, k, v, comp(k), comp(v), gates, cfg, form="fast", query_chunk=32, q_offset=q_offset)
        ref = nsa_attention(q, k, v, comp(k), comp(v), gates, cfg, form="reference", q_offset=q_offset)
    assert not calls
    assert (fast - ref).abs().max() < 1e-12, f"{shape}, tiles {tiles}: error {(fast - ref).abs().max():.2e}"


@pytest.mark.parametrize(("bl", "d", "lp"), [(32, 16, 64), (4, 2, 4), (6, 3, 3), (7, 2, 4), (5, 1, 3), (6, 4, 6)])
def test_nsa_overlap_scores_equal_the_overlap_matrix(bl: int, d: int, lp: int) -> None:
    """Block importance (each compressed block's probability added to every selection block it
    overlaps) == ``p @ overlap`` from the definition: the periodic form (``d | l'``) and the scatter
    form ((6, 4, 6)), selection-block counts that cut the last overlaps off included."""
    cfg = NSAConfig(bl, d, lp, 4, 4)
    for nc in (1, 2, 5, 17, 40):
        full = -(-((nc - 1) * d + bl) // lp)
        for ns in (full, max(1, full - 2)):
            p = torch.rand(2, 3, 5, nc, generator=torch.Generator().manual_seed(nc), dtype=F64)
            starts, jl = torch.arange(nc)[:, None] * d, torch.arange(ns)[None, :] * lp
            want = p @ ((starts < jl + lp) & (starts + bl > jl)).to(F64)
            got = nsa_mod._overlap_scores(p, ns, cfg)
            assert (got - want).abs().max() < 1e-12, f"l={bl} d={d} l'={lp} nc={nc} ns={ns}"

# ------------------------------------------------------------------ varlen split path
@pytest.mark.parametrize("lengths", [[5, 9, 9, 9, 1, 30, 30], [16] * 6, [1]])
@pytest.mark.parametrize("window", [None, (4, 0)])
def test_varlen_split_equals_each_sequence_alone(lengths: list[int], window) -> None:
    """auto's split path (runs of equal lengths batched) == the reference on each sequence alone."""
    g = torch.Generator().manual_seed(len(lengths))
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g)
    k, v = torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        got = az.attention_varlen(q, k, v, cu, cu, causal=True, window=window)
    start = 0
    for n in lengths:
        qi, ki, vi = (x[start:start + n].transpose(0, 1).unsqueeze(0).double() for x in (q, k, v))
        want = az.attention(qi, ki, vi, causal=True, window=window, backend="reference")[0].transpose(0, 1)
        assert (got[start:start + n].double() - want).abs().max() < 1e-5, f"{lengths}: sequence at {start}"
        start += n


def test_varlen_split_is_inference_only_and_keys_can_be_missing() -> None:
    q = torch.randn(6, 2, 8, requires_grad=True)
    assert not split_applies(q, q, q, [0, 6], [0, 6], softcap=None, sinks=None, return_lse=False)
    assert not split_applies(q.detach(), q, q, [0, 6], [0, 6], softcap=None, sinks=None, return_lse=True)
    k = torch.randn(3, 2, 8)
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 0, 3], dtype=torch.int32)
    with torch.no_grad():
        out = az.attention_varlen(q.detach(), k, k, cu_q, cu_k)
        ref = az.attention_varlen(q.detach(), k, k, cu_q, cu_k, backend="reference")
    assert (out - ref).abs().max() < 1e-6 and (out[:2] == 0).all()
