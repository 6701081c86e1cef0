"""What speculative decoding rests on in the caches: :func:`~attnzoo.nn.cache.truncate` (keys
written by position drop their last tokens; a block's context is kept; a ring or a state refuses)
and a transaction over several updates of a ring of slots, rolled back latest first."""

from __future__ import annotations

import pytest
import torch

import attnzoo as az
from attnzoo.models.parts import DecoderParts
from attnzoo.nn.cache import KVCache, SlidingWindowKVCache, transaction, truncatable, truncate


def test_truncate_keeps_what_came_before() -> None:
    cache = KVCache(2, 8, 2, 4)
    k, v = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    cache.update(k[:, :, :4], v[:, :, :4])
    before = cache.update(k[:, :, 4:5], v[:, :, 4:5])[0].clone()
    cache.update(k[:, :, 5:], v[:, :, 5:])
    truncate(cache, 5)
    assert cache.length == 5 and torch.equal(cache.keys(), before)
    with pytest.raises(ValueError, match="at most the 5 tokens"):
        truncate(cache, 6)
    with pytest.raises(ValueError, match="length"):
        truncate(cache, -1)
    ring = SlidingWindowKVCache(2, 3, 2, 4)
    assert not truncatable(ring)
    with pytest.raises(TypeError, match="SlidingWindowKVCache"):
        truncate(ring, 0)


def test_truncate_keeps_a_blocks_context() -> None:
    torch.manual_seed(0)
    cfg = az.blocks.BlockConfig(32, 4, causal=True, cross_attention=True, context_dim=16)
    model = az.DecoderLM(vocab_size=50, dim=32, depth=1, num_heads=4, max_seq_len=64,
                         parts=DecoderParts(blocks=[az.TransformerBlock(config=cfg)])).eval()
    cache, context = model.init_cache(1, 16), torch.randn(1, 5, 16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache, context=context)
        assert truncatable(cache)
        truncate(cache, 1)
        assert cache.length == 1 and cache[0].cross_cache is not None


def test_a_transaction_rolls_back_several_updates_of_a_ring() -> None:
    """A ring of slots keeps a record per update inside an open transaction (a speculative round
    feeds an assistant several times) and restores them latest first; outside one, only the last."""
    torch.manual_seed(0)
    cache = SlidingWindowKVCache(1, 3, 1, 2)
    cache.update(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2))
    saved = (cache.k.clone(), cache.v.clone(), cache.slot_positions.clone())

    def three_updates() -> None:
        for n in (1, 2, 3):  # wraps around the ring
            cache.update(torch.randn(1, 1, n, 2), torch.randn(1, 1, n, 2))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transaction(cache, three_updates)
    assert cache.length == 2
    assert all(torch.equal(a, b) for a, b in zip(saved, (cache.k, cache.v, cache.slot_positions), strict=True))
    mark = cache.mark()
    cache.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    cache.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    with pytest.raises(RuntimeError, match="can be undone"):
        cache.rollback(mark)
