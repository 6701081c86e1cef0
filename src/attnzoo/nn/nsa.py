"""Native sparse attention module (Yuan et al. 2025, DeepSeek) with its decode cache and variant spec.

The math lives in :mod:`attnzoo.functional.softmax.nsa`. This module owns the projections (GQA: ``H``
query heads, ``Hkv`` key/value heads; selection is shared by the heads of a group), the two block
compressors (one for keys, one for values: an MLP over the ``l`` tokens of a block plus an
intra-block position embedding, as published), the per-head branch gates
``sigmoid(x W_g + b_g) [B, N, H, 3]`` and :class:`NSACache` (raw keys/values of every token plus
the compressed blocks, extended whenever a block completes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_int
from attnzoo.functional.softmax.nsa import (
    NSAConfig,
    compress_blocks,
    nsa_attention,
    num_compressed,
    window_chunk,
)
from attnzoo.masks import Mask
from attnzoo.nn.base import AttentionBase
from attnzoo.nn.cache import SnapshotCache
from attnzoo.nn.costs import projection_cost
from attnzoo.nn.spec import Cost, CostShape, VariantConfig, VariantSpec, register

__all__ = ["BlockCompressor", "NSACache", "NativeSparseAttention"]


def default_nsa_kv_heads(num_heads: int, given: int | None = None) -> int:
    """``given``, else GQA groups of 4 query heads (``H // 4``; 1 when ``H % 4 != 0``)."""
    if given is not None:
        return given
    return num_heads // 4 if num_heads % 4 == 0 else 1


class BlockCompressor(nn.Module):
    """``phi``: ``[B, h, N, D] -> [B, h, Nc, D]``, one vector per complete block of ``l`` tokens
    (stride ``d``): ``fc2(gelu(fc1(vec(block + pos))))`` (:func:`attnzoo.functional.softmax.nsa.compress_blocks`)."""

    def __init__(self, head_dim: int, block_len: int, block_stride: int, factory: dict[str, Any]) -> None:
        super().__init__()
        self.block_len, self.block_stride = block_len, block_stride
        self.pos = nn.Parameter(0.02 * torch.randn(block_len, head_dim, **factory))
        self.fc1 = nn.Linear(block_len * head_dim, head_dim, **factory)
        self.fc2 = nn.Linear(head_dim, head_dim, **factory)

    def forward(self, x: Tensor) -> Tensor:
        """``x [B, h, N, D]`` -> ``[B, h, Nc, D]`` (``Nc`` complete blocks)."""
        return compress_blocks(x, self.pos, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                               self.block_len, self.block_stride)


class NSACache(SnapshotCache):
    """Decode cache of :class:`NativeSparseAttention`: raw ``k, v [B, Hkv, max_len, D]`` (the
    selected branch may pick any earlier block) plus compressed ``k_cmp, v_cmp [B, Hkv, Nc_max, D]``,
    written when a block completes. Protocol of ``attnzoo.nn.cache`` (``length``, ``batch_size``,
    ``nbytes``, ``reset``, ``mark``/``rollback``/``commit``, :meth:`update`)."""

    snapshot = ("length", "num_blocks")
    _batch_tensors = ("k", "v", "k_cmp", "v_cmp")

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_len: int, config: NSAConfig, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self._set_sizes(batch_size, max_len=max_len)
        self.config = config
        fk: dict[str, Any] = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        nc = max(1, num_compressed(max_len, config.block_len, config.block_stride))
        self.k = torch.zeros(batch_size, num_kv_heads, max_len, head_dim, **fk)
        self.v = torch.zeros_like(self.k)
        self.k_cmp = torch.zeros(batch_size, num_kv_heads, nc, head_dim, **fk)
        self.v_cmp = torch.zeros_like(self.k_cmp)
        self.num_blocks = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the raw and compressed buffers."""
        return self.k.nbytes + self.v.nbytes + self.k_cmp.nbytes + self.v_cmp.nbytes

    def reset(self) -> None:
        """Forget every token (the buffers are reused)."""
        self.length = self.num_blocks = 0

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write ``n`` new tokens ``[B, Hkv, n, D]``; return ``(k, v)`` of every token so far and the
        new tokens' positions ``[n]``."""
        n = k_new.shape[2]
        if tuple(k_new.shape) != (*self.k.shape[:2], n, self.k.shape[3]) or v_new.shape != k_new.shape:
            raise ValueError(f"NSACache.update: expected k_new, v_new [B, Hkv, n, D] = "
                             f"{[*self.k.shape[:2], 'n', self.k.shape[3]]}, got {tuple(k_new.shape)}, "
                             f"{tuple(v_new.shape)}")
        if self.length + n > self.max_len:
            raise ValueError(f"NSACache: {self.length} cached + {n} new tokens exceed max_len = {self.max_len} "
                             f"(build the cache with a larger max_len)")
        s = self.length
        self.k[:, :, s:s + n] = k_new
        self.v[:, :, s:s + n] = v_new
        positions = self.advance(n, self.k.device)
        return self.k[:, :, :self.length], self.v[:, :, :self.length], positions

    def extend_blocks(self, k_comp: BlockCompressor, v_comp: BlockCompressor) -> tuple[Tensor, Tensor]:
        """Compress the blocks completed since the last call; return every compressed block so far."""
        cfg = self.config
        lo, hi = self.num_blocks, num_compressed(self.length, cfg.block_len, cfg.block_stride)
        if hi > lo:
            a, b = lo * cfg.block_stride, (hi - 1) * cfg.block_stride + cfg.block_len
            self.k_cmp[:, :, lo:hi] = k_comp(self.k[:, :, a:b])
            self.v_cmp[:, :, lo:hi] = v_comp(self.v[:, :, a:b])
            self.num_blocks = hi
        return self.k_cmp[:, :, :self.num_blocks], self.v_cmp[:, :, :self.num_blocks]

    def __repr__(self) -> str:
        return f"NSACache(batch_size={self.batch_size}, length={self.length}, num_blocks={self.num_blocks})"


class NativeSparseAttention(AttentionBase):
    """Native sparse attention: compressed blocks + top-n selected blocks + sliding window, gated.

    Causal by construction. See :mod:`attnzoo.functional.softmax.nsa` for the three branches.

    Args:
        dim: model width ``C``.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` = GQA groups sharing a selection (default ``H // 4``).
        block_len, block_stride: ``l`` and ``d`` of the compressed blocks (paper: 32, 16).
        select_len, num_selected: ``l'`` and ``n`` of the selected blocks (paper: 64, 16).
        window: ``w``, tokens of the sliding window (paper: 512).
        head_dim: ``D`` (default ``C // H``).
        bias: biases in the projections.
        device, dtype: of the parameters.

    Attributes:
        query_chunk: queries per chunk of the fast form (default 128).

    Shapes: ``[B, N, C] -> [B, N, C]``. Masks: causal only.
    """

    no_weights_reason = "three branches, no single matrix"

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, block_len: int = 32,
                 block_stride: int = 16, select_len: int = 64, num_selected: int = 16, window: int = 512,
                 head_dim: int | None = None, bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        kv = default_nsa_kv_heads(check_int(num_heads, "num_heads", owner="NativeSparseAttention"), num_kv_heads)
        super().__init__(dim, num_heads, num_kv_heads=kv, head_dim=head_dim, bias=bias, layout="q_k_v", factory=fk)
        self.config = NSAConfig(block_len, block_stride, select_len, num_selected, window)
        self.k_compress = BlockCompressor(self.head_dim, block_len, block_stride, fk)
        self.v_compress = BlockCompressor(self.head_dim, block_len, block_stride, fk)
        self.gate_proj = nn.Linear(dim, 3 * self.num_heads, bias=True, **fk)
        self.query_chunk = QUERY_CHUNK
        self.form = "auto"

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype) -> NSACache:
        return NSACache(batch_size, self.num_kv_heads, self.head_dim, max_len, self.config, device=device, dtype=dtype)

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,
                cache: NSACache | None = None, positions: Tensor | None = None,
                return_weights: bool = False) -> Tensor:
        """Causal NSA over ``x [B, N, C]`` (with a cache: the NEW tokens, continuing the stream).

        ``context`` and ``mask`` must be ``None`` and ``return_weights`` False (no single attention
        matrix); ``positions`` are validated only. Returns ``[B, N, C]``.
        """
        cls = type(self).__name__
        if context is not None:
            raise ValueError(f"{cls}: context (cross-attention) is not supported: NSA is causal self-attention")
        if mask is not None:
            raise ValueError(f"{cls}: mask is not supported (causal by construction), got {type(mask).__name__}")
        x = self.check_call(x, cache, positions, return_weights, NSACache)
        q, k, v = self.project_qkv(x)  # [B, H, N, D], [B, Hkv, N, D]
        gates = torch.sigmoid(self.gate_proj(x)).unflatten(-1, (self.num_heads, 3)).transpose(1, 2)  # [B, H, N, 3]
        kw: dict[str, Any] = {"query_chunk": self.query_chunk, "form": self.form}
        if cache is None:
            out = nsa_attention(q, k, v, self.k_compress(k), self.v_compress(v), gates, self.config, q_offset=0, **kw)
            return self.merge_heads(out)

        def step() -> Tensor:
            start = cache.length
            k_all, v_all, _ = cache.update(k, v)
            k_cmp, v_cmp = cache.extend_blocks(self.k_compress, self.v_compress)
            return nsa_attention(q, k_all, v_all, k_cmp, v_cmp, gates, self.config, q_offset=start, **kw)

        return self.merge_heads(self.guarded(cache, step))

    def extra_repr(self) -> str:
        c = self.config
        return (f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, block_len={c.block_len}, block_stride={c.block_stride}, "
                f"select_len={c.select_len}, num_selected={c.num_selected}, window={c.window}")


# --------------------------------------------------------------------------- variant spec
DEFAULTS: dict[str, int] = {"block_len": 32, "block_stride": 16, "select_len": 64, "num_selected": 16, "window": 512}
#: Queries per chunk of the fast form (``NativeSparseAttention.query_chunk``'s default; the cost reads it).
QUERY_CHUNK = 128


def _sum_min(m: int, count: int) -> int:
    """``sum(min(m, j) for j in range(count))`` in O(1)."""
    if count <= m + 1:
        return count * (count - 1) // 2
    return m * (m + 1) // 2 + (count - m - 1) * m


def nsa_pairs(n: int, cfg: NSAConfig) -> tuple[int, int, int, int]:
    """``(compressed, selected, window, selected_computed)`` pairs per (batch, head) over ``n``
    tokens, closed-form: visible compressed blocks, tokens of the selected blocks (the current
    block partly), window keys; and the ``n l'`` keys a query of the fast form scores."""
    bl, d, sl, k, w = cfg.block_len, cfg.block_stride, cfg.select_len, cfg.num_selected, cfg.window
    m = n - bl + 1
    q_, r_ = divmod(max(m, 0), d)
    cmp = 0 if m <= 0 else d * q_ * (q_ - 1) // 2 + r_ * q_ + m
    full, rest = divmod(n, sl)
    earlier = sl * (sl * _sum_min(k - 1, full) + rest * min(k - 1, full))  # full earlier blocks
    slc = full * sl * (sl + 1) // 2 + rest * (rest + 1) // 2 + earlier
    win = n * (n + 1) // 2 if n <= w else w * (w + 1) // 2 + (n - w) * w
    return cmp, slc, win, earlier + n * sl


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a i + b) / m) for i in range(n))`` for ``a, b >= 0``, ``m >= 1`` in O(log) steps.

    Whole multiples of ``m`` in ``a`` and ``b`` sum directly; the rest counts lattice points under
    the line ``y = (a i + b) / m`` by swapping the axes (a Euclid-like recursion)."""
    total = 0
    while n > 0:
        total += (a // m) * n * (n - 1) // 2 + (b // m) * n
        a, b = a % m, b % m
        top = a * n + b  # the line's height at i = n, times m
        if top < m:
            break
        n, b, m, a = top // m, top % m, a, m
    return total


def _chunk_sum(n: int, chunk: int, step: int, start: int) -> int:
    """``sum(floor(((i + 1) chunk - start) / step) for full chunks i with (i + 1) chunk >= start)``
    over the ``n // chunk`` full chunks of ``n`` queries (``start >= 0``)."""
    full = n // chunk
    first = -(-start // chunk) - 1  # first chunk whose end reaches ``start``
    count = full - max(first, 0)
    if count <= 0:
        return 0
    lo = (max(first, 0) + 1) * chunk - start  # >= 0
    return _floor_sum(count, step, chunk, lo)


def nsa_computed_pairs(n: int, cfg: NSAConfig, query_chunk: int = QUERY_CHUNK) -> tuple[int, int, int]:
    """``(compressed, selected, window)`` (query, key) pairs the fast form scores per (batch, head) over
    ``n`` tokens, closed-form (what FlopCounterMode sees, masked pairs included):

    * compressed: a chunk of ``c`` queries ending at ``t1`` scores every block its last query can
      see, ``c * num_compressed(t1)``;
    * selected: ``c * min(n_sel, ceil(t1 / l')) * l'`` (the chunk's pick count, padded picks included);
    * window: every block of ``c = window_chunk(query_chunk, w)`` queries (the last one padded)
      scores a dense slab of ``c + w - 1`` keys (one ``az.attention`` call over all blocks)."""
    bl, d, sl, k, w = cfg.block_len, cfg.block_stride, cfg.select_len, cfg.num_selected, cfg.window
    c = query_chunk
    full, rest = divmod(n, c)
    # compressed: num_compressed(t1) = floor((t1 - l) / d) + 1 once t1 >= l
    visible_chunks = max(0, full - max(-(-bl // c) - 1, 0))
    cmp = c * (_chunk_sum(n, c, d, bl) + visible_chunks)
    if rest:
        cmp += rest * num_compressed(n, bl, d)
    # selected: min(k, ceil(t1 / l')) = min(k, floor((t1 + l' - 1) / l'))
    sat = min(full, max(0, -(-((k - 1) * sl + 1) // c) - 1))  # full chunks with ceil(t1 / l') < k
    slc_chunks = _floor_sum(sat, sl, c, c + sl - 1) + k * (full - sat)
    slc = c * sl * slc_chunks + (rest * sl * min(k, -(-n // sl)) if rest else 0)
    # window: ceil(n / c) blocks of c queries, each over c + w - 1 keys
    cw = window_chunk(c, w)
    win = -(-n // cw) * cw * (cw + w - 1)
    return cmp, slc, win


def _cost(cfg: VariantConfig, shape: CostShape) -> Cost:
    """Projections + gates + block compression + the three branches: the pairs the fast form
    computes (:func:`nsa_computed_pairs`) for the FLOPs, the visible ones (:func:`nsa_pairs`) for
    the useful FLOPs."""
    B, N, e = shape.batch, shape.seq_len, shape.elem_bytes
    Hq, Hkv, D, C = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dim
    nc = NSAConfig(**DEFAULTS)
    params, flops_proj, qkv_bytes, io_bytes = projection_cost(cfg, shape)
    nblk = num_compressed(N, nc.block_len, nc.block_stride)
    per_block = 2 * (nc.block_len * D * D + D * D)  # fc1 + fc2 of one block
    params += 2 * (nc.block_len * D + nc.block_len * D * D + D * D) + 3 * Hq * C  # weights, as projection_cost
    flops_proj += 2 * B * Hkv * nblk * per_block + 2 * B * N * C * 3 * Hq
    cmp, slc, win, _ = nsa_pairs(N, nc)
    flops_attn = 2 * B * Hq * sum(nsa_computed_pairs(N, nc)) * 2 * D
    gathered = 2 * B * Hkv * N * nc.num_selected * nc.select_len * D * e  # the gathered K/V blocks
    per_token = 2 * Hkv * D * e
    act = B * N * C * e + qkv_bytes + 4 * B * N * Hq * D * e + 2 * B * Hkv * nblk * D * e
    return Cost(backend="nsa", flops_projections=flops_proj, flops_attention=flops_attn,
                flops_useful=2 * B * Hq * (cmp + slc + win) * 2 * D, flops_backward=2 * flops_proj + 2 * flops_attn,
                bytes_moved=io_bytes + 2 * qkv_bytes + 2 * B * N * Hq * D * e + gathered, activation_bytes=act,
                # the cache keeps one compressed slot even before the first block closes
                kv_cache_bytes_per_token=per_token, kv_cache_bytes=B * (N + max(1, nblk)) * per_token,
                kv_cache_max_tokens=None, params=params, visible_pairs=cmp + slc + win)


def _build(dim: int, num_heads: int, *, causal: bool = True, **kw: Any) -> nn.Module:
    if causal is not True:
        raise ValueError("nsa: NativeSparseAttention is causal by construction (causal=False is not supported)")
    return NativeSparseAttention(dim, num_heads, **kw)


def _arena(width: int, heads: int, window: int | None) -> dict[str, Any]:
    return {"block_len": 8, "block_stride": 4, "select_len": 8, "num_selected": 4, "window": window or 16}


register(VariantSpec("nsa", "sparse", False, "O(N C^2 + N (N/d + n l' + w) C)", "O(N) (query chunks)",
                     "K,V of every token + compressed blocks", _build, _cost, defaults=DEFAULTS,
                     options=("num_kv_heads",), kv_heads=default_nsa_kv_heads, causal_modes=(True,),
                     check={"block_len": 4, "block_stride": 2, "select_len": 4, "num_selected": 4, "window": 4},
                     arena=_arena, masks="causal", order=8, positions="none", backends=False))
