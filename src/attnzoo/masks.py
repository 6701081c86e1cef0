"""Mask algebra: composable attention masks over absolute positions.

A :class:`Mask` wraps a vectorised predicate ``fn(b, h, q_pos, k_pos) -> bool tensor`` (the shape
of FlexAttention's ``mask_mod``). ``True`` means "this query may attend to this key". The four
arguments are integer tensors that broadcast against each other; the predicate must only use
elementwise operations and indexing so that the same object drives every backend:

* the reference backend materialises it (:meth:`Mask.materialize`),
* the tiled backend evaluates it on one tile at a time and skips tiles that
  :meth:`Mask.block_map` proves empty,
* the flex backend hands it to FlexAttention as its ``mask_mod``.

Positions are absolute: queries sit at ``q_offset .. q_offset + Nq - 1`` and keys at
``0 .. Nk - 1`` (see ``docs/conventions.md``). Masks compose with ``&``, ``|`` and ``~``::

    m = causal() & sliding_window(128, 0) & key_padding(lengths)
    m = document(doc_ids) | global_tokens([0])

Besides the predicate, each builder knows how to classify a rectangular tile of positions as
empty, full or partial without evaluating it pointwise (``_tiles``); composites combine those
classifications, and a predicate with no such rule falls back to evaluating one strip of query
rows at a time, so a block map never needs ``Nq x Nk`` memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import check_bool, check_int, normalize_window

__all__ = [
    "BLOCK_EMPTY",
    "BLOCK_FULL",
    "BLOCK_PARTIAL",
    "Mask",
    "bidirectional_window",
    "blockwise",
    "causal",
    "chunked",
    "dilated_window",
    "document",
    "global_tokens",
    "key_padding",
    "neighborhood_2d",
    "prefix_lm",
    "sliding_window",
    "visible",
]

#: Values of a block map: no visible pair, some visible pairs, every pair visible.
BLOCK_EMPTY, BLOCK_PARTIAL, BLOCK_FULL = 0, 1, 2

Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# Tile classifier: (q_start, q_end, k_start, k_end) as int64 tensors of shape [nQB, 1] and [1, nKB]
# (inclusive ends) -> (full, empty) bool tensors broadcastable to [B, H, nQB, nKB], or None when the
# mask has no analytic rule.
TileRule = Callable[[Tensor, Tensor, Tensor, Tensor], "tuple[Tensor, Tensor]"]


@dataclass(frozen=True)
class _Tiles:
    """Start and inclusive end positions of every query and key tile."""

    q_start: Tensor  # [nQB, 1]
    q_end: Tensor  # [nQB, 1]
    k_start: Tensor  # [1, nKB]
    k_end: Tensor  # [1, nKB]


class Mask:
    """A boolean attention mask defined by a vectorised predicate over absolute positions.

    Args:
        fn: ``fn(b, h, q_pos, k_pos) -> bool tensor``; arguments are broadcastable int64 tensors.
        name: short description used in ``repr`` and error messages.
        relative: declare that ``fn`` depends on ``q_pos - k_pos`` only (lets the tiled backend
            reuse one tile's pattern along a band).
        tiles: optional analytic tile classifier (internal; builders provide one).
        batch: batch size the mask is tied to (``key_padding``, ``document``), else ``None``.

    Semantics: ``True`` where a query may attend. See ``docs/conventions.md``.
    """

    __slots__ = ("_children", "_limits", "_op", "_tiles", "batch", "fn", "name", "relative")

    def __init__(
        self,
        fn: Predicate,
        name: str = "custom",
        *,
        tiles: Callable[[_Tiles], tuple[Tensor, Tensor]] | None = None,
        batch: int | None = None,
        relative: bool = False,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"Mask: fn must be callable (b, h, q_pos, k_pos) -> bool, got {type(fn).__name__}")
        self.fn = fn
        self.name = name
        self._tiles = tiles
        self.batch = batch
        self._op: str | None = None
        self._children: tuple[Mask, ...] = ()
        #: The tables of positions this mask (its leaves) read: ``(mask name, argument, keys, positions)``
        #: for a mask whose table covers only key positions ``< keys`` or query and key positions
        #: ``< positions`` (see :meth:`_check_extent`); empty for a pattern defined at every position.
        self._limits: tuple[tuple[str, str, int | None, int | None], ...] = ()
        #: True when the predicate depends on ``q_pos - k_pos`` only (causal, windows and their
        #: compositions): a tile's pattern then repeats along the diagonal.
        self.relative = relative

    # ------------------------------------------------------------------ algebra
    def __and__(self, other: Mask) -> Mask:
        return _combine("&", self, other)

    def __or__(self, other: Mask) -> Mask:
        return _combine("|", self, other)

    def __invert__(self) -> Mask:
        inner = self
        out = Mask(lambda b, h, q, k: ~inner.fn(b, h, q, k), f"~{inner.name}", batch=inner.batch)
        out._op, out._children = "~", (inner,)
        out.relative = inner.relative
        out._limits = inner._limits
        return out

    @classmethod
    def from_mask_mod(cls, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], name: str = "mask_mod") -> Mask:
        """A mask from a FlexAttention ``mask_mod`` written for scalars, ``fn(b, h, q_idx, kv_idx) -> bool``
        (0-d tensors in, a 0-d bool tensor out), evaluated with ``torch.vmap`` as FlexAttention does:
        one nested ``vmap`` level per index dimension, mapping only the arguments that vary along it,
        so a mask_mod that indexes a captured tensor (``table[q_idx]``) or branches with
        ``torch.where`` works as written. Positions are absolute (``docs/conventions.md``); tiles it
        hides are found by evaluating one strip of query rows at a time and skipped."""
        if not callable(fn):
            raise TypeError(f"Mask.from_mask_mod: fn must be callable (b, h, q_idx, kv_idx) -> bool, "
                            f"got {type(fn).__name__}")

        def predicate(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            args = [t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) for t in (b, h, q, k)]
            try:
                out = _vmap_levels(fn, args)
            except Exception as e:
                raise ValueError(f"Mask.from_mask_mod({name}): the mask_mod failed under torch.vmap "
                                 f"({type(e).__name__}: {e}); it must take 0-d tensors and return a 0-d bool tensor "
                                 f"(use torch.where, not Python if/and/or on tensors)") from e
            # the broadcast shape of the positions: 0-d under FlexAttention's own vmap (which calls
            # the predicate with scalars), [B, H, Nq, Nk]-broadcastable everywhere else
            return out.reshape(torch.broadcast_shapes(b.shape, h.shape, q.shape, k.shape))

        return cls(predicate, name)

    def __call__(self, b: Tensor, h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.fn(b, h, q_pos, k_pos)

    def __repr__(self) -> str:
        return f"Mask({self.name})"

    # ------------------------------------------------------------- evaluation
    def materialize(
        self,
        batch: int,
        heads: int,
        n_q: int,
        n_k: int,
        q_offset: int | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Dense boolean mask ``[B, H, Nq, Nk]`` (True = may attend).

        ``q_offset`` defaults to ``n_k - n_q`` (bottom-right alignment).
        """
        _check_dims(batch=batch, heads=heads, n_q=n_q, n_k=n_k)
        off = self.check_sizes(batch, n_q, n_k, q_offset)
        return self.evaluate(batch, heads, off, 0, n_q, 0, n_k, device=device)

    def check_sizes(self, batch: int, n_q: int, n_k: int, q_offset: int | None = None) -> int:
        """Refuse (``ValueError``) sizes this mask was not built for: another batch size
        (``key_padding``, ``document``, ...), or positions beyond a table: more keys than the columns
        of a bool ``key_padding [B, W]`` (``Nk <= W``), queries or keys beyond ``doc_ids`` /
        ``block_ids`` (``q_offset + Nq <= N`` and ``Nk <= N``). A longer table is fine (a mask over
        the whole sequence, evaluated by a cached call on its first keys). Returns the query offset
        (``n_k - n_q`` when ``None``). :meth:`materialize` and :meth:`block_map` call it;
        :meth:`evaluate` checks the positions of its tile the same way."""
        self._check_batch(batch)
        off = n_k - n_q if q_offset is None else _as_int(q_offset, "q_offset")
        self._check_extent(off + n_q, n_k)
        return off

    def evaluate(
        self,
        batch: int,
        heads: int,
        q_offset: int,
        q_lo: int,
        q_hi: int,
        k_lo: int,
        k_hi: int,
        device: torch.device | str | None = None,
        expand: bool = True,
    ) -> Tensor:
        """Evaluate the predicate on query rows ``q_lo:q_hi`` and keys ``k_lo:k_hi``.

        Row indices are relative to the query tensor; positions are ``q_offset + row``. A mask
        whose table covers only some positions (a bool ``key_padding``, ``document``,
        ``blockwise``) raises ``ValueError`` for keys or queries beyond it.
        Returns bool ``[B, H, q_hi - q_lo, k_hi - k_lo]`` (an expanded view), or with
        ``expand=False`` the predicate's own broadcastable result (size 1 on the batch/head
        dimensions it does not depend on).
        """
        if self._limits:
            self._check_extent(q_offset + q_hi, k_hi)
        dev = torch.device("cpu") if device is None else torch.device(device)
        b = torch.arange(batch, device=dev).view(batch, 1, 1, 1)
        h = torch.arange(heads, device=dev).view(1, heads, 1, 1)
        q = torch.arange(q_offset + q_lo, q_offset + q_hi, device=dev).view(1, 1, -1, 1)
        k = torch.arange(k_lo, k_hi, device=dev).view(1, 1, 1, -1)
        out = self.fn(b, h, q, k)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            raise TypeError(f"Mask {self.name}: predicate must return a bool tensor, got {type(out).__name__}"
                            f"{'' if not isinstance(out, Tensor) else ' of dtype ' + str(out.dtype)}")
        shape = (batch, heads, q_hi - q_lo, k_hi - k_lo)
        # broadcasts to ``shape`` itself: each (right-aligned) size 1 or the target's (torch.broadcast_shapes
        # raised its own RuntimeError on a mismatch, and costs ~50 us in Python on the decode path)
        if out.dim() > 4 or any(o not in (1, t) for o, t in zip(reversed(out.shape), reversed(shape), strict=False)):
            raise ValueError(f"Mask {self.name}: predicate returned shape {tuple(out.shape)}, "
                             f"which does not broadcast to {list(shape)}")
        if not expand:
            return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))
        return out.expand(shape)

    def block_map(
        self,
        batch: int,
        heads: int,
        n_q: int,
        n_k: int,
        block_q: int = 128,
        block_k: int = 128,
        q_offset: int | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Classify every ``(q_block, k_block)`` tile as empty, partial or full.

        Returns int8 ``[B, H, ceil(Nq / block_q), ceil(Nk / block_k)]`` holding
        :data:`BLOCK_EMPTY` (0), :data:`BLOCK_PARTIAL` (1) or :data:`BLOCK_FULL` (2).
        Builders classify tiles from their bounds; a custom predicate is evaluated one strip of
        ``block_q`` query rows at a time, so memory stays ``O(block_q x Nk)``.
        """
        _check_dims(batch=batch, heads=heads, n_q=n_q, n_k=n_k, block_q=block_q, block_k=block_k)
        off = self.check_sizes(batch, n_q, n_k, q_offset)
        dev = torch.device("cpu") if device is None else torch.device(device)
        qs = torch.arange(0, n_q, block_q, device=dev)
        ks = torch.arange(0, n_k, block_k, device=dev)
        tiles = _Tiles(
            q_start=(qs + off).view(-1, 1),
            q_end=((qs + block_q).clamp(max=n_q) - 1 + off).view(-1, 1),
            k_start=ks.view(1, -1),
            k_end=((ks + block_k).clamp(max=n_k) - 1).view(1, -1),
        )
        full, empty = self._classify(tiles, batch, heads, n_q, n_k, off, block_q, block_k, dev)
        shape = (batch, heads, len(qs), len(ks))
        out = torch.full(shape, BLOCK_PARTIAL, dtype=torch.int8, device=dev)
        out[full.expand(shape)] = BLOCK_FULL
        out[empty.expand(shape)] = BLOCK_EMPTY
        return out

    # -------------------------------------------------------------- internals
    def _classify(self, t: _Tiles, batch: int, heads: int, n_q: int, n_k: int, off: int,
                  block_q: int, block_k: int, dev: torch.device) -> tuple[Tensor, Tensor]:
        if self._op == "~":
            full, empty = self._children[0]._classify(t, batch, heads, n_q, n_k, off, block_q, block_k, dev)
            return empty, full
        if self._op in ("&", "|"):
            a, b = (c._classify(t, batch, heads, n_q, n_k, off, block_q, block_k, dev) for c in self._children)
            if self._op == "&":
                return a[0] & b[0], a[1] | b[1]
            return a[0] | b[0], a[1] & b[1]
        if self._tiles is not None:
            return self._tiles(t)
        return self._classify_by_strips(batch, heads, n_q, n_k, off, block_q, block_k, dev)

    def _classify_by_strips(self, batch: int, heads: int, n_q: int, n_k: int, off: int,
                            block_q: int, block_k: int, dev: torch.device) -> tuple[Tensor, Tensor]:
        n_qb, n_kb = -(-n_q // block_q), -(-n_k // block_k)
        full = torch.empty(batch, heads, n_qb, n_kb, dtype=torch.bool, device=dev)
        empty = torch.empty_like(full)
        pad_k = n_kb * block_k - n_k
        for i in range(n_qb):
            lo, hi = i * block_q, min(n_q, (i + 1) * block_q)
            strip = self.evaluate(batch, heads, off, lo, hi, 0, n_k, device=dev)  # [B, H, bq, Nk]
            if pad_k:
                # Padding keys count as visible for "full" and invisible for "empty".
                strip_any = torch.nn.functional.pad(strip, (0, pad_k), value=False)
                strip_all = torch.nn.functional.pad(strip, (0, pad_k), value=True)
            else:
                strip_any = strip_all = strip
            shp = (batch, heads, hi - lo, n_kb, block_k)
            empty[:, :, i] = ~strip_any.reshape(shp).any(dim=-1).any(dim=2)
            full[:, :, i] = strip_all.reshape(shp).all(dim=-1).all(dim=2)
        return full, empty

    def _check_batch(self, batch: int) -> None:
        for m in self._leaves():
            if m.batch is not None and m.batch not in (1, batch):
                raise ValueError(f"mask {m.name}: built for batch size {m.batch}, used with batch size {batch}")

    def _check_extent(self, q_end: int, k_end: int) -> None:
        """Refuse queries at positions ``< q_end`` or keys at positions ``< k_end`` that a leaf's table
        does not cover (a table longer than needed is fine: masks are over absolute positions, and a
        cached or chunked call evaluates a mask built for the whole sequence on some of its keys)."""
        for name, arg, keys, positions in self._limits:
            if keys is not None and k_end > keys:
                raise ValueError(f"mask {name}: {arg} is a bool mask [B, {keys}] (one column per key position), "
                                 f"used with keys up to position {k_end - 1} (Nk = {k_end}); it hides those "
                                 f"beyond column {keys - 1} only by accident: its width must be >= Nk")
            if positions is not None and max(q_end, k_end) > positions:
                raise ValueError(f"mask {name}: {arg} has length {positions}, but it must cover every query and "
                                 f"key position (queries: q_offset + Nq = {q_end}, keys: Nk = {k_end}); "
                                 f"its length must be >= both")

    def _leaves(self) -> list[Mask]:
        if not self._children:
            return [self]
        return [leaf for c in self._children for leaf in c._leaves()]


def _vmap_levels(fn: Callable[..., Tensor], args: list[Tensor]) -> Tensor:
    """``fn`` (scalar arguments) over broadcastable tensors of one rank: one ``vmap`` per leading
    dimension, mapping the arguments of size > 1 there (the others pass unbatched)."""
    if args[0].dim() == 0:
        out = fn(*args)
        if not isinstance(out, Tensor):
            out = torch.as_tensor(out)
        return out
    n = max(a.shape[0] for a in args)
    if n == 1:
        return _vmap_levels(fn, [a[0] for a in args]).unsqueeze(0)
    mapped = tuple(a.shape[0] != 1 for a in args)
    ins = [a if m else a[0] for a, m in zip(args, mapped, strict=True)]
    inner = torch.vmap(lambda *xs: _vmap_levels(fn, list(xs)), in_dims=tuple(0 if m else None for m in mapped))
    return inner(*ins)


def _combine(op: str, a: Mask, b: Mask) -> Mask:
    if not isinstance(b, Mask):
        raise TypeError(f"Mask {op}: expected another Mask, got {type(b).__name__}")
    if op == "&":
        out = Mask(lambda bb, h, q, k: a.fn(bb, h, q, k) & b.fn(bb, h, q, k), f"({a.name} & {b.name})")
    else:
        out = Mask(lambda bb, h, q, k: a.fn(bb, h, q, k) | b.fn(bb, h, q, k), f"({a.name} | {b.name})")
    out._op, out._children = op, (a, b)
    out.relative = a.relative and b.relative
    out._limits = a._limits + b._limits
    if a.batch is not None and b.batch is not None and 1 not in (a.batch, b.batch) and a.batch != b.batch:
        raise ValueError(f"Mask {op}: operands are tied to different batch sizes {a.batch} and {b.batch}")
    return out


# --------------------------------------------------------------------------- helpers
def _as_int(x: object, name: str) -> int:
    return check_int(x, name, minimum=None, allow_tensor=True)


def _check_dims(**dims: int) -> None:
    for name, value in dims.items():
        check_int(value, name, minimum=1, allow_tensor=True)


def _tied(mask: Mask, arg: str, *, keys: int | None = None, positions: int | None = None) -> Mask:
    """``mask``, recorded as covering key positions ``< keys`` or query and key positions
    ``< positions`` (its table ``arg``): :meth:`Mask.evaluate`, :meth:`Mask.materialize` and
    :meth:`Mask.block_map` then refuse positions beyond it instead of clamping or hiding them."""
    mask._limits = ((mask.name, arg, keys, positions),)
    return mask


def _window_side(x: object, name: str) -> int | None:
    return None if x is None else check_int(x, name, minimum=0, allow_tensor=True)


# --------------------------------------------------------------------------- the visibility rule
def visible(q_pos: Tensor, k_pos: Tensor, *, causal: bool = False,
            window: int | tuple[int | None, int | None] | None = None) -> Tensor:
    """The one causal/window rule of ``docs/conventions.md`` over absolute positions.

    Key ``j`` is visible to the query at ``p`` iff ``j <= p`` (``causal``) and
    ``p - left <= j <= p + right`` (``window=(left, right)``, ``None`` = unbounded side; an int
    ``w`` is ``(w, w)``, as in :func:`attnzoo.attention`).
    ``q_pos`` and ``k_pos`` are broadcastable int tensors; returns a bool tensor of their
    broadcast shape (a 0-d ``True`` when nothing constrains)."""
    for name, pos in (("q_pos", q_pos), ("k_pos", k_pos)):
        if not isinstance(pos, Tensor) or pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
            got = f"dtype {pos.dtype}" if isinstance(pos, Tensor) else type(pos).__name__
            raise TypeError(f"visible: {name} must be an int tensor of positions, got {got}")
    check_bool(causal, "causal", "visible")
    ok = torch.ones((), dtype=torch.bool, device=q_pos.device)
    left, right = normalize_window(window) or (None, None)
    if causal:
        ok = ok & (k_pos <= q_pos)
    if left is not None:
        ok = ok & (k_pos >= q_pos - left)
    if right is not None:
        ok = ok & (k_pos <= q_pos + right)
    return ok


# --------------------------------------------------------------------------- builders
def causal() -> Mask:
    """Key ``j`` is visible to the query at position ``p`` iff ``j <= p``."""

    def tiles(t: _Tiles) -> tuple[Tensor, Tensor]:
        return t.k_end <= t.q_start, t.k_start > t.q_end

    return Mask(lambda b, h, q, k: visible(q, k, causal=True), "causal", tiles=tiles, relative=True)


def sliding_window(left: int | None, right: int | None = 0) -> Mask:
    """Key ``j`` is visible to the query at ``p`` iff ``p - left <= j <= p + right``.

    ``None`` on a side means unbounded. ``sliding_window(w, 0)`` is a causal-side band of
    ``w`` keys before the query plus the query itself.
    """
    lo = _window_side(left, "left")
    hi = _window_side(right, "right")

    def fn(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return visible(q, k, window=(lo, hi))

    def tiles(t: _Tiles) -> tuple[Tensor, Tensor]:
        full = torch.ones((1, 1), dtype=torch.bool, device=t.q_start.device)
        empty = torch.zeros((1, 1), dtype=torch.bool, device=t.q_start.device)
        if lo is not None:
            full = full & (t.k_start >= t.q_end - lo)
            empty = empty | (t.k_end < t.q_start - lo)
        if hi is not None:
            full = full & (t.k_end <= t.q_start + hi)
            empty = empty | (t.k_start > t.q_end + hi)
        return full, empty

    return Mask(fn, f"window({lo},{hi})", tiles=tiles, relative=True)


def key_padding(lengths_or_mask: Tensor | Sequence[int]) -> Mask:
    """Hide padded keys.

    Args:
        lengths_or_mask: int lengths ``[B]`` (keys ``0 .. length-1`` are real; a length may be
            below ``Nk``) or a bool ``[B, W]`` tensor, True for real keys, one column per key
            position: used with more keys than ``W`` it is a ``ValueError`` (it would hide them);
            a wider mask is fine (built for the whole sequence, used by a cached call).
    """
    x = lengths_or_mask
    if not isinstance(x, Tensor):
        if isinstance(x, Sequence) and all(isinstance(v, int) and not isinstance(v, bool) for v in x) and len(x) > 0:
            x = torch.tensor(list(x), dtype=torch.long)
        else:
            raise TypeError(f"key_padding: expected int lengths [B] or a bool tensor [B, Nk], got {type(x).__name__}")
    if x.dtype == torch.bool:
        if x.dim() != 2:
            raise ValueError(f"key_padding: a bool mask must be [B, Nk], got shape {tuple(x.shape)}")
        real = x
        n_k = real.shape[1]

        def fn(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return real[b, k.clamp(max=n_k - 1)] & (k < n_k)

        return _tied(Mask(fn, "key_padding(bool)", batch=real.shape[0]), "lengths_or_mask", keys=n_k)
    if x.is_floating_point() or x.dim() != 1:
        raise ValueError(f"key_padding: lengths must be an int tensor [B], got dtype {x.dtype} shape {tuple(x.shape)}")
    if (x < 0).any():
        raise ValueError(f"key_padding: lengths must be >= 0, got {x.tolist()}")
    lengths = x.long()

    def fn_len(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return k < lengths[b]

    def tiles(t: _Tiles) -> tuple[Tensor, Tensor]:
        length = lengths.to(t.k_start.device).view(-1, 1, 1, 1)
        return t.k_end < length, t.k_start >= length

    return Mask(fn_len, "key_padding", tiles=tiles, batch=lengths.shape[0])


def document(doc_ids: Tensor) -> Mask:
    """Packed sequences: a query sees only keys of the same document.

    Args:
        doc_ids: int ``[N]`` or ``[B, N]`` document id of every position (queries and keys share
            the position axis, so ``q_offset + Nq <= N`` and ``Nk <= N``; a shorter table is a
            ``ValueError`` when the mask is evaluated).
    """
    if not isinstance(doc_ids, Tensor) or doc_ids.is_floating_point() or doc_ids.dtype == torch.bool:
        raise TypeError(f"document: doc_ids must be an int tensor [N] or [B, N], got {type(doc_ids).__name__}"
                        f"{' ' + str(doc_ids.dtype) if isinstance(doc_ids, Tensor) else ''}")
    if doc_ids.dim() == 1:
        doc_ids = doc_ids.unsqueeze(0)
    if doc_ids.dim() != 2:
        raise ValueError(f"document: doc_ids must be [N] or [B, N], got shape {tuple(doc_ids.shape)}")
    ids = doc_ids.long()
    n = ids.shape[1]
    single = ids.shape[0] == 1

    def fn(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        bb = torch.zeros_like(b) if single else b
        return ids[bb, q.clamp(0, n - 1)] == ids[bb, k.clamp(0, n - 1)]

    return _tied(Mask(fn, "document", batch=None if single else ids.shape[0]), "doc_ids", positions=n)


def prefix_lm(prefix_len: int | Tensor) -> Mask:
    """Prefix language model: causal, plus every query sees the first ``prefix_len`` keys.

    Args:
        prefix_len: an int ``>= 0``, or an int tensor ``[B]`` of values ``>= 0``, one per batch element.
    """
    if isinstance(prefix_len, Tensor) and prefix_len.dim() != 0:
        plen = _int_tensor(prefix_len, "prefix_len", "prefix_lm")

        def fn_t(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return (k <= q) | (k < plen[b])

        def tiles_t(t: _Tiles) -> tuple[Tensor, Tensor]:
            p = plen.to(t.k_start.device).view(-1, 1, 1, 1)
            return (t.k_end <= t.q_start) | (t.k_end < p), (t.k_start > t.q_end) & (t.k_start >= p)

        return Mask(fn_t, "prefix_lm", tiles=tiles_t, batch=plen.shape[0])
    p = _as_int(prefix_len, "prefix_len")
    if p < 0:
        raise ValueError(f"prefix_lm: prefix_len must be >= 0, got {p}")

    def tiles(t: _Tiles) -> tuple[Tensor, Tensor]:
        return (t.k_end <= t.q_start) | (t.k_end < p), (t.k_start > t.q_end) & (t.k_start >= p)

    return Mask(lambda b, h, q, k: (k <= q) | (k < p), f"prefix_lm({p})", tiles=tiles)


#: Up to this position, global tokens are looked up in a bool table (one byte a position); a
#: larger position is compared with every global position instead (no table proportional to it).
_GLOBAL_TABLE_LIMIT = 1 << 20


def _global_positions(positions: object) -> list[int]:
    """``positions`` (a non-empty sequence of ints ``>= 0`` or an int tensor ``[G]``) as a list."""
    expected = "a non-empty sequence of int positions or an int tensor [G]"
    if isinstance(positions, Tensor):
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise TypeError(f"global_tokens: positions must be {expected}, got a tensor of dtype {positions.dtype}")
        if positions.dim() != 1:
            raise ValueError(f"global_tokens: positions must be {expected}, got shape {tuple(positions.shape)}")
        vals = positions.tolist()
    elif isinstance(positions, (str, bytes)) or not isinstance(positions, Iterable):
        raise TypeError(f"global_tokens: positions must be {expected}, got {type(positions).__name__} ({positions!r})")
    else:  # plain ints are checked in Python (no tensor syncs: modules build this mask while compiled)
        vals = list(positions)
    bad = [x for x in vals if isinstance(x, bool) or not isinstance(x, int)]
    if bad:
        raise TypeError(f"global_tokens: positions must hold ints, got {type(bad[0]).__name__} ({bad[0]!r})")
    if not vals:
        raise ValueError(f"global_tokens: positions must be {expected}, got an empty {type(positions).__name__}")
    if min(vals) < 0:
        raise ValueError(f"global_tokens: positions must be >= 0, got {vals}")
    return vals


def global_tokens(positions: Sequence[int] | Tensor) -> Mask:
    """Longformer global tokens: they attend to every key and every query attends to them.

    Combine with a local pattern: ``sliding_window(w, w) | global_tokens([0])``.

    Args:
        positions: a non-empty sequence of int positions ``>= 0`` or an int tensor ``[G]``.
    """
    vals = _global_positions(positions)
    uniq = sorted(set(vals))  # in Python: no data-dependent tensor op, so compiled modules keep one graph
    gmax = uniq[-1]
    sorted_pos = torch.tensor(uniq, dtype=torch.int64)
    table: Tensor | None = None
    if gmax < _GLOBAL_TABLE_LIMIT:
        table = torch.zeros(gmax + 1, dtype=torch.bool)
        table[sorted_pos] = True

    def is_global(x: Tensor) -> Tensor:
        if table is None:  # a far position: compare with each global one ([..., G] for a moment)
            return (x.unsqueeze(-1) == sorted_pos.to(x.device)).any(dim=-1)
        t = table.to(x.device)
        return (x <= gmax) & (x >= 0) & t[x.clamp(0, gmax)]

    def count_in(lo: Tensor, hi: Tensor) -> Tensor:
        s = sorted_pos.to(lo.device)
        return torch.searchsorted(s, hi, right=True) - torch.searchsorted(s, lo, right=False)

    def tiles(t: _Tiles) -> tuple[Tensor, Tensor]:
        nq = count_in(t.q_start.contiguous(), t.q_end.contiguous())
        nk = count_in(t.k_start.contiguous(), t.k_end.contiguous())
        full = (nq == t.q_end - t.q_start + 1) | (nk == t.k_end - t.k_start + 1)
        empty = (nq == 0) & (nk == 0)
        return full, empty

    return Mask(lambda b, h, q, k: is_global(q) | is_global(k), f"global_tokens({vals[:4]})", tiles=tiles)


def _int_tensor(x: Tensor, name: str, owner: str) -> Tensor:
    """``x`` as a long ``[B]`` tensor of values ``>= 0`` (``TypeError`` for another dtype,
    ``ValueError`` for another shape or a negative value)."""
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{owner}: {name} must be an int or an int tensor [B], got dtype {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{owner}: {name} must be an int or an int tensor [B], got shape {tuple(x.shape)}")
    if x.numel() and not tracing() and bool((x < 0).any()):
        raise ValueError(f"{owner}: {name} must be >= 0, got {x.tolist()}")
    return x.long()


def _per_batch(x: int | Tensor, name: str) -> int | Tensor:
    """An int, or an int tensor ``[B]`` (one value per batch row)."""
    if isinstance(x, Tensor):
        if x.dim() != 1 or x.is_floating_point() or x.dtype == torch.bool:
            raise ValueError(f"{name} must be an int or an int tensor [B], got dtype {x.dtype} shape {tuple(x.shape)}")
        return x.long()
    return _as_int(x, name)


def chunked(size: int, start: int | Tensor = 0) -> Mask:
    """Chunked attention (Llama 4): a query sees only the keys of its own chunk.

    Position ``p`` lies in chunk ``(p - start) // size``; key ``j`` is visible to the query at ``p``
    iff both lie in one chunk. Combine with ``causal=True`` for Llama 4's chunked causal layers.

    Args:
        size: chunk length (>= 1).
        start: where chunk 0 begins, an int or an int tensor ``[B]`` per batch row (transformers
            shifts chunks by each row's left padding).
    """
    n = check_int(size, "size", minimum=1, owner="chunked")
    off = _per_batch(start, "start")

    def shift(b: Tensor, pos: Tensor) -> Tensor:
        return pos - (off.to(pos.device)[b] if isinstance(off, Tensor) else off)

    def fn(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return torch.div(shift(b, q), n, rounding_mode="floor") == torch.div(shift(b, k), n, rounding_mode="floor")

    def tiles(t: _Tiles) -> tuple[Tensor, Tensor]:
        o = off.to(t.q_start.device).view(-1, 1, 1, 1) if isinstance(off, Tensor) else off

        def chunk(x: Tensor) -> Tensor:
            return torch.div(x - o, n, rounding_mode="floor")

        q0, q1, k0, k1 = chunk(t.q_start), chunk(t.q_end), chunk(t.k_start), chunk(t.k_end)
        return (q0 == q1) & (k0 == k1) & (q0 == k0), (q1 < k0) | (k1 < q0)

    return Mask(fn, f"chunked({n})", tiles=tiles, batch=off.shape[0] if isinstance(off, Tensor) else None)


def blockwise(block_ids: Tensor) -> Mask:
    """Blocks of bidirectional attention (transformers' ``blockwise_overlay``, e.g. image tokens).

    A query sees a key iff both carry the same block id and it is ``>= 0`` (``-1`` = text, in no
    block). OR it with a causal pattern, as transformers does: ``causal() | blockwise(ids)``.

    Args:
        block_ids: int ``[N]`` or ``[B, N]``, the block of every position (queries and keys share
            the position axis, so ``q_offset + Nq <= N`` and ``Nk <= N``; a shorter table is a
            ``ValueError`` when the mask is evaluated).
    """
    if not isinstance(block_ids, Tensor) or block_ids.is_floating_point() or block_ids.dtype == torch.bool:
        raise TypeError(f"blockwise: block_ids must be an int tensor [N] or [B, N], got {type(block_ids).__name__}"
                        f"{' ' + str(block_ids.dtype) if isinstance(block_ids, Tensor) else ''}")
    ids = block_ids.long().reshape(-1, block_ids.shape[-1]) if block_ids.dim() in (1, 2) else None
    if ids is None:
        raise ValueError(f"blockwise: block_ids must be [N] or [B, N], got shape {tuple(block_ids.shape)}")
    n = ids.shape[1]
    single = ids.shape[0] == 1

    def fn(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        t = ids.to(q.device)
        bb = torch.zeros_like(b) if single else b
        gq = torch.where((q >= 0) & (q < n), t[bb, q.clamp(0, n - 1)], -1)
        gk = torch.where((k >= 0) & (k < n), t[bb, k.clamp(0, n - 1)], -1)
        return (gq == gk) & (gq >= 0)

    return _tied(Mask(fn, "blockwise", batch=None if single else ids.shape[0]), "block_ids", positions=n)


def bidirectional_window(w: int) -> Mask:
    """transformers' bidirectional sliding window: key ``j`` visible to the query at ``p`` iff
    ``|p - j| <= w`` (``sliding_window(w, w)``)."""
    return sliding_window(check_int(w, "w", minimum=0, owner="bidirectional_window"),
                          check_int(w, "w", minimum=0, owner="bidirectional_window"))


def dilated_window(left: int, right: int = 0, dilation: int = 1) -> Mask:
    """A dilated sliding window (Longformer / LongNet): the query at ``p`` sees the keys
    ``p + t * dilation`` for ``-left <= t <= right``. ``dilation=1`` is ``sliding_window(left, right)``."""
    lo = check_int(left, "left", minimum=0, owner="dilated_window")
    hi = check_int(right, "right", minimum=0, owner="dilated_window")
    d = check_int(dilation, "dilation", minimum=1, owner="dilated_window")
    band = sliding_window(lo * d, hi * d)
    if d == 1:
        return band

    def fn(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return band.fn(b, h, q, k) & (torch.remainder(q - k, d) == 0)

    def tiles(t: _Tiles) -> tuple[Tensor, Tensor]:
        full, empty = band._tiles(t)  # type: ignore[misc]
        single = (t.q_start == t.q_end) & (t.k_start == t.k_end) & (torch.remainder(t.q_start - t.k_start, d) == 0)
        return full & single, empty

    return Mask(fn, f"dilated_window({lo},{hi},{d})", tiles=tiles, relative=True)


def _pair(x: object, name: str, owner: str) -> tuple[object, object]:
    """An int for both axes, or a ``(rows, cols)`` pair (a tuple or list of two)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{owner}: {name} must be an int or a pair (rows, cols), got {x!r} ({len(x)} entries)")
        return x[0], x[1]
    return x, x


def _natten_start(i: Tensor, length: int, kernel: int, dilation: int) -> tuple[Tensor, Tensor]:
    """NATTEN's 1-D neighbourhood of index ``i`` on an axis of ``length``: ``(group, start)``, the keys
    being ``group + dilation * (start + t)`` for ``0 <= t < kernel`` (clamped inside the axis)."""
    group = torch.remainder(i, dilation)
    idx = torch.div(i, dilation, rounding_mode="floor")
    group_len = torch.div(length - group + dilation - 1, dilation, rounding_mode="floor")
    start = (idx - kernel // 2).clamp(min=0)
    return group, torch.minimum(start, group_len - kernel)


def neighborhood_2d(height: int, width: int, kernel: int | tuple[int, int], dilation: int | tuple[int, int] = 1,
                    ) -> Mask:
    """2-D neighbourhood attention (NATTEN): tokens on a ``height x width`` grid, row-major
    (position ``p`` = row ``p // width``, column ``p % width``); the query at ``(r, c)`` sees the
    ``kernel x kernel`` keys around it, the window shifted (not cut) at the grid's edges, as NATTEN
    does, so every query sees exactly ``kh * kw`` keys. With ``dilation`` the window takes every
    ``dilation``-th token of the query's own residue class along each axis.

    ``kernel`` and ``dilation`` are ints or ``(rows, cols)`` pairs. Positions outside
    ``0 .. height * width - 1`` see nothing."""
    kh, kw = _pair(kernel, "kernel", "neighborhood_2d")
    dh, dw = _pair(dilation, "dilation", "neighborhood_2d")
    H = check_int(height, "height", minimum=1, owner="neighborhood_2d")
    W = check_int(width, "width", minimum=1, owner="neighborhood_2d")
    kh, kw = (check_int(x, "kernel", minimum=1, owner="neighborhood_2d") for x in (kh, kw))
    dh, dw = (check_int(x, "dilation", minimum=1, owner="neighborhood_2d") for x in (dh, dw))
    if kh * dh > H or kw * dw > W:
        raise ValueError(f"neighborhood_2d: kernel x dilation must fit the grid, got kernel ({kh}, {kw}) x dilation "
                         f"({dh}, {dw}) on a {H} x {W} grid")

    def axis_ok(qi: Tensor, ki: Tensor, length: int, k: int, d: int) -> Tensor:
        group, start = _natten_start(qi, length, k, d)
        t = torch.div(ki, d, rounding_mode="floor")
        return (torch.remainder(ki, d) == group) & (t >= start) & (t < start + k)

    def fn(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        inside = (q >= 0) & (q < H * W) & (k >= 0) & (k < H * W)
        qr, qc = torch.div(q, W, rounding_mode="floor"), torch.remainder(q, W)
        kr, kc = torch.div(k, W, rounding_mode="floor"), torch.remainder(k, W)
        return inside & axis_ok(qr, kr, H, kh, dh) & axis_ok(qc, kc, W, kw, dw)

    return Mask(fn, f"neighborhood_2d({H}x{W},k=({kh},{kw}),d=({dh},{dw}))")
