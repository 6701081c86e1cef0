"""Mask builders against hand-written dense tables, algebra, and block maps against materialize."""

import pytest
import torch

from attnzoo import masks as M
from attnzoo.oracle import visible_table


def table(rows: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r.split()] for r in rows.strip().splitlines()])


def test_causal_bottom_right_nq2_nk5() -> None:
    got = M.causal().materialize(1, 1, 2, 5)[0, 0]
    want = table("""
        1 1 1 1 0
        1 1 1 1 1
    """)
    assert torch.equal(got, want)


def test_causal_top_left_with_q_offset_0() -> None:
    got = M.causal().materialize(1, 1, 2, 5, q_offset=0)[0, 0]
    want = table("""
        1 0 0 0 0
        1 1 0 0 0
    """)
    assert torch.equal(got, want)


def test_sliding_window_table() -> None:
    got = M.sliding_window(1, 2).materialize(1, 1, 5, 5)[0, 0]
    want = table("""
        1 1 1 0 0
        1 1 1 1 0
        0 1 1 1 1
        0 0 1 1 1
        0 0 0 1 1
    """)
    assert torch.equal(got, want)


def test_causal_window_nq2_nk5() -> None:
    got = (M.causal() & M.sliding_window(1, 0)).materialize(1, 1, 2, 5)[0, 0]
    want = table("""
        0 0 1 1 0
        0 0 0 1 1
    """)
    assert torch.equal(got, want)


def test_unbounded_window_side() -> None:
    got = M.sliding_window(None, 0).materialize(1, 1, 4, 4)[0, 0]
    assert torch.equal(got, M.causal().materialize(1, 1, 4, 4)[0, 0])


def test_key_padding_lengths_and_bool() -> None:
    by_len = M.key_padding(torch.tensor([2, 4])).materialize(2, 1, 3, 4)
    real = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    by_bool = M.key_padding(real).materialize(2, 1, 3, 4)
    assert torch.equal(by_len, by_bool)
    assert torch.equal(by_len[0, 0], table("1 1 0 0\n1 1 0 0\n1 1 0 0"))
    assert by_len[1].all()


def test_document_mask_table() -> None:
    ids = torch.tensor([0, 0, 1, 1, 1])
    got = (M.document(ids) & M.causal()).materialize(1, 1, 5, 5)[0, 0]
    want = table("""
        1 0 0 0 0
        1 1 0 0 0
        0 0 1 0 0
        0 0 1 1 0
        0 0 1 1 1
    """)
    assert torch.equal(got, want)


def test_prefix_lm_table() -> None:
    got = M.prefix_lm(2).materialize(1, 1, 4, 4)[0, 0]
    want = table("""
        1 1 0 0
        1 1 0 0
        1 1 1 0
        1 1 1 1
    """)
    assert torch.equal(got, want)


def test_global_tokens_table() -> None:
    got = (M.sliding_window(0, 0) | M.global_tokens([0])).materialize(1, 1, 4, 4)[0, 0]
    want = table("""
        1 1 1 1
        1 1 0 0
        1 0 1 0
        1 0 0 1
    """)
    assert torch.equal(got, want)


def test_invert_and_or() -> None:
    c = M.causal().materialize(1, 1, 6, 6)
    w = M.sliding_window(2, 2).materialize(1, 1, 6, 6)
    assert torch.equal((~M.causal()).materialize(1, 1, 6, 6), ~c)
    assert torch.equal((M.causal() | M.sliding_window(2, 2)).materialize(1, 1, 6, 6), c | w)
    assert torch.equal((M.causal() & M.sliding_window(2, 2)).materialize(1, 1, 6, 6), c & w)


def test_custom_head_dependent_predicate() -> None:
    m = M.Mask(lambda b, h, q, k: (k <= q) | (h == 1), "custom")
    got = m.materialize(1, 2, 3, 3)
    assert torch.equal(got[0, 0], M.causal().materialize(1, 1, 3, 3)[0, 0])
    assert got[0, 1].all()


MASKS = {
    "causal": lambda: M.causal(),
    "window": lambda: M.sliding_window(5, 3),
    "causal_window_global": lambda: M.causal() & (M.sliding_window(7, 0) | M.global_tokens([0, 13, 40])),
    "padding": lambda: M.key_padding(torch.tensor([50, 17])),
    "prefix": lambda: M.prefix_lm(torch.tensor([9, 30])),
    "document": lambda: M.document(torch.randint(0, 3, (2, 64)).sort(dim=1).values),
    "not_causal": lambda: ~M.causal(),
    "custom": lambda: M.Mask(lambda b, h, q, k: (q + k + h) % 3 == 0, "custom"),
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize(("n_q", "n_k", "off"), [(50, 50, None), (23, 61, None), (40, 64, 0), (30, 40, 17)])
def test_block_map_matches_materialize(name: str, n_q: int, n_k: int, off: int | None) -> None:
    m = MASKS[name]()
    dense = m.materialize(2, 2, n_q, n_k, q_offset=off)
    bq, bk = 8, 6
    bm = m.block_map(2, 2, n_q, n_k, bq, bk, q_offset=off)
    for i in range(bm.shape[2]):
        for j in range(bm.shape[3]):
            tile = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            for b in range(2):
                for h in range(2):
                    t = tile[b, h]
                    want = M.BLOCK_FULL if t.all() else (M.BLOCK_EMPTY if not t.any() else M.BLOCK_PARTIAL)
                    got = int(bm[b, h, i, j])
                    if name in EXACT:
                        assert got == want, (name, i, j, b, h, got, want)
                    else:  # composite rules may be conservative (partial) but never wrong
                        assert got in (want, M.BLOCK_PARTIAL), (name, i, j, b, h, got, want)


EXACT = {"causal", "window", "padding", "prefix", "document", "custom", "not_causal"}


def test_block_map_exact_for_builders() -> None:
    m = M.causal() & M.sliding_window(16, 0)
    dense = m.materialize(1, 1, 64, 64)
    bm = m.block_map(1, 1, 64, 64, 8, 8)
    tiles = dense.reshape(1, 1, 8, 8, 8, 8).permute(0, 1, 2, 4, 3, 5)
    want = torch.where(tiles.all(-1).all(-1), 2, torch.where(tiles.any(-1).any(-1), 1, 0)).to(torch.int8)
    assert torch.equal(bm, want)


def test_block_map_memory_is_not_quadratic() -> None:
    # 2^20 x 2^20 tiles would need a terabyte as a dense mask; the block map is tiny.
    m = M.causal() & M.sliding_window(1024, 0)
    bm = m.block_map(1, 1, 1 << 20, 1 << 20, 4096, 4096)
    assert bm.shape == (1, 1, 256, 256)
    assert (bm != M.BLOCK_EMPTY).sum() <= 2 * 256


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda: M.sliding_window(-1, 0), ValueError, "left"),
        (lambda: M.sliding_window(0, -2), ValueError, "right"),
        (lambda: M.sliding_window(1.5, 0), TypeError, "left"),
        (lambda: M.key_padding(torch.ones(2, 3, 4, dtype=torch.bool)), ValueError, "[B, Nk]"),
        (lambda: M.key_padding(torch.tensor([1.0, 2.0])), ValueError, "lengths"),
        (lambda: M.key_padding(torch.tensor([-1, 2])), ValueError, ">= 0"),
        (lambda: M.key_padding("abc"), TypeError, "key_padding"),
        (lambda: M.document(torch.rand(5)), TypeError, "doc_ids"),
        (lambda: M.prefix_lm(-3), ValueError, "prefix_len"),
        (lambda: M.global_tokens([]), ValueError, "positions"),
        (lambda: M.global_tokens([-1]), ValueError, ">= 0"),
        (lambda: M.causal() & 3, TypeError, "Mask"),
        (lambda: M.causal().materialize(0, 1, 2, 2), ValueError, "batch"),
        (lambda: M.key_padding(torch.tensor([1, 2])).materialize(3, 1, 2, 2), ValueError, "batch size"),
        (lambda: M.Mask(lambda b, h, q, k: q + k).materialize(1, 1, 2, 2), TypeError, "bool"),
        (lambda: M.Mask(42), TypeError, "callable"),
    ],
)
def test_bad_mask_input(call, exc, words) -> None:
    with pytest.raises(exc, match=None) as info:
        call()
    assert words in str(info.value)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (0, 0), (3, None), (None, 2), (2, 5)])
@pytest.mark.parametrize("q_offset", [-3, 0, 4])
def test_visible_is_the_oracles_rule(causal: bool, window: tuple | None, q_offset: int) -> None:
    """The one visibility rule (masks.visible) against the independent oracle's table."""
    n_q, n_k = 6, 9
    q_pos = (q_offset + torch.arange(n_q)).view(-1, 1)
    got = M.visible(q_pos, torch.arange(n_k).view(1, -1), causal=causal, window=window).expand(n_q, n_k)
    assert torch.equal(got, visible_table(1, 1, n_q, n_k, causal=causal, window=window, q_offset=q_offset)[0, 0])


# --------------------------------------------------------------------------- sizes a mask is tied to
def _backends() -> list[str]:
    import attnzoo as az

    return [b for b in ("reference", "sdpa", "tiled", "flex") if b in az.available_backends()] + ["auto"]


@pytest.mark.parametrize("backend", _backends())
def test_bool_key_padding_narrower_than_nk_is_refused(backend: str) -> None:
    """A5: a bool key_padding [B, 3] used with Nk = 5 hid keys 3 and 4 without a word."""
    import attnzoo as az

    q = torch.randn(2, 2, 5, 8)
    narrow = M.key_padding(torch.ones(2, 3, dtype=torch.bool))
    for mask in (narrow, M.causal() & narrow, ~narrow):
        with pytest.raises(ValueError, match=r"lengths_or_mask is a bool mask \[B, 3\].*Nk"):
            az.attention(q, q, q, mask=mask, backend=backend)


def test_bool_key_padding_narrower_than_nk_is_refused_by_every_evaluation() -> None:
    """A5: materialize, block_map (the tiled/flex tile maps) and check_sizes refuse it too."""
    narrow = M.key_padding(torch.ones(2, 3, dtype=torch.bool))
    for call in (lambda: narrow.materialize(2, 1, 5, 5), lambda: narrow.block_map(2, 1, 5, 5, 2, 2),
                 lambda: (narrow & M.causal()).check_sizes(2, 5, 5), lambda: narrow.evaluate(2, 1, 0, 0, 5, 2, 4)):
        with pytest.raises(ValueError, match=r"lengths_or_mask is a bool mask \[B, 3\].*Nk = [45]"):
            call()


def test_bool_key_padding_wider_than_nk_is_the_mask_of_the_first_keys() -> None:
    """A mask over the whole sequence, used by a call that sees its first Nk keys (a cached or
    chunked call, e.g. StreamingAttention's sink part), reads the first Nk columns, on every path."""
    import attnzoo as az

    real = torch.tensor([[1, 0, 1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    wide = M.key_padding(real)
    assert torch.equal(wide.materialize(2, 1, 5, 5), M.key_padding(real[:, :5]).materialize(2, 1, 5, 5))
    q = torch.randn(2, 2, 5, 8)
    want = az.attention(q, q, q, mask=real[:, None, None, :5], backend="reference")
    for backend in _backends():
        torch.testing.assert_close(az.attention(q, q, q, mask=wide, backend=backend), want)


@pytest.mark.parametrize("backend", _backends())
def test_key_padding_of_the_right_width_and_lengths_still_work(backend: str) -> None:
    """The valid forms: a bool mask [B, Nk], and lengths <= Nk (the lengths form has no fixed width)."""
    import attnzoo as az

    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    real = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    want = az.attention(q, k, v, mask=real[:, None, None, :], backend="reference")
    torch.testing.assert_close(az.attention(q, k, v, mask=M.key_padding(real), backend=backend), want)
    torch.testing.assert_close(az.attention(q, k, v, mask=M.key_padding([3, 5]), backend=backend), want)
    assert torch.equal(M.key_padding(real).materialize(2, 1, 4, 5), M.key_padding([3, 5]).materialize(2, 1, 4, 5))


@pytest.mark.parametrize("backend", _backends())
def test_document_ids_shorter_than_the_positions_are_refused(backend: str) -> None:
    """A6: doc_ids [0, 0, 1] with Nq = Nk = 5 clamped positions 3, 4 to the last document."""
    import attnzoo as az

    q = torch.randn(1, 2, 5, 8)
    short = M.document(torch.tensor([0, 0, 1]))
    for call in (lambda: short.materialize(1, 1, 5, 5), lambda: short.block_map(1, 1, 5, 5, 2, 2),
                 lambda: az.attention(q, q, q, mask=short & M.causal(), backend=backend)):
        with pytest.raises(ValueError, match=r"doc_ids has length 3.*Nk = 5"):
            call()
    # queries beyond the table: 2 queries after 4 keys need positions 0..5
    with pytest.raises(ValueError, match=r"doc_ids has length 5.*q_offset \+ Nq = 6"):
        M.document(torch.arange(5)).materialize(1, 1, 2, 4, q_offset=4)


def test_document_ids_that_cover_the_positions_still_work() -> None:
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    rule = torch.tensor([[bool(ids[p] == ids[j]) for j in range(5)] for p in range(3, 6)])
    got = M.document(ids).materialize(1, 1, 3, 5, q_offset=3)[0, 0]  # decoding-like: queries 3..5
    assert torch.equal(got, rule)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    import attnzoo as az

    want = az.attention(q, k, v, mask=rule, q_offset=3, backend="reference")
    for backend in _backends():
        torch.testing.assert_close(az.attention(q, k, v, mask=M.document(ids), q_offset=3, backend=backend), want)


def test_prefix_lm_tensor_must_hold_ints_at_least_zero() -> None:
    """A23: a bool tensor and negative lengths were accepted (the int form already refused -1)."""
    with pytest.raises(TypeError, match="prefix_len"):
        M.prefix_lm(torch.tensor([True, False]))
    with pytest.raises(TypeError, match="prefix_len"):
        M.prefix_lm(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"prefix_len must be >= 0, got \[-3, 2\]"):
        M.prefix_lm(torch.tensor([-3, 2]))
    with pytest.raises(ValueError, match="prefix_len"):
        M.prefix_lm(torch.tensor([[1, 2]]))
    per_row = M.prefix_lm(torch.tensor([0, 2])).materialize(2, 1, 4, 4)
    assert torch.equal(per_row[0], M.prefix_lm(0).materialize(1, 1, 4, 4)[0])
    assert torch.equal(per_row[1], M.prefix_lm(2).materialize(1, 1, 4, 4)[0])
    assert torch.equal(M.prefix_lm(torch.tensor(2)).materialize(1, 1, 4, 4), M.prefix_lm(2).materialize(1, 1, 4, 4))


def test_global_tokens_bad_positions_name_the_argument() -> None:
    """C8: an int or None was an internal 'int object is not iterable'."""
    for bad in (0, None, "0", 1.5):
        with pytest.raises(TypeError, match="positions"):
            M.global_tokens(bad)
    for bad in (("a",), [1.5], [True], torch.tensor([0.0]), torch.tensor([True])):
        with pytest.raises(TypeError, match="positions"):
            M.global_tokens(bad)
    with pytest.raises(ValueError, match="positions"):
        M.global_tokens(torch.tensor([[0, 1]]))
    assert torch.equal(M.global_tokens(range(2)).materialize(1, 1, 4, 4),
                       M.global_tokens(torch.tensor([0, 1])).materialize(1, 1, 4, 4))


def test_global_tokens_at_a_far_position_allocate_no_table() -> None:
    """C8: global_tokens([10**13]) allocated a 10 TB table (RuntimeError); a far position now costs
    nothing and changes nothing inside a short sequence."""
    near = M.sliding_window(1, 1) | M.global_tokens([1])
    far = M.sliding_window(1, 1) | M.global_tokens([1, 10**13])
    assert torch.equal(far.materialize(1, 1, 6, 6), near.materialize(1, 1, 6, 6))
    assert torch.equal(far.block_map(1, 1, 6, 6, 2, 2), near.block_map(1, 1, 6, 6, 2, 2))
    assert not M.global_tokens([10**13]).materialize(1, 1, 3, 3).any()
    at_end = M.global_tokens([(1 << 20) + 2]).materialize(1, 1, 1, (1 << 20) + 4, q_offset=0)[0, 0, 0]
    assert at_end.nonzero().flatten().tolist() == [(1 << 20) + 2]


def test_visible_checks_its_arguments() -> None:
    """C10: lists were an AttributeError, an int window a TypeError 'cannot unpack', causal='no' was
    True and a negative window side was accepted."""
    q, k = torch.arange(6).view(-1, 1), torch.arange(6).view(1, -1)
    with pytest.raises(TypeError, match="q_pos"):
        M.visible([0, 1], [0, 1])
    with pytest.raises(TypeError, match="k_pos"):
        M.visible(q, [0, 1])
    with pytest.raises(TypeError, match="q_pos"):
        M.visible(q.float(), k)
    with pytest.raises(TypeError, match="causal"):
        M.visible(q, k, causal="no")
    with pytest.raises(ValueError, match="window"):
        M.visible(q, k, window=(-1, 0))
    with pytest.raises(ValueError, match="window"):
        M.visible(q, k, window=-2)
    with pytest.raises(TypeError, match="window"):
        M.visible(q, k, window=(1, 2, 3))
    # an int window is (w, w), as in attnzoo.attention
    assert torch.equal(M.visible(q, k, window=3), M.visible(q, k, window=(3, 3)))
    assert torch.equal(M.visible(q, k, window=3), visible_table(1, 1, 6, 6, window=(3, 3), q_offset=0)[0, 0])


def test_a_predicate_whose_result_does_not_broadcast_to_the_tile_is_refused() -> None:
    """``evaluate`` accepts results of size 1 or the tile's on each (right-aligned) dimension, and
    names the predicate and both shapes otherwise (a result larger than the tile, or of 5 dims)."""
    ok = M.Mask(lambda b, h, q, k: (q >= k).expand(1, 1, -1, -1), name="ok")
    assert tuple(ok.evaluate(2, 3, 0, 0, 4, 0, 5).shape) == (2, 3, 4, 5)
    rows = M.Mask(lambda b, h, q, k: (q >= 0).expand(1, 1, -1, 1), name="rows")  # [1, 1, Nq, 1]
    assert rows.evaluate(1, 1, 0, 0, 3, 0, 2).all()
    for name, fn in (("wide", lambda b, h, q, k: torch.ones(1, 1, 4, 7, dtype=torch.bool)),
                     ("heads", lambda b, h, q, k: torch.ones(1, 2, 4, 5, dtype=torch.bool)),
                     ("five", lambda b, h, q, k: torch.ones(1, 1, 1, 4, 5, dtype=torch.bool))):
        with pytest.raises(ValueError, match=rf"Mask {name}: predicate returned shape .* does not broadcast to"):
            M.Mask(fn, name=name).evaluate(1, 3, 0, 0, 4, 0, 5)
