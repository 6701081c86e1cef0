"""``reorder(index)`` of the decode caches (beam search): a reordered cache decodes as the rows it
came from, for every registered variant (Infini's state object included: its fields are per-row
tensors), for a model's :class:`~attnzoo.models._common.LayerCaches` of cross-attention
:class:`~attnzoo.blocks.BlockCache` s, and when the batch grows (``B`` rows -> ``B * K`` beams);
what it refuses (inside a transaction, bad indices, caches that cannot), all-or-nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnzoo.models import Transformer
from attnzoo.models.config import Seq2SeqConfig
from attnzoo.nn.cache import CacheList, KVCache, RowsCache, SlidingWindowKVCache, transaction
from attnzoo.variants import VARIANTS, build_attention

pytestmark = pytest.mark.usefixtures("one_thread")

DIM, HEADS, PREFILL, MAX = 32, 4, 5, 12
#: rows to keep from a batch of 3: repeats, a dropped row, and a larger batch
INDEX = torch.tensor([2, 0, 0, 1])


def _module(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_attention(name, DIM, HEADS, causal=True, **VARIANTS[name].check).eval()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_reordered_cache_decodes_as_its_source_rows(name: str) -> None:
    """Prefill 3 rows, keep ``INDEX``, decode two tokens: equal to prefilling the kept rows afresh."""
    m = _module(name)
    x = torch.randn(3, PREFILL + 2, DIM, generator=torch.Generator().manual_seed(1))
    cache = m.init_cache(3, MAX)
    with torch.no_grad():
        m(x[:, :PREFILL], cache=cache)
        assert cache.reorderable
        cache.reorder(INDEX)
        assert cache.batch_size == len(INDEX) and cache.length == PREFILL
        got = [m(x[INDEX, i:i + 1], cache=cache) for i in (PREFILL, PREFILL + 1)]
        fresh = m.init_cache(len(INDEX), MAX)
        m(x[INDEX, :PREFILL], cache=fresh)
        want = [m(x[INDEX, i:i + 1], cache=fresh) for i in (PREFILL, PREFILL + 1)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_kv_cache_rows_are_taken() -> None:
    c = KVCache(3, 6, 2, 4)
    k, v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    c.update(k, v)
    c.reorder(INDEX)
    assert torch.equal(c.keys(), k[INDEX]) and torch.equal(c.values(), v[INDEX])
    assert (c.batch_size, c.length, tuple(c.k.shape)) == (4, 4, (4, 2, 6, 4))
    c.update(torch.randn(4, 2, 1, 4), torch.randn(4, 2, 1, 4))  # the new batch size is the cache's own
    assert c.length == 5
    c.reorder(torch.tensor([3], dtype=torch.int32))  # any integer dtype; fewer rows
    assert c.batch_size == 1 and torch.equal(c.keys()[:, :, :4], k[INDEX][3:])


def _seq2seq(depth: int = 2) -> Transformer:
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(src_vocab_size=17, tgt_vocab_size=13, dim=DIM, num_heads=HEADS, encoder_depth=depth,
                        decoder_depth=depth, dropout=0.0, max_seq_len=32)
    return Transformer(config=cfg).eval()


def test_model_caches_with_cross_attention_reorder() -> None:
    """LayerCaches of BlockCaches (self + the memory's keys): a reordered cache, memory repeated
    the same way, decodes as the kept rows; expanding 2 rows to 2 * 3 beams too."""
    model = _seq2seq()
    g = torch.Generator().manual_seed(2)
    src, tgt = torch.randint(0, 17, (2, 7), generator=g), torch.randint(0, 13, (2, 6), generator=g)
    src_mask = torch.ones(2, 7, dtype=torch.bool)
    src_mask[1, 5:] = False
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        cache = model.init_cache(2, 8)
        model.decode(tgt[:, :4], memory, memory_mask=src_mask, cache=cache)
        assert all(layer.cross_cache is not None for layer in cache)
        index = torch.tensor([1, 1, 1, 0, 0, 0])  # beams of row 1 first, then of row 0
        cache.reorder(index)
        assert cache.batch_size == 6 and all(layer.cross_cache.batch_size == 6 for layer in cache)
        got = model.decode(tgt[index, 4:6], memory[index], memory_mask=src_mask[index], cache=cache)
        want = model.decode(tgt[index, :6], memory[index], memory_mask=src_mask[index])[:, 4:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reorder_inside_a_transaction_is_refused() -> None:
    model = _seq2seq(depth=1)
    cache = model.init_cache(2, 8)
    kv = KVCache(2, 4, 1, 4)
    for c in (cache, kv):
        with pytest.raises(RuntimeError, match="transaction"):
            transaction(c, lambda c=c: c.reorder(torch.tensor([0, 1])))
        assert c.batch_size == 2 and not c.in_transaction


@pytest.mark.parametrize(("index", "error", "match"), [
    ([0, 1], TypeError, "index must be an integer tensor"),
    (torch.tensor([0.0, 1.0]), TypeError, "index must be an integer tensor"),
    (torch.tensor([True, False]), TypeError, "index must be an integer tensor"),
    (torch.tensor([[0, 1]]), ValueError, "index must have shape"),
    (torch.tensor([], dtype=torch.long), ValueError, "index must have shape"),
    (torch.tensor([0, 2]), ValueError, r"ids must be in \[0, 2\)"),
    (torch.tensor([-1, 0]), ValueError, r"ids must be in \[0, 2\)"),
])
def test_bad_indices_are_refused(index: object, error: type, match: str) -> None:
    model = _seq2seq(depth=1)
    for c in (KVCache(2, 4, 1, 4), model.init_cache(2, 8)):
        with pytest.raises(error, match=match):
            c.reorder(index)  # type: ignore[arg-type]
        assert c.batch_size == 2


class _Undeclared(KVCache):
    """A subclass that adds per-row state without declaring it: must not be half-reordered."""


def test_undeclared_subclass_and_foreign_caches_refuse_and_nothing_changes() -> None:
    ok, bad = KVCache(2, 4, 1, 4), _Undeclared(2, 4, 1, 4)
    with pytest.raises(TypeError, match="_Undeclared"):
        bad.reorder(torch.tensor([1, 0]))

    class Foreign:  # a cache with the protocol's length/reset but no reorder
        length, batch_size = 0, 2

        def reset(self) -> None: ...

    both = CacheList([ok, bad, Foreign()])
    assert not both.reorderable
    with pytest.raises(TypeError, match=r"\['Foreign', '_Undeclared'\]"):
        both.reorder(torch.tensor([1, 1, 0]))
    assert ok.batch_size == 2 and ok.k.shape[0] == 2  # checked before any part changed


def test_slot_cache_reorder_ends_the_undo_history() -> None:
    """A ring buffer's last update can be undone until a reorder; after it, rolling back to a mark
    from before raises (the saved slots are in the old row order) and a new mark works."""
    c = SlidingWindowKVCache(2, 3, 1, 4)
    c.update(torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4))
    mark = c.mark()
    c.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
    c.reorder(torch.tensor([1, 0]))
    with pytest.raises(RuntimeError, match="only the last update"):
        c.rollback(mark)
    keys = c.k.clone()
    mark = c.mark()
    c.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
    c.rollback(mark)
    assert torch.equal(c.k, keys)


class _PlainUndeclared(RowsCache):
    def __init__(self) -> None:
        self.batch_size, self.state = 2, torch.zeros(2, 3)


class _PlainDeclared(_PlainUndeclared):
    _batch_tensors = ("state",)


def test_rows_cache_reorders_only_what_its_own_class_declares() -> None:
    bad, ok = _PlainUndeclared(), _PlainDeclared()
    assert not bad.reorderable and ok.reorderable
    with pytest.raises(TypeError, match="_PlainUndeclared"):
        bad.reorder(torch.tensor([1, 0]))
    ok.state = torch.arange(6.0).view(2, 3)
    ok.reorder(torch.tensor([1, 1, 0]))
    assert ok.batch_size == 3 and torch.equal(ok.state[:, 0], torch.tensor([3.0, 3.0, 0.0]))
