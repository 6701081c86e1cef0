"""The tile plan of the ``tiled`` backend: tile sizes (:class:`TileConfig`), which key chunks every
query block visits (:class:`TilePlan`), sliding-window bands and the plan cache."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from attnzoo._validate import check_int
from attnzoo.functional.core._request import AttnRequest
from attnzoo.masks import BLOCK_EMPTY, BLOCK_FULL, Mask

__all__ = ["DEFAULT_TILES", "Band", "Chunk", "TileConfig", "TilePlan", "current_tiles", "tile_plan", "use_tiles"]


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and memory caps of the ``tiled`` backend (all counts of elements or rows).

    The defaults (:data:`DEFAULT_TILES`) were measured on the 2-core AVX2 machine (B=1, H=8, D=64,
    causal N=4096): with chunks of at most 512 keys a 128 x 512 float32 score tile stays in a
    core's L2 cache, and the forward ran 10-20% (forward+backward 25%) faster than with 256-row
    blocks and 2048-key chunks. With ``row_elems > 0`` a query block whose keys form one run of at
    most ``row_elems`` scores (all heads) skips the chunks: one softmax over the whole row. It is off
    by default (``0``), decided by measurement on the 2-core Xeon (docs/performance.md, N=4096 causal,
    2 threads): 1.66x SDPA's time against the chunks' 1.30x quiet, 2.91x against 1.75x with two busy
    processes; it was faster only while other users' jobs held the cores (1.1-4.5x). Tests pass small
    sizes (:func:`use_tiles`) so that small inputs cross many tiles."""

    block_q: int = 128  #: query rows per block
    block_k: int = 128  #: key tile size of the block map
    max_chunk_k: int = 512  #: longest key chunk processed at once
    merge_k: int = 512  #: neighbouring runs shorter than this are merged into one chunk
    min_band_block: int = 32  #: smallest query block used for sliding-window bands
    band_elems: int = 1 << 22  #: score elements of one forward band batch
    min_tail_block: int = 8  #: smallest query sub-block the last band pieces shrink to
    backward_band_elems: int = 1 << 21  #: score elements of one backward band piece
    row_elems: int = 0  #: score elements of one whole-row softmax (forward, see forward._forward_row; 0: off)
    flat_elems: int = 1 << 20  #: score elements of one group of head-flattened window blocks (forward, see .flat; 0: off)

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(getattr(self, f.name), f.name, minimum=0 if f.name in _SWITCHABLE else 1, owner="TileConfig")


#: ``TileConfig`` fields whose 0 turns their fast path off (the per-chunk / per-head band paths run).
_SWITCHABLE = frozenset({"row_elems", "flat_elems"})


#: The tile sizes every call uses unless :func:`use_tiles` says otherwise.
DEFAULT_TILES = TileConfig()

_tiles: contextvars.ContextVar[TileConfig] = contextvars.ContextVar("attnzoo_tiles", default=DEFAULT_TILES)


def current_tiles() -> TileConfig:
    """The :class:`TileConfig` in effect (:data:`DEFAULT_TILES` outside :func:`use_tiles`)."""
    return _tiles.get()


@contextlib.contextmanager
def use_tiles(tiles: TileConfig) -> Iterator[TileConfig]:
    """Run the ``tiled`` backend with ``tiles`` inside the ``with`` block (this thread/context only)::

        with attnzoo.functional.backends.tiled.use_tiles(TileConfig(block_q=8, block_k=4, max_chunk_k=12, merge_k=8)):
            out = az.attention(q, k, v, causal=True, backend="tiled")
    """
    if not isinstance(tiles, TileConfig):
        raise TypeError(f"use_tiles: tiles must be a TileConfig, got {type(tiles).__name__}")
    token = _tiles.set(tiles)
    try:
        yield tiles
    finally:
        _tiles.reset(token)


@dataclass(frozen=True)
class Chunk:
    k_lo: int
    k_hi: int
    needs_mask: bool


@dataclass(frozen=True)
class TilePlan:
    """Which key chunks every query block visits."""

    block_q: int
    block_k: int
    n_q_blocks: int
    n_k_blocks: int
    n_tiles: int  # non-empty (q_block, k_block) tiles
    rows: tuple[tuple[Chunk, ...], ...]  # per query block
    bands: tuple[Band, ...] = ()  # runs of query blocks computed together (forward)
    tiles: TileConfig = DEFAULT_TILES  # the sizes and caps the plan was made with


@dataclass(frozen=True)
class Band:
    """``count`` consecutive query blocks from ``first``, each seeing one chunk of ``width`` keys
    that starts ``block_q`` keys after the previous one (a sliding window's interior)."""

    first: int
    count: int
    k_lo: int
    width: int
    needs_mask: bool

    def part(self, offset: int, count: int, block_q: int) -> Band:
        """The ``count`` blocks of this band from its ``offset``-th block (their window slides along)."""
        return Band(self.first + offset, count, self.k_lo + offset * block_q, self.width, self.needs_mask)


#: Plans kept for requests whose pattern is fully described by plain values (see ``tile_plan``).
PLAN_CACHE_SIZE = 64
_plan_cache: OrderedDict[tuple, TilePlan] = OrderedDict()
_plan_cache_lock = threading.Lock()


def tile_plan(r: AttnRequest, block_q: int | None = None, block_k: int | None = None,
              tiles: TileConfig | None = None) -> TilePlan:
    """Plan the visit of ``r``: skip tiles empty for every (batch, head), mask only partial ones.

    ``block_q``/``block_k`` default to those of ``tiles`` (default: :func:`current_tiles`).

    Plans of requests whose pattern is only ``causal`` / ``window`` (no mask tensor or ``Mask``
    object) depend on a few integers, so the last ``PLAN_CACHE_SIZE`` are kept and reused, as a
    FlexAttention user keeps a block mask: a repeated call at one shape builds no plan (no time,
    no memory). Plans are immutable."""
    tiles = tiles or _tiles.get()
    block_q = block_q or tiles.block_q
    block_k = block_k or tiles.block_k
    if r.mask_tensor is not None or r.mask_obj is not None:
        return _build_plan(r, block_q, block_k, tiles)
    key = (r.causal, r.window, r.q_offset, r.batch, r.hq, r.nq, r.nk, block_q, block_k, tiles)
    with _plan_cache_lock:
        plan = _plan_cache.get(key)
        if plan is not None:
            _plan_cache.move_to_end(key)
            return plan
    plan = _build_plan(r, block_q, block_k, tiles)
    with _plan_cache_lock:
        _plan_cache[key] = plan
        while len(_plan_cache) > PLAN_CACHE_SIZE:
            _plan_cache.popitem(last=False)
    return plan


def _block_classes(r: AttnRequest, n_qb: int, n_kb: int, block_q: int, block_k: int) -> torch.Tensor:
    """int8 ``[nQB, nKB]``: each tile empty, partial or full for every (batch, head)."""
    s = r.structure
    if s is None:
        cls = torch.full((n_qb, n_kb), BLOCK_FULL, dtype=torch.int8)
    else:
        bm = s.block_map(r.batch, r.hq if _head_dependent(s) else 1, r.nq, r.nk, block_q, block_k,
                         q_offset=r.q_offset)
        # Reduce over batch and heads: empty only if empty everywhere, full only if full everywhere.
        lo = bm.amin(dim=(0, 1))
        hi = bm.amax(dim=(0, 1))
        cls = torch.where(hi == BLOCK_EMPTY, BLOCK_EMPTY, torch.where(lo == BLOCK_FULL, BLOCK_FULL, 1)).to(torch.int8)
    if r.bool_mask is not None:  # a dense bool tensor is not analysed: its tiles are partial
        cls = torch.where(cls == BLOCK_FULL, torch.ones_like(cls), cls)
    return cls


def _build_plan(r: AttnRequest, block_q: int, block_k: int, tiles: TileConfig) -> TilePlan:
    n_qb = -(-r.nq // block_q)
    n_kb = -(-r.nk // block_k)
    cls = _block_classes(r, n_qb, n_kb, block_q, block_k)
    # Visit the non-empty tiles only (row-major, so columns ascend within a row): a window over a
    # long sequence has a few tiles per row out of thousands.
    nz = (cls != BLOCK_EMPTY).nonzero()  # [T, 2]
    tile_i, tile_j = nz[:, 0].tolist(), nz[:, 1].tolist()
    tile_kind = cls[nz[:, 0], nz[:, 1]].tolist()
    n_tiles = len(tile_i)
    row_runs: list[list[list[int]]] = [[] for _ in range(n_qb)]  # per row: [k_block_lo, k_block_hi, kind]
    for i, j, c in zip(tile_i, tile_j, tile_kind, strict=True):
        runs = row_runs[i]
        kind = 0 if c == BLOCK_FULL else 1
        if runs and runs[-1][1] == j and runs[-1][2] == kind:
            runs[-1][1] = j + 1
        else:
            runs.append([j, j + 1, kind])
    rows = [_row_chunks(runs, r.nk, block_k, tiles) for runs in row_runs]
    bands = _find_bands(r, rows, block_q, tiles.band_elems) if r.mask_tensor is None else ()
    return TilePlan(block_q, block_k, n_qb, n_kb, n_tiles, tuple(rows), bands, tiles)


def _row_chunks(runs: list[list[int]], nk: int, block_k: int, tiles: TileConfig) -> tuple[Chunk, ...]:
    """One query block's runs of key tiles ``[lo, hi, kind]`` as chunks of at most ``max_chunk_k``."""
    # Merge adjacent short runs (fewer, larger matmuls beat skipping a mask on a few tiles).
    merged: list[list[int]] = []
    for run in runs:
        if merged and merged[-1][1] == run[0] and (run[1] - merged[-1][0]) * block_k <= tiles.merge_k:
            merged[-1][1] = run[1]
            merged[-1][2] = max(merged[-1][2], run[2])
        else:
            merged.append(list(run))
    chunks: list[Chunk] = []
    per = max(1, tiles.max_chunk_k // block_k)
    for j0, j1, kind in merged:
        for a in range(j0, j1, per):
            b = min(j1, a + per)
            chunks.append(Chunk(a * block_k, min(nk, b * block_k), bool(kind)))
    return tuple(chunks)


def _find_bands(r: AttnRequest, rows: list[tuple[Chunk, ...]], block_q: int, band_elems: int) -> tuple[Band, ...]:
    """Group query blocks whose single key chunk slides by ``block_q`` with a constant width."""
    bands: list[Band] = []
    i = 0
    n = len(rows)
    while i < n:
        row = rows[i]
        if len(row) != 1 or (i + 1) * block_q > r.nq:
            i += 1
            continue
        c = row[0]
        width = c.k_hi - c.k_lo
        per_block = r.batch * r.hq * block_q * width
        cap = max(1, band_elems // max(1, per_block))
        j = i + 1
        while (j < n and j - i < cap and len(rows[j]) == 1 and (j + 1) * block_q <= r.nq
               and rows[j][0].k_hi - rows[j][0].k_lo == width
               and rows[j][0].k_lo == c.k_lo + (j - i) * block_q):
            j += 1
        if j - i >= 2:
            bands.append(Band(i, j - i, c.k_lo, width, any(rows[t][0].needs_mask for t in range(i, j))))
        i = j
    return tuple(bands)


def _head_dependent(m: Mask) -> bool:
    # Builders never read the head index; a custom predicate might, so give it every head.
    return any(leaf._tiles is None and leaf.name != "document" for leaf in m._leaves())


def band_plan(r: AttnRequest, plan: TilePlan) -> TilePlan:
    """A sliding window's plan with smaller query blocks, or ``plan`` itself.

    When bands cover most query blocks, smaller query blocks waste fewer masked scores per band
    row (width = block + window), and bands keep the number of Python steps small."""
    if not plan.bands or 2 * sum(b.count for b in plan.bands) < plan.n_q_blocks:
        return plan
    reach = max(b.width for b in plan.bands) - plan.block_q
    bq = max(plan.tiles.min_band_block, min(plan.block_q, 1 << max(0, (max(1, reach) - 1).bit_length() - 2)))
    if bq < plan.block_q:
        return tile_plan(r, bq, min(bq, plan.block_k), plan.tiles)
    return plan
