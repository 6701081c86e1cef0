"""The round-3 masks (issue 36): chunked, blockwise, bidirectional and dilated windows, NATTEN's 2-D
neighbourhood and ``Mask.from_mask_mod``, each against a Python loop over scalar positions written
from its definition; their tile maps are exact (no hidden pair in a tile marked empty, no hidden
pair in one marked full) and the tiled backend skips the empty tiles."""

from __future__ import annotations

import pytest
import torch
from tests.oracle import oracle_attention

import attnzoo as az
from attnzoo.functional.backends.tiled import TileConfig, tile_plan, use_tiles
from attnzoo.functional.core._request import build_request
from attnzoo.masks import (
    BLOCK_EMPTY,
    BLOCK_FULL,
    Mask,
    blockwise,
    chunked,
    dilated_window,
    neighborhood_2d,
)


def _table(rule, b: int, n_q: int, n_k: int, q_offset: int = 0) -> torch.Tensor:
    """Bool [b, 1, n_q, n_k] from a scalar rule(batch, q_pos, k_pos)."""
    return torch.tensor([[[[bool(rule(bi, q_offset + i, j)) for j in range(n_k)] for i in range(n_q)]]
                         for bi in range(b)])


def _natten_1d(i: int, length: int, kernel: int, dilation: int) -> set[int]:
    """NATTEN's neighbourhood along one axis, written from its definition: the query's residue
    class mod ``dilation`` forms a sub-axis, on which the window of ``kernel`` entries is centred
    on the query and shifted inside the sub-axis at its ends."""
    sub = list(range(i % dilation, length, dilation))
    at = sub.index(i)
    start = min(max(at - kernel // 2, 0), len(sub) - kernel)
    return set(sub[start:start + kernel])


def _check_block_map(m: Mask, dense: torch.Tensor, bq: int, bk: int, q_offset: int = 0) -> None:
    b, _, n_q, n_k = dense.shape
    bm = m.block_map(b, 1, n_q, n_k, bq, bk, q_offset=q_offset)
    for i in range(bm.shape[2]):
        for j in range(bm.shape[3]):
            tile = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            for bi in range(b):
                if bm[bi, 0, i, j] == BLOCK_EMPTY:
                    assert not tile[bi].any(), (i, j)
                if bm[bi, 0, i, j] == BLOCK_FULL:
                    assert tile[bi].all(), (i, j)


@pytest.mark.parametrize("size, start", [(4, 0), (5, 2), (3, torch.tensor([0, 2]))])
def test_chunked(size: int, start) -> None:
    n = 17
    m = chunked(size, start)
    off = [0, 0] if not isinstance(start, torch.Tensor) else start.tolist()
    off = off if isinstance(start, torch.Tensor) else [start, start]
    want = _table(lambda b, p, j: (p - off[b]) // size == (j - off[b]) // size, 2, n, n)
    assert torch.equal(m.materialize(2, 1, n, n), want)
    _check_block_map(m, want, 4, 4)
    bm = m.block_map(2, 1, n, n, 4, 4)
    assert (bm == BLOCK_EMPTY).any() and (bm == BLOCK_FULL).any() if size == 4 else True


def test_chunked_attention_skips_other_chunks() -> None:
    """Llama 4's chunked causal layer: the tiled plan visits only the diagonal chunks' tiles, and the
    result equals the float64 oracle."""
    n, size = 64, 16
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for _ in range(3))
    m = chunked(size)
    r = build_request(q.float(), k.float(), v.float(), mask=m, causal=True, window=None, q_offset=None,
                      scale=None, softcap=None, alibi_slopes=None, dropout_p=0.0, return_lse=False,
                      return_weights=False)
    plan = tile_plan(r, 8, 8, TileConfig(block_q=8, block_k=8, max_chunk_k=8, merge_k=8))
    assert plan.n_tiles == (n // size) * (size // 8) * (size // 8 + 1) // 2  # causal triangles of each chunk
    with use_tiles(TileConfig(block_q=8, block_k=8, max_chunk_k=16, merge_k=8)):
        got = az.attention(q.float(), k.float(), v.float(), mask=m, causal=True, backend="tiled")
    want, _ = oracle_attention(q, k, v, causal=True, mask=lambda b, h, p, j: (p // size) == (j // size))
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


def test_blockwise_and_bidirectional_window() -> None:
    ids = torch.tensor([[-1, 0, 0, 0, -1, -1, 1, 1, -1], [2, 2, -1, -1, -1, -1, -1, 3, 3]])
    n = ids.shape[1]
    m = az.masks.causal() | blockwise(ids)
    want = _table(lambda b, p, j: j <= p or (ids[b, p] == ids[b, j] and ids[b, p] >= 0), 2, n, n)
    assert torch.equal(m.materialize(2, 1, n, n), want)
    w = az.masks.bidirectional_window(2)
    assert torch.equal(w.materialize(1, 1, n, n), _table(lambda b, p, j: abs(p - j) <= 2, 1, n, n))


@pytest.mark.parametrize("left, right, d", [(3, 0, 2), (2, 2, 3), (4, 1, 1)])
def test_dilated_window(left: int, right: int, d: int) -> None:
    n = 23
    m = dilated_window(left, right, d)
    want = _table(lambda b, p, j: any(j == p + t * d for t in range(-left, right + 1)), 1, n, n)
    assert torch.equal(m.materialize(1, 1, n, n), want)
    _check_block_map(m, want, 4, 4)


@pytest.mark.parametrize("h, w, kernel, dil", [(5, 6, 3, 1), (6, 7, (3, 5), 1), (8, 9, 3, 2), (7, 7, 3, (2, 1))])
def test_neighborhood_2d_matches_natten_rule(h: int, w: int, kernel, dil) -> None:
    kh, kw = kernel if isinstance(kernel, tuple) else (kernel, kernel)
    dh, dw = dil if isinstance(dil, tuple) else (dil, dil)
    n = h * w

    def rule(b: int, p: int, j: int) -> bool:
        return (j // w in _natten_1d(p // w, h, kh, dh)) and (j % w in _natten_1d(p % w, w, kw, dw))

    m = neighborhood_2d(h, w, kernel, dil)
    want = _table(rule, 1, n, n)
    assert torch.equal(m.materialize(1, 1, n, n), want)
    assert (want.sum(-1) == kh * kw).all()  # windows are shifted, never cut, at the edges
    with pytest.raises(ValueError, match="fit the grid"):
        neighborhood_2d(3, 3, 5)


def test_from_mask_mod_flamingo_style_and_tiles_skipped() -> None:
    """attention-gym style scalar mask_mods: one that indexes a captured tensor (Flamingo: text token
    ``q`` sees the image tokens of the latest image before it), one with ``torch.where``. The plan
    of a mask_mod that hides whole tiles skips them."""
    n = 24
    image_of = torch.tensor([-1] * 4 + [0] * 4 + [-1] * 6 + [1] * 4 + [-1] * 6)  # image id per key (-1: text)
    latest = torch.tensor([-1] * 4 + [0] * 10 + [1] * 10)  # latest image before each query

    def flamingo(b, h, q_idx, kv_idx):
        return (image_of[kv_idx] == latest[q_idx]) & (latest[q_idx] >= 0)

    m = Mask.from_mask_mod(flamingo)
    want = _table(lambda b, p, j: bool(image_of[j] == latest[p]) and bool(latest[p] >= 0), 1, n, n)
    assert torch.equal(m.materialize(1, 1, n, n), want)

    def local(b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, q_idx - kv_idx < 4, torch.zeros((), dtype=torch.bool))

    ml = Mask.from_mask_mod(local)
    want_l = _table(lambda b, p, j: 0 <= p - j < 4, 1, n, n)
    assert torch.equal(ml.materialize(1, 1, n, n), want_l)
    q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
    r = build_request(q, k, v, mask=ml, causal=False, window=None, q_offset=None, scale=None, softcap=None,
                      alibi_slopes=None, dropout_p=0.0, return_lse=False, return_weights=False)
    plan = tile_plan(r, 4, 4, TileConfig(block_q=4, block_k=4, max_chunk_k=4, merge_k=4))
    assert plan.n_tiles == 2 * (n // 4) - 1  # the diagonal and the one below it
    with use_tiles(TileConfig(block_q=4, block_k=4, max_chunk_k=8, merge_k=4)):
        got = az.attention(q, k, v, mask=ml, backend="tiled")
    torch.testing.assert_close(got, az.attention(q, k, v, mask=want_l, backend="reference"))


@pytest.mark.parametrize("backend", ["reference", "tiled", "flex", "sdpa", "auto"])
def test_from_mask_mod_drives_every_backend(backend: str) -> None:
    """The same mask_mod object on every backend that takes a Mask, flex included (whose own vmap
    calls the predicate with 0-d positions), equal to the float64 oracle on the dense table."""
    if backend not in az.available_backends():
        pytest.skip(f"{backend} is not available here")
    n = 12
    doc = torch.tensor([0] * 5 + [1] * 7)

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
    want = _table(lambda b, p, j: bool(doc[p] == doc[j]) and p >= j, 1, n, n)
    got = az.attention(q, k, v, mask=Mask.from_mask_mod(same_doc_causal), backend=backend)
    torch.testing.assert_close(got.double(), oracle_attention(q, k, v, mask=want)[0],
                               atol=1e-5, rtol=1e-5)


def test_from_mask_mod_bad_input() -> None:
    with pytest.raises(TypeError, match="from_mask_mod"):
        Mask.from_mask_mod(3)

    def branchy(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if q_idx > 3 else q_idx == kv_idx  # Python branch on a tensor: fails under vmap

    with pytest.raises(ValueError, match="vmap"):
        Mask.from_mask_mod(branchy).materialize(1, 1, 6, 6)


def test_hf_chunked_and_blockwise_masks_are_structure() -> None:
    """transformers' chunked causal mask (left padding shifts the chunks) and blockwise overlay reach
    attention as a Mask, equal to transformers' own dense mask, with the same attention output."""
    mu = pytest.importorskip("transformers.masking_utils")
    from attnzoo.hf import HFMask, attnzoo_attention_forward, attnzoo_mask

    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10]).bool()
    lp = (pad.cumsum(-1) == 0).sum(-1)
    ids = torch.tensor([[-1, -1, 0, 0, 0, -1, 1, 1, -1, -1], [-1] * 4 + [2] * 3 + [-1] * 3])
    cases = [
        (mu.chunked_causal_mask_function(3, lp), 10, 0),
        (mu.chunked_causal_mask_function(4, lp), 4, 6),  # decoding-like: 4 queries after 6 cached keys
        (mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids)), 10, 0),
        (mu.or_masks(mu.sliding_window_causal_mask_function(3), mu.blockwise_overlay(ids)), 10, 0),
    ]
    torch.manual_seed(0)
    for fn, nq, q_off in cases:
        got = attnzoo_mask(2, nq, 10, q_offset=q_off, kv_offset=0, mask_function=fn, attention_mask=pad)
        assert isinstance(got, HFMask) and got.structure is not None
        want = mu.sdpa_mask(batch_size=2, q_length=nq, kv_length=10, q_offset=q_off, kv_offset=0, mask_function=fn,
                            attention_mask=pad, allow_is_causal_skip=False)
        assert torch.equal(got.to_dense(), want.expand(2, 1, nq, 10))
        q, k, v = torch.randn(2, 2, nq, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
        module = torch.nn.Module()
        out, _ = attnzoo_attention_forward(module, q, k, v, got, scaling=0.3)
        ref, _ = attnzoo_attention_forward(module, q, k, v, want, scaling=0.3)
        torch.testing.assert_close(out, ref)


def test_blockwise_ids_shorter_than_the_positions_are_refused() -> None:
    """A6: block_ids [0, 0, 1] with Nq = Nk = 5 treated positions 3, 4 as text without a word."""
    short = az.masks.causal() | blockwise(torch.tensor([0, 0, 1]))
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"block_ids has length 3.*Nk = 5"):
        short.materialize(1, 1, 5, 5)
    with pytest.raises(ValueError, match=r"block_ids has length 3"):
        short.block_map(1, 1, 5, 5, 2, 2)
    for backend in [*az.available_backends(), "auto"]:
        with pytest.raises(ValueError, match=r"block_ids has length 3"):
            az.attention(q, q, q, mask=short, backend=backend)
    # ids that cover every position still work, queries after cached keys included
    ids = torch.tensor([-1, 0, 0, -1, 1, 1])
    want = _table(lambda b, p, j: j <= p or (ids[p] == ids[j] and ids[p] >= 0), 1, 2, 6, q_offset=4)
    assert torch.equal((az.masks.causal() | blockwise(ids)).materialize(1, 1, 2, 6, q_offset=4), want)


@pytest.mark.parametrize("kernel, dilation, name", [((3,), 1, "kernel"), ((3, 3, 3), 1, "kernel"),
                                                    (3, (1, 1, 1), "dilation"), (3, (), "dilation")])
def test_neighborhood_2d_pairs_of_another_length_name_the_argument(kernel, dilation, name: str) -> None:
    """C9: a kernel (3,) or (3, 3, 3) was an unpacking ValueError that named nothing."""
    with pytest.raises(ValueError, match=f"neighborhood_2d: {name} must be an int or a pair"):
        neighborhood_2d(6, 6, kernel, dilation)


def test_neighborhood_2d_takes_a_list_pair_as_a_tuple() -> None:
    assert torch.equal(neighborhood_2d(6, 7, [3, 5], [1, 1]).materialize(1, 1, 42, 42),
                       neighborhood_2d(6, 7, (3, 5), 1).materialize(1, 1, 42, 42))
