"""Forgetting attention (FoX, issue 36) against a float64 token loop written from the paper's math,
decode == full forward, packed == each sequence alone, and the registry/cost entry."""

from __future__ import annotations

import math

import pytest
import torch

import attnzoo as az
from attnzoo.functional.backends.tiled import TileConfig, use_tiles
from attnzoo.nn.fox import FoxAttention, FoxCache, forget_sums
from attnzoo.nn.spec import CostShape
from attnzoo.variants import VARIANTS, build_attention, resolve_config


def _token_loop(mod: FoxAttention, x: torch.Tensor) -> torch.Tensor:
    """o_i = sum_{j<=i} softmax_j(scale q_i.k_j + sum_{l=j+1..i} log f_l) v_j, one query at a time."""
    B, N, _ = x.shape
    H, Hkv, D = mod.num_heads, mod.num_kv_heads, mod.head_dim
    q, k, v = mod.project_qkv(x)
    f = torch.sigmoid(mod.fgate(x)).transpose(1, 2)  # [B, H, N]
    rows = []
    for i in range(N):
        heads = []
        for h in range(H):
            g = h // (H // Hkv)
            logits = []
            for j in range(i + 1):
                decay = sum((torch.log(f[:, h, t]) for t in range(j + 1, i + 1)), torch.zeros(B, dtype=x.dtype))
                logits.append((q[:, h, i] * k[:, g, j]).sum(-1) / math.sqrt(D) + decay)
            p = torch.softmax(torch.stack(logits, dim=-1), dim=-1)  # [B, i+1]
            heads.append(torch.einsum("bj,bjd->bd", p, v[:, g, :i + 1]))
        rows.append(torch.stack(heads, dim=1))  # [B, H, D]
    return mod.merge_heads(torch.stack(rows, dim=2))


def test_fox_matches_token_loop_with_gradients() -> None:
    torch.manual_seed(0)
    mod = FoxAttention(16, 4, num_kv_heads=2, dtype=torch.float64)
    with torch.no_grad():
        mod.fgate.weight.normal_(0, 0.5)
        mod.fgate.bias.fill_(0.5)  # gates well away from 1: the bias matters
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    with use_tiles(TileConfig(block_q=4, block_k=4, max_chunk_k=8, merge_k=4)):
        got = mod(x)  # auto -> reference for float64; the tiled run is below
        tiled = FoxAttention(16, 4, num_kv_heads=2, backend="tiled", dtype=torch.float64)
        tiled.load_state_dict(mod.state_dict())
        got_tiled = tiled(x)
    want = _token_loop(mod, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_tiled, want, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(want)
    params = [x, mod.fgate.weight, mod.fgate.bias, mod.qkv_proj.weight]
    g_want = torch.autograd.grad((want * w).sum(), params)
    g_tiled = torch.autograd.grad((got_tiled * w).sum(), [x, tiled.fgate.weight, tiled.fgate.bias,
                                                           tiled.qkv_proj.weight])
    for a, b in zip(g_tiled, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_fox_decode_equals_full_and_rollback() -> None:
    torch.manual_seed(1)
    mod = FoxAttention(32, 4).eval()
    with torch.no_grad():
        mod.fgate.bias.fill_(0.0)
    x = torch.randn(2, 13, 32)
    full = mod(x)
    cache = mod.init_cache(2, 13)
    assert isinstance(cache, FoxCache)
    steps = [mod(x[:, :5], cache=cache)] + [mod(x[:, t:t + 1], cache=cache) for t in range(5, 13)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 13
    # a failed call leaves the cache unchanged
    cache2 = mod.init_cache(2, 13)
    mod(x[:, :5], cache=cache2)
    before = cache2.log_gates.clone()
    with pytest.raises(ValueError):
        mod(x[:, 5:20, :31], cache=cache2)
    assert cache2.length == 5
    torch.testing.assert_close(mod(x[:, 5:6], cache=cache2), full[:, 5:6], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache2.log_gates[:, :, :5], before[:, :, :5])


def test_fox_packed_equals_each_alone() -> None:
    torch.manual_seed(2)
    mod = FoxAttention(16, 2)
    lens = [4, 7, 2]
    xs = [torch.randn(1, n, 16) for n in lens]
    cu = torch.tensor([0, 4, 11, 13], dtype=torch.int32)
    packed = mod(torch.cat(xs, dim=1), cu_seqlens=cu)
    alone = torch.cat([mod(x) for x in xs], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_fox_is_registered_with_a_cost() -> None:
    spec = VARIANTS["fox"]
    assert isinstance(build_attention("fox", 32, 4), FoxAttention)
    assert spec.exact and spec.causal_modes == (True,)
    cost = spec.cost(resolve_config("fox", 32, 4), CostShape(batch=1, seq_len=256, elem_bytes=4, acc_bytes=4))
    # K and V (4 heads x 8 dims, 4 bytes) plus one float32 log-gate per head and token
    assert cost.backend == "tiled" and cost.kv_cache_bytes_per_token == 2 * 4 * 8 * 4 + 4 * 4


def test_fox_dense_bias_backend_equals_score_mod() -> None:
    """On ``sdpa`` (no score_mod) FoX passes the same bias as a dense float mask: equal to ``tiled``,
    with a user mask (a Mask object) folded in, forward and through a cache."""
    torch.manual_seed(3)
    tiled = FoxAttention(32, 4, num_kv_heads=2, backend="tiled")
    dense = FoxAttention(32, 4, num_kv_heads=2, backend="sdpa")
    dense.load_state_dict(tiled.state_dict())
    x = torch.randn(2, 10, 32)
    pad = az.masks.key_padding([10, 7])
    torch.testing.assert_close(dense(x, mask=pad), tiled(x, mask=pad), rtol=1e-5, atol=1e-5)
    cache = dense.init_cache(2, 10)
    steps = torch.cat([dense(x[:, :6], cache=cache)] + [dense(x[:, t:t + 1], cache=cache) for t in range(6, 10)], 1)
    torch.testing.assert_close(steps, tiled(x), rtol=1e-5, atol=1e-5)


def test_forget_sums_restart_at_every_sequence_bitwise() -> None:
    """Packed FoX sums each sequence's gates from zero, bitwise as that sequence alone: one running sum
    over all packed tokens would make ``c_i - c_j`` round differently when an earlier sequence changes."""
    gen = torch.Generator().manual_seed(0)
    log_f = -torch.rand(3, 40, generator=gen, dtype=torch.float64) * 7  # [H, T]
    cu = torch.tensor([0, 9, 9, 10, 31, 40], dtype=torch.int32)
    packed = forget_sums(log_f, cu)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        assert torch.equal(packed[:, lo:hi], forget_sums(log_f[:, lo:hi]))
    changed = log_f.clone()
    changed[:, 10:31] *= 3  # another sequence only
    keep = torch.ones(40, dtype=torch.bool)
    keep[10:31] = False
    assert torch.equal(forget_sums(changed, cu)[:, keep], packed[:, keep])
    assert torch.equal(forget_sums(log_f), torch.cumsum(log_f, dim=-1))
