"""Closed-form cost formulas the variants' cost functions share (Python ints, no tensors).

Every count here is O(1) or O(G^2) in the number of global tokens ``G``, never O(N): an estimate
at ``N = 10^9`` is instant. Conventions of :mod:`attnzoo.cost`: FLOPs count multiply-adds as 2,
matrix products only; pairs are (query, key) pairs per batch element and head.

* :func:`visible_pairs`: the pairs a pattern lets attend (causal, window, global tokens, segments).
* :func:`block_pairs`: the pairs a tiled kernel computes when it visits every non-empty
  ``BLOCK x BLOCK`` tile of that pattern (``tiled``: rows x keys of the visited chunks; ``flex``:
  whole tiles).
* :func:`softmax_cost`: projections + softmax attention on a backend, activation memory, cache.
"""

from __future__ import annotations

from functools import lru_cache

from attnzoo.nn.spec import Cost, CostShape, VariantConfig

__all__ = ["BLOCK", "block_pairs", "projection_cost", "resolve_backend", "softmax_cost", "visible_pairs"]

#: Query rows and keys per tile assumed for the tiled and flex backends (their default block map).
BLOCK = 128


# --------------------------------------------------------------------------- sums in O(1)
def _sum_clip(m: int, c: int, lo: int | None, hi: int | None) -> int:
    """``sum(clip(i + c, lo, hi) for i in range(m))`` in O(1) (``None`` = unbounded side)."""
    if m <= 0:
        return 0
    k_lo = 0 if lo is None else min(m, max(0, lo - c))  # i with i + c < lo
    k_hi = 0 if hi is None else min(m - k_lo, max(0, m - (hi - c + 1)))  # i with i + c > hi
    a, b = k_lo + c, (m - k_hi - 1) + c  # the unclipped run of values a..b
    middle = (a + b) * (b - a + 1) // 2 if b >= a else 0
    return k_lo * (lo or 0) + k_hi * (hi or 0) + middle


def _row_span(p: int, n: int, window: tuple[int | None, int | None] | None, causal: bool) -> tuple[int, int]:
    """First and last key the query at ``p`` sees through causal/window (``n`` keys)."""
    left, right = window if window is not None else (None, None)
    lo = 0 if left is None else max(0, p - left)
    hi = n - 1 if right is None else min(n - 1, p + right)
    return lo, min(hi, p) if causal else hi


def visible_pairs(cfg: VariantConfig, n: int) -> int:
    """Pairs the config lets attend over ``n`` tokens (self-attention, per batch element and head)."""
    if cfg.segment_len is not None:  # causal softmax inside each segment
        s = cfg.segment_len
        full, rest = divmod(n, s)
        return full * s * (s + 1) // 2 + rest * (rest + 1) // 2
    left, right = cfg.window if cfg.window is not None else (None, None)
    sum_lo = 0 if left is None else _sum_clip(n, -left, 0, None)
    if cfg.causal:
        sum_hi = n * (n - 1) // 2
    elif right is None:
        sum_hi = n * (n - 1)
    else:
        sum_hi = _sum_clip(n, right, None, n - 1)
    total = sum_hi - sum_lo + n
    return total + _global_extra(cfg, n)


def _global_extra(cfg: VariantConfig, n: int) -> int:
    """Pairs the global tokens add to the window pattern: their columns, then their full rows."""
    gs = sorted({g for g in cfg.global_tokens if 0 <= g < n})
    if not gs:
        return 0
    left, right = cfg.window if cfg.window is not None else (None, None)
    extra = 0
    for g in gs:  # column g, in rows whose window misses it
        if left is not None:
            extra += max(0, n - 1 - (g + left))
        if not cfg.causal and right is not None:
            extra += max(0, g - right)
    for g in gs:  # row g sees everything (up to itself when causal)
        lo, hi = _row_span(g, n, cfg.window, cfg.causal)
        cols = sum(1 for h in gs if (h < lo or h > hi) and (h <= g or not cfg.causal))
        extra += (g + 1 if cfg.causal else n) - (hi - lo + 1 + cols)
    return extra


# --------------------------------------------------------------------------- tiles
def _block_direct(cfg: VariantConfig, n: int, i: int, gs: list[int], rows: bool = True) -> tuple[int, int]:
    """``(keys, tiles)`` the tiled kernel visits for query block ``i`` (one block, directly);
    ``rows=False`` ignores that the block may hold global queries (their full rows)."""
    nkb = -(-n // BLOCK)
    a, b = i * BLOCK, min(n, (i + 1) * BLOCK)

    def keys_of(t: int) -> int:
        return min(n, (t + 1) * BLOCK) - t * BLOCK

    if rows and any(a <= g < b for g in gs):  # a global query block: every visible tile
        last = (b - 1) // BLOCK if cfg.causal else nkb - 1
        return min(n, (last + 1) * BLOCK), last + 1
    klo, khi = _row_span(a, n, cfg.window, cfg.causal)[0] // BLOCK, _row_span(b - 1, n, cfg.window, cfg.causal)[1] // BLOCK
    tiles = set(range(klo, khi + 1))
    tiles |= {g // BLOCK for g in gs if not cfg.causal or g <= b - 1}
    return sum(keys_of(t) for t in tiles), len(tiles)


def _bulk_window(cfg: VariantConfig, n: int, m: int) -> tuple[int, int, int | None, int | None]:
    """Sums over the ``m`` full query blocks ``i`` of their first and last key tiles
    ``kbl_i = max(0, i + c_l)`` and ``kbh_i = min(nkb - 1, i + c_h)``: ``(sum(kbh + 1), sum(kbl), c_l,
    c_h)``, with ``c_l`` / ``c_h`` ``None`` for an unbounded side (``kbl = 0``, ``kbh = nkb - 1``)."""
    nkb = -(-n // BLOCK)
    left, right = cfg.window if cfg.window is not None else (None, None)
    c_l = None if left is None else (-left) // BLOCK
    sum_kbl = 0 if c_l is None else _sum_clip(m, c_l, 0, None)
    if cfg.causal:
        c_h: int | None = 0
        sum_kbh = _sum_clip(m, 0, None, nkb - 1)
    elif right is None:
        c_h = None
        sum_kbh = m * (nkb - 1)
    else:
        c_h = (BLOCK - 1 + right) // BLOCK
        sum_kbh = _sum_clip(m, c_h, None, nkb - 1)
    return sum_kbh + m, sum_kbl, c_l, c_h


@lru_cache(maxsize=256)
def block_pairs(cfg: VariantConfig, n: int) -> tuple[int, int]:
    """``(pairs, tiles)``: pairs a tiled kernel computes (query rows x keys of every visited
    ``BLOCK``-key tile) and the number of non-empty ``BLOCK x BLOCK`` tiles, per (batch, head)."""
    nkb, m = -(-n // BLOCK), n // BLOCK
    pad = nkb * BLOCK - n
    gs = sorted({g for g in cfg.global_tokens if 0 <= g < n})
    sum_hi1, sum_lo, c_l, c_h = _bulk_window(cfg, n, m)
    tiles = sum_hi1 - sum_lo
    keys = BLOCK * tiles
    if pad and c_h is None:
        keys -= pad * m
    elif pad and not cfg.causal:
        keys -= pad * min(m, max(0, m - max(0, nkb - 1 - c_h)))
    for gt in sorted({g // BLOCK for g in gs}):  # global key tiles outside a block's window
        kt = min(n, (gt + 1) * BLOCK) - gt * BLOCK
        count = 0 if c_l is None else min(m, max(0, m - (gt - c_l + 1)))  # blocks whose window starts after gt
        if not cfg.causal and c_h is not None:
            count += min(m, max(0, gt - c_h))  # blocks whose window ends before gt
        tiles, keys = tiles + count, keys + count * kt
    pairs = BLOCK * keys
    for i in sorted({g // BLOCK for g in gs if g // BLOCK < m}):  # global query blocks: full rows
        full_k, full_t = _block_direct(cfg, n, i, gs)
        win_k, win_t = _block_direct(cfg, n, i, gs, rows=False)
        pairs += BLOCK * (full_k - win_k)
        tiles += full_t - win_t
    if n > m * BLOCK:  # the partial last block
        k_last, t_last = _block_direct(cfg, n, m, gs)
        pairs += (n - m * BLOCK) * k_last
        tiles += t_last
    return pairs, tiles



# --------------------------------------------------------------------------- backends
#: The ``auto`` rule's threshold for a sparse pattern (see ``docs/backends.md``): a score matrix of
#: at least this many entries whose pattern leaves at most half of its tiles to visit goes tiled.
SPARSE_MIN_SCORES = 1 << 20


def resolve_backend(cfg: VariantConfig, shape: CostShape) -> str:
    """The backend whose work is counted: ``shape.backend``, or what ``auto`` picks on the CPU for
    this request: ``reference`` for float64, ``tiled`` when the pattern leaves at most half of the
    tiles of a large score matrix, else ``sdpa`` (closed-form: no request is built)."""
    if shape.backend != "auto":
        return shape.backend
    if shape.elem_bytes == 8:
        return "reference"
    n = shape.seq_len
    nkb = -(-n // BLOCK)
    if (cfg.window is not None or cfg.global_tokens) and n * n >= SPARSE_MIN_SCORES \
            and 2 * block_pairs(cfg, n)[1] <= nkb * nkb:
        return "tiled"
    return "sdpa"


def computed_pairs(cfg: VariantConfig, n: int, backend: str) -> int:
    """Pairs ``backend`` computes per (batch, head): dense kernels all ``n x n``, ``tiled`` the
    visited tiles' rows x keys, ``flex`` whole non-empty tiles, ``ideal`` the visible pairs."""
    if backend == "ideal":
        return visible_pairs(cfg, n)
    if backend == "tiled":
        return block_pairs(cfg, n)[0]
    if backend == "flex":
        return block_pairs(cfg, n)[1] * BLOCK * BLOCK if (cfg.window or cfg.global_tokens or cfg.causal) else n * n
    return n * n


# --------------------------------------------------------------------------- layers
def projection_cost(cfg: VariantConfig, shape: CostShape) -> tuple[int, int, int, int]:
    """``(params, flops, qkv_bytes, io_bytes)`` of the Q, K, V, O projections of one forward."""
    B, N, C, e = shape.batch, shape.seq_len, cfg.dim, shape.elem_bytes
    inner_q, inner_kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    params = C * inner_q + 2 * C * inner_kv + inner_q * C
    flops = 2 * B * N * C * (inner_q + 2 * inner_kv) + 2 * B * N * inner_q * C
    qkv_bytes = B * N * (inner_q + 2 * inner_kv) * e
    io_bytes = 2 * B * N * C * e + params * e  # read x, write y, read the weights
    return params, flops, qkv_bytes, io_bytes


def _softmax_residue(cfg: VariantConfig, shape: CostShape, used: str, dense_pattern: bool) -> tuple[int, int]:
    """``(activation bytes, score traffic)`` the backend itself adds (beyond the projections)."""
    B, N, e, acc = shape.batch, shape.seq_len, shape.elem_bytes, shape.acc_bytes
    Hq, Dv = cfg.num_heads, cfg.head_dim
    score_bytes = B * Hq * N * N * acc
    if used == "reference":
        # raw scores (kept by the row max), exp-scores and probabilities, and the bool mask
        masked = cfg.causal or cfg.window is not None or bool(cfg.global_tokens)
        return 3 * score_bytes + (N * N if masked else 0), 4 * score_bytes  # write/read S and P
    if used == "sdpa":
        # torch's CPU kernel writes its output in [B, N, H, D] order (the merged output is the same
        # storage); any mask beyond plain causal becomes a dense float mask.
        return B * Hq * N * acc + (0 if dense_pattern else N * N * e), 0
    return B * Hq * N * Dv * e + B * Hq * N * acc, 0  # kernel output and LSE


def softmax_cost(cfg: VariantConfig, shape: CostShape, *, ring: bool = False) -> Cost:
    """Cost of a softmax attention layer (MHA/GQA/MQA, windows, global tokens).

    ``ring``: the decode cache is a ring buffer of ``left`` slots (causal sliding window).
    """
    B, N, e = shape.batch, shape.seq_len, shape.elem_bytes
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    params, flops_proj, qkv_bytes, io_bytes = projection_cost(cfg, shape)
    used = resolve_backend(cfg, shape)
    pairs = computed_pairs(cfg, N, used)
    visible = visible_pairs(cfg, N)
    flops_attn = 2 * B * Hq * pairs * 2 * D  # S = Q K^T and P V (the row sums are no matrix product)
    kv_max = cfg.window[0] if ring and cfg.window is not None and cfg.window[0] is not None else None
    per_token = 2 * Hkv * D * e
    residue, traffic = _softmax_residue(cfg, shape, used, dense_pattern=cfg.window is None and not cfg.global_tokens)
    act = B * N * cfg.dim * e + qkv_bytes + B * N * Hq * D * e + residue
    bwd = 2 * flops_attn if used == "reference" else (5 * flops_attn) // 2
    return Cost(backend=used, flops_projections=flops_proj, flops_attention=flops_attn,
                flops_useful=2 * B * Hq * visible * 2 * D, flops_backward=2 * flops_proj + bwd,
                bytes_moved=io_bytes + 2 * qkv_bytes + 2 * B * N * Hq * D * e + traffic, activation_bytes=act,
                kv_cache_bytes_per_token=per_token,
                kv_cache_bytes=B * (N if kv_max is None else min(N, kv_max)) * per_token,
                kv_cache_max_tokens=kv_max, params=params, visible_pairs=visible)
