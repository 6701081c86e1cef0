"""What speculative decoding rests on in the caches: :func:`~attnzoo.nn.cache.truncate` (keys
written by position drop their last tokens; a block's context is kept; a ring or a state refuses)
and a transaction over several updates of a ring of slots, rolled back latest first."""

from __future__ import annotations

import copy

import pytest
import torch

import attnzoo as az
from attnzoo.models.parts import DecoderParts
from attnzoo.nn.cache import (
    KVCache,
    SlidingWindowKVCache,
    rewind,
    rewindable,
    transaction,
    truncatable,
    truncate,
)


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


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_a_ring_rewinds_inside_its_transaction_as_if_fed_afresh(window: int) -> None:
    """:func:`rewind` of a sliding-window ring to any length after the transaction's mark: the same
    slots and the same next update as a ring fed only those tokens; refused (:func:`rewindable`
    False) exactly where an update cut by the length held fewer new tokens than the ring needs."""
    g = torch.Generator().manual_seed(window)
    k, v = torch.randn(1, 2, 16, 3, generator=g), torch.randn(1, 2, 16, 3, generator=g)
    for pre, chunks in [(0, [4]), (3, [1, 1, 1]), (4, [2, 3]), (2, [6]), (5, [1, 4, 1])]:
        for length in range(pre, pre + sum(chunks) + 1):
            ring = SlidingWindowKVCache(1, window, 2, 3)
            ring.update(k[:, :, :pre], v[:, :, :pre])
            mark, p = ring.mark(), pre
            ring.in_transaction = True
            cut_short = False
            for n in chunks:
                cut_short |= p < length < p + n and max(p, length - window) < p + n - min(n, window)
                ring.update(k[:, :, p:p + n], v[:, :, p:p + n])
                p += n
            assert rewindable(ring, length) == (not cut_short), (pre, chunks, length)
            if cut_short:
                with pytest.raises(TypeError, match="without a rollback"):
                    rewind(ring, length)
                continue
            rewind(ring, length)
            ring.in_transaction = False
            ring.commit(mark)
            fresh = SlidingWindowKVCache(1, window, 2, 3)
            fresh.update(k[:, :, :length], v[:, :, :length])
            for got, want in zip(ring.update(k[:, :, length:length + 2], v[:, :, length:length + 2]),
                                 fresh.update(k[:, :, length:length + 2], v[:, :, length:length + 2]), strict=True):
                assert torch.equal(got, want), (pre, chunks, length)
            assert torch.equal(ring.slot_positions, fresh.slot_positions)


def test_a_rejected_draft_on_a_sliding_model_costs_no_second_forward() -> None:
    """Speculative decoding on a sliding-window model (window 6 > the 4 tokens a round checks): each
    round is one forward of the model — its rings rewound to the kept tokens, not rolled back and
    fed again (22 forwards before, for these 12 tokens) — and the tokens are greedy's."""
    torch.manual_seed(0)
    model = az.DecoderLM(config=az.models.DecoderConfig(50, 32, 2, 4, max_seq_len=64, attention="sliding",
                                                        attention_kwargs={"window": 6})).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distributions far from flat, and a draft that agrees only in part
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
        draft = copy.deepcopy(model)
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * (p.std() + 1e-3))
    x = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    calls: list[int] = []
    model.norm.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        want = model.generate(x, 12)
        calls.clear()
        got = model.generate(x, 12, assistant_model=draft, num_assistant_tokens=3, assistant_confidence_threshold=0.0)
    assert torch.equal(got, want)
    assert len(calls) <= 12  # the prefill and one forward a round


def test_rewind_refuses_lengths_out_of_range() -> None:
    ring = SlidingWindowKVCache(1, 3, 2, 3)
    ring.update(torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3))
    with pytest.raises(ValueError, match="at most the 4 tokens"):
        rewind(ring, 5)
    with pytest.raises(ValueError, match="length"):
        rewind(KVCache(1, 8, 2, 3), -1)
    with pytest.raises(TypeError, match="without a rollback"):
        rewind(ring, 2)  # outside a transaction the ring keeps no records to come back with
