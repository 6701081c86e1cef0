"""The ``flex`` backend: torch FlexAttention driven by the same :class:`~attnzoo.masks.Mask`.

* The request's structure (causal, window, Mask object) and any bool tensor become FlexAttention's
  ``mask_mod``; query rows are shifted by ``q_offset`` so positions stay absolute.
* The :class:`BlockMask` is built from :meth:`Mask.block_map` (no ``Nq x Nk`` tensor), with full
  and partial tiles kept apart so FlexAttention skips the mask on full tiles. A causal / window
  request's tables are memoised by shape, and inside ``torch.compile`` they come from the operator
  ``attnzoo::flex_block_table`` (no generated kernels for them, issue 20).
* softcap, the user's ``score_mod`` (its query index shifted by ``q_offset``), ALiBi and float
  masks become FlexAttention's ``score_mod``, in that order.
* ``COMPILE`` (default ``True``) runs FlexAttention through ``torch.compile``, which is what makes it
  fast: the first shape compiles with static sizes, the first call with another shape compiles once
  more with dynamic sizes (torch's automatic dynamic shapes), and every later shape reuses that
  graph; before, each shape compiled anew and the 9th hit torch's recompile limit and ran unfused. On CPU, requests that
  torch's compiled kernel cannot serve correctly (gradients, LSE, fewer keys than one block) run
  FlexAttention's eager path instead. Set
  ``attnzoo.functional.backends.flex.COMPILE = False`` for FlexAttention's eager (debug) path.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo.functional.core._request import AttnRequest, Capabilities, combine_structure
from attnzoo.functional.core.rules import alibi_bias
from attnzoo.masks import BLOCK_FULL, BLOCK_PARTIAL, Mask

COMPILE = True
FLEX_BLOCK = 128

_compiled: dict[str, Callable[..., Any]] = {}


def _available(device: torch.device) -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401  (torch >= 2.5)
    except ImportError:  # pragma: no cover - torch < 2.5
        return False
    return device.type in ("cpu", "cuda")


def _more_missing(r: AttnRequest) -> set[str]:
    captured = r.score_mod.captured if r.score_mod is not None else ()
    if r.q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (r.q, r.k, r.v,
                                                                                            *captured)):
        return {"gradients on CPU (FlexAttention has no CPU backward)"}
    return set()


#: What this backend cannot do (feature names of ``AttnRequest.features()``), where it runs.
CAPABILITIES = Capabilities("flex", frozenset({"return_weights", "dropout", "float64", "float mask gradient",
                                               "alibi gradient"}), _available, _more_missing)


def _eager(*args: Any, **kwargs: Any) -> Any:
    """FlexAttention's eager path, without torch's 7-line "called without torch.compile()" warning:
    attnzoo runs it eagerly on purpose (see :func:`flex_attention_backend`)."""
    from torch.nn.attention.flex_attention import flex_attention

    if tracing():  # inside a compiled graph flex is traced, and catch_warnings would break it
        return flex_attention(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def _flex_fn(compiled: bool) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return _eager
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(flex_attention, dynamic=None)  # sizes turn dynamic on a new shape
    return _compiled["fn"]


def _indices(cls: Tensor, kind: int) -> tuple[Tensor, Tensor]:
    """Count and column indices (sorted, padded) of tiles of ``kind`` per query block."""
    hit = cls == kind  # [B, H, nQB, nKB]
    n_kb = cls.shape[-1]
    col = torch.arange(n_kb, device=cls.device).expand_as(cls)
    key = torch.where(hit, col, torch.full_like(col, n_kb))  # non-hits sort last
    order = torch.sort(key, dim=-1).values.clamp(max=n_kb - 1)
    return hit.sum(dim=-1).to(torch.int32), order.to(torch.int32)


def _tile_classes(structure: Mask | None, masked: bool, batch: int, heads: int, nq: int, nk: int, q_offset: int,
                  device: torch.device) -> Tensor:
    """The mask algebra's block map ``[B, H, nQB, nKB]`` (empty / partial / full tiles); ``masked``: a
    bool tensor mask applies too, so no tile is full."""
    if structure is None:
        cls = torch.full((1, 1, -(-nq // FLEX_BLOCK), -(-nk // FLEX_BLOCK)), BLOCK_FULL, dtype=torch.int8,
                         device=device)
    else:
        cls = structure.block_map(batch, heads, nq, nk, FLEX_BLOCK, FLEX_BLOCK, q_offset=q_offset, device=device)
    if masked:
        cls = torch.where(cls == BLOCK_FULL, torch.full_like(cls, BLOCK_PARTIAL), cls)
    return cls.expand(batch, heads, *cls.shape[2:])


def _table(cls: Tensor, kind: int, by_key: bool) -> tuple[Tensor, Tensor]:
    """One ``BlockMask`` table: tiles of ``kind`` per query block (count ``[B, H, nQB]``, sorted indices
    ``[B, H, nQB, nKB]``) or, ``by_key``, per key block (what a backward reads)."""
    count, idx = _indices(cls.transpose(-1, -2) if by_key else cls, kind)
    return count.contiguous(), idx.contiguous()


@functools.lru_cache(maxsize=32)
def _structured_table(causal: bool, left: int | None, right: int | None, windowed: bool, masked: bool, nq: int,
                      nk: int, q_offset: int, device: torch.device, kind: int, by_key: bool) -> tuple[Tensor, Tensor]:
    """:func:`_table` of a causal / window request (``windowed``: ``(left, right)`` is a window, ``None``
    an unbounded side), memoised: it depends on these Python values only, and not on the batch or the
    head, so it is ``[1, 1, ...]`` (FlexAttention broadcasts it; 4 MiB at 65,536 tokens)."""
    structure = combine_structure(causal, (left, right) if windowed else None)
    return _table(_tile_classes(structure, masked, 1, 1, nq, nk, q_offset, device), kind, by_key)


def _request_table(q: Tensor, causal: bool, left: int | None, right: int | None, windowed: bool, masked: bool,
                   nk: int, q_offset: int, kind: int, by_key: bool) -> tuple[Tensor, Tensor]:
    count, idx = _structured_table(causal, left, right, windowed, masked, q.shape[2], nk, q_offset, q.device, kind,
                                   by_key)
    return count.clone(), idx.clone()  # fresh tensors: the memo's stay untouched whatever a caller does


@torch.library.custom_op("attnzoo::flex_block_table", mutates_args=())
def block_table(q: Tensor, causal: bool, left: int | None, right: int | None, windowed: bool, masked: bool,
                nk: int, q_offset: int, kind: int, by_key: bool) -> tuple[Tensor, Tensor]:
    """One table of a causal / window request's ``BlockMask`` as an operator (``q [B, H, Nq, D]`` gives
    ``Nq`` and the device; the table is ``[1, 1, ...]``, broadcast over batch and heads). Traced, the
    block map's comparisons, sorts and counts became C++ kernels of the caller's graph (about 3 s of a
    cold compile); the operator returns them from a memo of shapes. One table per call: torch 2.13's
    CPU FlexAttention template dropped the partial tiles' tables from its kernel's arguments (a C++
    compile error) when both kinds came out of one operator."""
    return _request_table(q, causal, left, right, windowed, masked, nk, q_offset, kind, by_key)


@block_table.register_fake
def _block_table_fake(q: Tensor, causal: bool, left: int | None, right: int | None, windowed: bool, masked: bool,
                      nk: int, q_offset: int, kind: int, by_key: bool) -> tuple[Tensor, Tensor]:
    rows, cols = -(-q.shape[2] // FLEX_BLOCK), -(-nk // FLEX_BLOCK)
    if by_key:
        rows, cols = cols, rows
    return q.new_empty(1, 1, rows, dtype=torch.int32), q.new_empty(1, 1, rows, cols, dtype=torch.int32)


def build_block_mask(r: AttnRequest, by_key: bool = True) -> Any:
    """FlexAttention ``BlockMask`` for a request, from the mask algebra's block map (for a causal / window
    request memoised by shape, inside a compiled graph through :func:`block_table`; a ``Mask`` object's
    block map is computed each call). ``by_key=False`` leaves out the per-key-block tables, which only
    a backward reads."""
    from torch.nn.attention.flex_attention import BlockMask

    wanted = [(kind, k) for k in ((False, True) if by_key else (False,)) for kind in (BLOCK_PARTIAL, BLOCK_FULL)]
    if r.mask_obj is None:
        left, right = r.window if r.window is not None else (None, None)
        args = (r.q, r.causal, left, right, r.window is not None, r.bool_mask is not None, r.nk, r.q_offset)
        table = block_table if tracing() else _request_table
        tables = [table(*args, kind, k) for kind, k in wanted]
    else:
        cls = _tile_classes(r.structure, r.bool_mask is not None, r.batch, r.hq, r.nq, r.nk, r.q_offset, r.q.device)
        tables = [_table(cls, kind, k) for kind, k in wanted]
    (kv, kv_idx), (full, full_idx) = tables[:2]
    (q_n, q_idx), (fq_n, fq_idx) = tables[2:] if by_key else ((None, None), (None, None))
    return BlockMask(seq_lengths=(r.nq, r.nk), kv_num_blocks=kv, kv_indices=kv_idx, full_kv_num_blocks=full,
                     full_kv_indices=full_idx, q_num_blocks=q_n, q_indices=q_idx, full_q_num_blocks=fq_n,
                     full_q_indices=fq_idx, BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK), mask_mod=_mask_mod(r))


def _mask_mod(r: AttnRequest) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    s = r.structure
    bm = r.bool_mask
    off = r.q_offset

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        ok = torch.ones((), dtype=torch.bool, device=q_idx.device)
        if s is not None:
            ok = ok & s.fn(b, h, q_idx + off, kv_idx)
        if bm is not None:
            bb = b if bm.shape[0] > 1 else torch.zeros_like(b)
            hh = h if bm.shape[1] > 1 else torch.zeros_like(h)
            qq = q_idx if bm.shape[2] > 1 else torch.zeros_like(q_idx)
            kk = kv_idx if bm.shape[3] > 1 else torch.zeros_like(kv_idx)
            ok = ok & bm[bb, hh, qq, kk]
        return ok

    return mask_mod


def _score_mod(r: AttnRequest) -> Callable[..., Tensor] | None:
    cap, slopes, fm, off = r.softcap, r.alibi_slopes, r.float_mask, r.q_offset
    user = r.score_mod.fn if r.score_mod is not None else None
    if cap is None and slopes is None and fm is None and user is None:
        return None

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if cap is not None:
            score = torch.tanh(score / cap) * cap
        if user is not None:  # the user's score_mod, at absolute query positions
            score = user(score, b, h, q_idx + off, kv_idx)
        if slopes is not None:
            score = score + alibi_bias(slopes[h], q_idx + off, kv_idx)
        if fm is not None:
            bb = b if fm.shape[0] > 1 else torch.zeros_like(b)
            hh = h if fm.shape[1] > 1 else torch.zeros_like(h)
            qq = q_idx if fm.shape[2] > 1 else torch.zeros_like(q_idx)
            kk = kv_idx if fm.shape[3] > 1 else torch.zeros_like(kv_idx)
            score = score + fm[bb, hh, qq, kk]
        return score

    return score_mod


def flex_attention_backend(r: AttnRequest) -> tuple[Tensor, Tensor | None]:
    """Attention through FlexAttention. Returns ``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq] float32 or None)``."""
    from torch.nn.attention.flex_attention import AuxRequest

    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (r.q, r.k, r.v))
    block_mask = build_block_mask(r, by_key=needs_grad)
    # torch.compile of FlexAttention on CPU supports inference without LSE only; other CPU requests
    # run FlexAttention's eager path (exact, but it materialises the scores).
    # Compiled CPU FlexAttention also returns wrong values (NaN or off by O(1)) when Nk is below
    # one block (torch 2.13; found by `attnzoo check`); those shapes run eagerly too.
    # Inside an outer torch.compile the plain function is traced into the caller's graph.
    compiled = COMPILE and not tracing() and not (
        r.q.device.type == "cpu" and (needs_grad or r.return_lse or r.nk < FLEX_BLOCK))
    fn = _flex_fn(compiled)
    kwargs: dict[str, Any] = {"score_mod": _score_mod(r), "block_mask": block_mask, "scale": r.scale,
                              "enable_gqa": r.group > 1}
    if not r.return_lse:
        return fn(r.q, r.k, r.v, **kwargs), None
    out, aux = fn(r.q, r.k, r.v, return_aux=AuxRequest(lse=True), **kwargs)
    lse = aux.lse.float()
    # FlexAttention reports an empty row's LSE as -inf; make its output exactly zero too.
    out = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device), out)
    return out, lse
