"""KV caches: written by position, KV heads only, ring buffer bounded by the window, clear errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo as az
from attnzoo.nn.cache import SnapshotCache
from attnzoo.nn.mla import LatentCache
from attnzoo.nn.parts import AttentionParts, Scores
from attnzoo.variants import build_attention


def test_kv_cache_writes_by_position_and_returns_views() -> None:
    torch.manual_seed(0)
    cache = az.KVCache(2, 10, num_kv_heads=3, head_dim=4)
    assert cache.k.shape == (2, 3, 10, 4) and cache.length == 0 and cache.batch_size == 2
    k1, v1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    cache.update(k1, v1)
    k, v, pos = cache.update(k2, v2)
    assert cache.length == 5 and pos.tolist() == [0, 1, 2, 3, 4] and pos.dtype == torch.int64
    assert torch.equal(k, torch.cat([k1, k2], 2)) and torch.equal(v, torch.cat([v1, v2], 2))
    assert k.data_ptr() == cache.k.data_ptr(), "update must return a view of the preallocated buffer"
    cache.reset()
    assert cache.length == 0
    k, _, _ = cache.update(k2, v2)
    assert torch.equal(k, k2)


def test_kv_cache_errors() -> None:
    cache = az.KVCache(2, 4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="built for batch size 2, got a batch of 3"):
        cache.update(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8))
    with pytest.raises(ValueError, match="Hkv=2"):
        cache.update(torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8))
    with pytest.raises(TypeError, match="float32"):
        cache.update(torch.randn(2, 2, 1, 8, dtype=torch.float64), torch.randn(2, 2, 1, 8, dtype=torch.float64))
    cache.update(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    with pytest.raises(ValueError, match=r"overflow: 3 tokens cached \+ 2 new > max_len=4"):
        cache.update(torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8))
    assert cache.length == 3, "a failed update must not advance the cache"
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        az.KVCache(1, 0, 1, 8)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        az.KVCache(1.5, 4, 1, 8)


def test_sliding_cache_ring_holds_only_the_window() -> None:
    torch.manual_seed(1)
    w = 3
    cache = az.SlidingWindowKVCache(1, w, num_kv_heads=1, head_dim=2)
    assert cache.capacity == w and cache.k.shape == (1, 1, w, 2)  # DESIGN: at most `window` keys held
    seq_k = torch.randn(1, 1, 20, 2)
    seq_v = torch.randn(1, 1, 20, 2)
    for p in range(20):
        k, v, pos = cache.update(seq_k[:, :, p:p + 1], seq_v[:, :, p:p + 1])
        expect = list(range(max(0, p - w), p + 1))
        assert pos.tolist() == expect, "keys come back in position order (contiguous positions)"
        # each returned key is the key of its position (RoPE'd keys stay attached to their position)
        assert torch.equal(k[0, 0], seq_k[0, 0, pos]) and torch.equal(v[0, 0], seq_v[0, 0, pos])
        assert k.shape[2] <= w + 1 and cache.num_cached <= w  # the query's own key comes with the call
    assert cache.nbytes == 2 * w * 2 * 4


def test_sliding_cache_chunks_longer_than_the_ring() -> None:
    torch.manual_seed(2)
    cache = az.SlidingWindowKVCache(2, 2, num_kv_heads=1, head_dim=3)
    seq = torch.randn(2, 1, 12, 3)
    cache.update(seq[:, :, :2], seq[:, :, :2])
    k, _, pos = cache.update(seq[:, :, 2:9], seq[:, :, 2:9])  # 7 new > capacity 2
    assert pos.tolist() == list(range(0, 9)), "a chunk sees the ring's keys followed by its own"
    assert torch.equal(k, seq[:, :, :9])
    assert sorted(cache.slot_positions.tolist()) == [7, 8]
    k, _, pos = cache.update(seq[:, :, 9:10], seq[:, :, 9:10])
    assert pos.tolist() == [7, 8, 9]
    assert torch.equal(k, seq[:, :, 7:10])
    cache.reset()
    assert cache.length == 0 and (cache.slot_positions == -1).all()


def test_sliding_cache_max_len_and_batch() -> None:
    cache = az.SlidingWindowKVCache(2, 2, 1, 4, max_len=5)
    cache.update(torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4))
    with pytest.raises(ValueError, match="max_len=5"):
        cache.update(torch.randn(2, 1, 2, 4), torch.randn(2, 1, 2, 4))
    with pytest.raises(ValueError, match="batch size 2"):
        cache.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    with pytest.raises(ValueError, match="window must be >= 0"):
        az.SlidingWindowKVCache(1, -1, 1, 4)


def test_caches_store_only_kv_heads_and_bytes_scale_with_them() -> None:
    H, C = 8, 64
    caches = {}
    for kv in (8, 4, 2, 1):
        m = az.GroupedQueryAttention(C, H, num_kv_heads=kv, causal=True)
        caches[kv] = m.init_cache(2, 32)
        assert caches[kv].k.shape == (2, kv, 32, C // H)
    for kv in (4, 2, 1):
        assert caches[kv].nbytes * H == caches[8].nbytes * kv
        assert caches[kv].bytes_per_token() * H == caches[8].bytes_per_token() * kv
    mqa = az.MultiQueryAttention(C, H, causal=True).init_cache(2, 32)
    assert mqa.nbytes * H == caches[8].nbytes


def test_init_cache_kind_device_dtype() -> None:
    sw = az.SlidingWindowAttention(32, 4, window=5).to(torch.float64)
    c = sw.init_cache(3, 100)
    assert isinstance(c, az.SlidingWindowKVCache) and c.capacity == 5 and c.dtype == torch.float64
    # a window longer than max_len needs no ring
    assert isinstance(sw.init_cache(3, 4), az.KVCache)
    lg = az.LocalGlobalAttention(32, 4, window=2, causal=True)
    assert isinstance(lg.init_cache(1, 50), az.KVCache), "global queries need every key"
    c = az.MultiHeadAttention(32, 4, causal=True).init_cache(1, 8, dtype=torch.bfloat16)
    assert c.dtype == torch.bfloat16 and c.max_len == 8


@settings(max_examples=25, deadline=None)
@given(window=st.integers(0, 5), cuts=st.lists(st.integers(1, 14), max_size=6, unique=True),
       alibi=st.booleans(), kv=st.sampled_from([1, 2]))
def test_sliding_cache_any_chunking_equals_full_forward(window: int, cuts: list[int], alibi: bool, kv: int) -> None:
    """Any split of the sequence into prefill/decode chunks, any window (ring wrap-arounds in the
    middle of chunks included) gives the full forward's outputs."""
    torch.manual_seed(window * 31 + len(cuts))
    m = az.SlidingWindowAttention(16, 2, window=window, num_kv_heads=kv, rope=True,
                                  parts=AttentionParts(scores=Scores(alibi=alibi))).eval()
    x = torch.randn(1, 15, 16)
    bounds = [0, *sorted(cuts), 15]
    with torch.no_grad():
        full = m(x)
        cache = m.init_cache(1, 15)
        out = torch.cat([m(x[:, a:b], cache=cache) for a, b in itertools.pairwise(bounds)], dim=1)
    assert cache.k.shape[2] == window or isinstance(cache, az.KVCache)
    assert (out - full).abs().max() < 1e-5, f"window={window} chunks={bounds}"


@pytest.mark.parametrize("make", [lambda: az.KVCache(1, 8, 2, 4), lambda: az.SlidingWindowKVCache(1, 3, 2, 4),
                                  lambda: az.SinkWindowKVCache(1, 2, 3, 2, 4),
                                  lambda: LatentCache(1, 8, 6, 2)],
                         ids=["kv", "sliding", "sink", "latent"])
def test_every_cache_shares_the_mark_protocol(make) -> None:  # type: ignore[no-untyped-def]
    """The shared base: reset/mark/rollback/commit, and a bad mark is a TypeError naming the cache."""
    torch.manual_seed(0)
    cache = make()
    if isinstance(cache, LatentCache):
        step = lambda n: cache.update(torch.randn(1, n, 6), torch.randn(1, n, 2))  # noqa: E731
    else:
        step = lambda n: cache.update(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4))  # noqa: E731
    step(3)
    mark = cache.mark()
    step(1)
    cache.rollback(mark)
    assert cache.length == 3 and cache.batch_size == 1
    with pytest.raises(TypeError, match=f"{type(cache).__name__}.rollback"):
        cache.rollback("not a mark")
    cache.commit(cache.mark())
    cache.reset()
    assert cache.length == 0


@pytest.mark.parametrize("variant", ["linear", "performer", "infini", "retnet", "deltanet", "nsa"])
def test_snapshot_caches_roll_back_a_call(variant: str) -> None:
    """Caches whose updates replace their state (``SnapshotCache``): rolling back a call restores
    the state exactly, so decoding goes on as if the call never happened; a bad mark is a TypeError."""
    torch.manual_seed(0)
    m = build_attention(variant, 16, 2).eval()
    x = torch.randn(1, 12, 16)
    with torch.no_grad():
        cache = m.init_cache(1, 32)
        m(x[:, :5], cache=cache)
        mark = cache.mark()
        want = m(x[:, 5:12], cache=cache)
        m(torch.randn(1, 3, 16), cache=cache)  # a call to undo
        cache.rollback(mark)
        assert cache.length == 5
        got = m(x[:, 5:12], cache=cache)
    assert isinstance(cache, SnapshotCache)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match=f"{type(cache).__name__}.rollback"):
        cache.rollback(5)


@pytest.mark.parametrize("make", [lambda: az.SlidingWindowKVCache(1, 3, 1, 2), lambda: az.SinkWindowKVCache(1, 1, 2, 1, 2)],
                         ids=["sliding", "sink"])
def test_a_zero_token_update_keeps_the_last_update_undoable(make) -> None:  # type: ignore[no-untyped-def]
    cache, seq = make(), torch.randn(1, 1, 9, 2)
    cache.update(seq[:, :, :5], seq[:, :, :5])
    mark = cache.mark()
    held = cache.update(seq[:, :, 5:6], seq[:, :, 5:6])[2]
    cache.update(seq[:, :, :0], seq[:, :, :0])
    cache.rollback(mark)
    assert cache.length == 5
    assert torch.equal(cache.update(seq[:, :, 5:6], seq[:, :, 5:6])[2], held)


@pytest.mark.parametrize(("sinks", "window"), [(0, 3), (2, 3), (4, 1), (3, 0)])
def test_sink_window_cache_holds_exactly_what_the_next_query_sees(sinks: int, window: int) -> None:
    """After L tokens the cache holds the sinks and the last ``window`` keys, each with its own
    values, and nothing else (a ring bound off by one passed the cache's other tests: only the
    module-level decode == full forward caught it)."""
    cache = az.SinkWindowKVCache(1, sinks, window, 1, 2)
    keys = torch.arange(12, dtype=torch.float32).view(1, 1, 12, 1).expand(1, 1, 12, 2)
    for length in range(1, 13):
        cache.update(keys[:, :, length - 1:length], keys[:, :, length - 1:length])
        want = sorted(set(range(min(length, sinks))) | set(range(max(sinks, length - window), length)))
        held = cache.held_positions()
        assert held.tolist() == want, (length, held.tolist())
        k, _, pos = cache.update(keys[:, :, :0], keys[:, :, :0])  # the held keys, in position order
        assert pos.tolist() == want and k[0, 0, :, 0].tolist() == [float(p) for p in want], length
