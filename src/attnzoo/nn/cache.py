"""Key/value caches for incremental decoding.

Protocol shared by every attention module's cache (softmax caches here; the linear, performer
and infini modules have recurrent-state caches with the same members):

* ``cache.length``: tokens written so far (the position of the next token);
* ``cache.batch_size``: the batch size it was built for;
* ``cache.nbytes``: bytes it holds;
* ``cache.reset()``: forget everything (the memory is kept and reused);
* ``cache.update(...)``: absorb ``n`` new tokens and return ``(keys, values, positions)``, where
  ``positions`` is an int64 ``[Nk]`` tensor of the absolute positions of the returned keys. A
  softmax cache returns the keys the new queries may need, **in position order** (so the positions
  are contiguous, ``length - Nk .. length - 1`` after the update): the module then calls
  :func:`attnzoo.attention` with the matching ``q_offset`` and its ``causal``/``window``/ALiBi, and
  the core applies them. A recurrent-state cache returns its state and the new tokens' positions;
* ``mark()`` / ``rollback(mark)`` / ``commit(mark)``: a module takes a mark before updating, rolls
  back to it when its call raises (a failed call leaves the cache exactly as it was) and commits
  when it succeeds (the cache drops what a rollback would have needed). :func:`transaction` does
  this around a whole call: every :class:`~attnzoo.nn.base.AttentionBase` module's ``forward``
  with ``cache=`` runs in one, so a call that raises anywhere (a bad argument, the attention, the
  output projection or gate, a ``KeyboardInterrupt``) changes nothing. Transactions nest: only the
  outermost one marks, rolls back and commits. A cache made of caches (:class:`CompositeCache`: a
  model's per-layer caches, a block's self- and cross-attention caches) takes part as one: a
  model call is one transaction over every layer's cache, which the layers' own calls join.
* ``reorder(index)`` (beam search): keep the rows ``index`` (int ``[B']``, ids into the current
  ``B`` rows, repeats allowed, ``B'`` may differ from ``B``) of every per-row tensor, so row ``i``
  afterwards decodes as row ``index[i]`` did. Only between calls: inside a :func:`transaction`
  it raises ``RuntimeError``. It starts a new history: a mark taken before it must not be rolled
  back to afterwards (a slot cache refuses; the others would mix row orders). A cache whose class
  does not declare its per-row tensors (``_batch_tensors``) has ``reorderable = False`` and
  ``reorder`` raises ``TypeError`` naming it; a :class:`CompositeCache` checks every part first,
  so a refusal changes nothing.

A module called with ``cache=...`` receives only the NEW tokens, which sit at positions
``cache.length ..``; it writes their keys and values by position and advances ``length``.

Both caches are preallocated once and written in place with ``index_copy_`` (no ``torch.cat`` in
the decode loop), and store only the ``Hkv`` key/value heads: the expansion to query heads is done
by :func:`attnzoo.attention` without a copy (GQA/MQA).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import check_int as _check_int

__all__ = ["CacheList", "CompositeCache", "KVCache", "RowsCache", "SinkWindowKVCache",
           "SlidingWindowKVCache", "SnapshotCache", "check_reorder_index", "rewind", "rewindable",
           "transaction", "truncatable", "truncate", "unmarked"]

T = TypeVar("T")


def transaction(cache: Any, fn: Callable[[], T]) -> T:
    """Run ``fn()`` as one all-or-nothing step of ``cache``: mark it, roll back to the mark if ``fn``
    raises (any ``BaseException``, ``KeyboardInterrupt`` included) and commit when it returns.

    Nested calls on the same cache (a module whose forward calls another guarded step) run ``fn``
    inside the outer transaction, which alone marks, rolls back and commits. ``cache=None``, or an
    object without the protocol's ``mark`` (the module then refuses it by name), just runs ``fn``.
    """
    if cache is None or not callable(getattr(cache, "mark", None)) or getattr(cache, "in_transaction", False):
        return fn()
    mark = cache.mark()
    cache.in_transaction = True
    try:
        out = fn()
    except BaseException:
        cache.in_transaction = False
        cache.rollback(mark)
        raise
    cache.in_transaction = False
    cache.commit(mark)
    return out


def check_reorder_index(index: object, batch_size: int, owner: str) -> Tensor:
    """The ``index`` of a cache's ``reorder``: an integer tensor ``[B']`` (``B' >= 1``) of row ids in
    ``[0, batch_size)``, returned as int64 (the range is checked in eager mode only: it syncs)."""
    if not isinstance(index, Tensor) or index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        got = f"a {index.dtype} tensor" if isinstance(index, Tensor) else type(index).__name__
        raise TypeError(f"{owner}: index must be an integer tensor [B'] of row ids, got {got}")
    if index.dim() != 1 or index.numel() == 0:
        raise ValueError(f"{owner}: index must have shape [B'] with B' >= 1, got {tuple(index.shape)}")
    if not tracing():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= batch_size:
            raise ValueError(f"{owner}: index holds row ids in [{lo}, {hi}], the cache has {batch_size} rows "
                             f"(ids must be in [0, {batch_size}))")
    return index.long()


def _take_rows(value: Any, index: Tensor) -> Any:
    """Rows ``index`` (dim 0) of a tensor, of each tensor of a dict, list or dataclass (its
    fields), or ``None``."""
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _take_rows(getattr(value, f.name), index)
                                             for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: _take_rows(v, index) for k, v in value.items()}
    if isinstance(value, list):
        return [_take_rows(v, index) for v in value]
    if not isinstance(value, Tensor):
        raise TypeError(f"reorder: a per-row attribute must be a tensor (or a dict of tensors), got "
                        f"{type(value).__name__}")
    return value.index_select(0, index.to(value.device))


def reorderable(cache: Any) -> bool:
    """Whether ``cache`` can :meth:`reorder` its rows (its ``reorderable``; a foreign cache with a
    ``reorder`` method and no such flag counts as reorderable)."""
    return callable(getattr(cache, "reorder", None)) and bool(getattr(cache, "reorderable", True))


def _refusing(cache: Any) -> list[str]:
    """The class names of the caches inside ``cache`` (itself included) that cannot reorder."""
    if isinstance(cache, CompositeCache):
        return [name for part in cache.parts() for name in _refusing(part)]
    return [] if reorderable(cache) else [type(cache).__name__]


def _sequence_parts(cache: Any) -> list[Any]:
    """The member caches of ``cache`` that hold its own tokens (a block's cross-attention cache,
    which holds the context, is not one)."""
    parts = getattr(cache, "sequence_parts", None)
    return parts() if callable(parts) else cache.parts()


def truncatable(cache: Any) -> bool:
    """Whether :func:`truncate` can drop ``cache``'s last tokens: every member cache is written by
    position (keys, latents, index keys), none a recurrent state or a ring of slots."""
    if isinstance(cache, CompositeCache):
        return all(truncatable(part) for part in _sequence_parts(cache))
    return bool(getattr(cache, "truncatable", False))


def truncate(cache: Any, length: int) -> None:
    """Forget every token of ``cache`` from position ``length`` on (``0 <= length <= cache.length``),
    as if they had never been written; a composite cache's context caches are kept. ``TypeError``
    when a member cannot (:func:`truncatable`): a recurrent state or a ring of slots must be rolled
    back to a mark instead."""
    owner = f"truncate({type(cache).__name__})"
    if not truncatable(cache):
        raise TypeError(f"{owner}: these caches cannot drop tokens by length: {sorted(set(_untruncatable(cache)))}")
    length = _check_int(length, "length", owner, minimum=0)
    if length > cache.length:
        raise ValueError(f"{owner}: length must be at most the {cache.length} tokens written, got {length}")
    _truncate(cache, length)


def _untruncatable(cache: Any) -> list[str]:
    if isinstance(cache, CompositeCache):
        return [name for part in _sequence_parts(cache) for name in _untruncatable(part)]
    return [] if truncatable(cache) else [type(cache).__name__]


def _truncate(cache: Any, length: int) -> None:
    if isinstance(cache, CompositeCache):
        for part in _sequence_parts(cache):
            _truncate(part, length)
    else:
        cache.length = length


def rewindable(cache: Any, length: int) -> bool:
    """Whether :func:`rewind` can bring ``cache`` back to ``length`` tokens without feeding any again:
    every member is truncatable, or a sliding-window ring whose open transaction recorded the slots
    its updates after ``length`` overwrote (each update of at most ``window`` tokens)."""
    if isinstance(cache, CompositeCache):
        return all(rewindable(part, length) for part in _sequence_parts(cache))
    if truncatable(cache):
        return True
    plan = getattr(cache, "_rewind_plan", None)
    return callable(plan) and plan(length) is not None


def rewind(cache: Any, length: int) -> None:
    """Bring ``cache`` back to ``length`` tokens inside its open transaction (:func:`rewindable`):
    truncated members drop the later tokens, sliding-window rings restore the slots the later tokens
    overwrote; a speculative round keeps its accepted drafts without feeding them again. The
    transaction is then committed by the caller."""
    owner = f"rewind({type(cache).__name__})"
    length = _check_int(length, "length", owner, minimum=0)
    if length > cache.length:
        raise ValueError(f"{owner}: length must be at most the {cache.length} tokens written, got {length}")
    if not rewindable(cache, length):
        raise TypeError(f"{owner}: cannot come back to {length} tokens without a rollback")
    _rewind(cache, length)


def _rewind(cache: Any, length: int) -> None:
    if isinstance(cache, CompositeCache):
        for part in _sequence_parts(cache):
            _rewind(part, length)
    elif truncatable(cache):
        cache.length = length
    else:
        cache._rewind(length)


def unmarked(cache: Any) -> list[str]:
    """The class names of the caches inside ``cache`` (itself included) without ``mark``/``rollback``:
    a call through them cannot be undone."""
    if isinstance(cache, CompositeCache):
        return [name for part in cache.parts() for name in unmarked(part)]
    return [] if callable(getattr(cache, "mark", None)) and callable(getattr(cache, "rollback", None)) \
        else [type(cache).__name__]


def _reorder_unchecked(cache: Any, index: Tensor) -> None:
    """``cache``'s reorder without a second check of ``index`` (checked once by the outermost call)."""
    inner = getattr(cache, "_reorder", None)
    (inner if callable(inner) else cache.reorder)(index)


class CompositeCache(abc.ABC):
    """The ``mark``/``rollback``/``commit`` protocol of a cache made of other caches (:meth:`parts`): a
    mark holds every part's mark, and opening a :func:`transaction` on the whole (``in_transaction``)
    opens it on every part, so the parts' own module calls join it: the whole call, every layer
    and whatever runs after the last one (a norm, a head), is all-or-nothing."""

    _in_transaction: bool = False

    @abc.abstractmethod
    def parts(self) -> list[Any]:
        """The member caches that exist now."""

    def _guarded_parts(self) -> list[Any]:
        return [c for c in self.parts() if callable(getattr(c, "mark", None))]

    @property
    def in_transaction(self) -> bool:
        """True while a :func:`transaction` is open on this cache (and so on every part)."""
        return self._in_transaction

    @in_transaction.setter
    def in_transaction(self, value: bool) -> None:
        self._in_transaction = value
        for c in self._guarded_parts():
            c.in_transaction = value

    def mark(self) -> object:
        """An opaque token of every part's state, for :meth:`rollback`."""
        return tuple((c, c.mark()) for c in self._guarded_parts())

    def _check_mark(self, mark: object) -> tuple[tuple[Any, object], ...]:
        if not isinstance(mark, tuple) or not all(isinstance(m, tuple) and len(m) == 2 for m in mark):
            raise TypeError(f"{type(self).__name__}.rollback: expected a mark from mark(), got {type(mark).__name__}")
        return mark

    def rollback(self, mark: object) -> None:
        """Return every part to the state ``mark`` was taken in."""
        for c, m in self._check_mark(mark):
            c.rollback(m)

    def commit(self, mark: object) -> None:
        """The call that took ``mark`` succeeded: every part drops what a rollback would have needed."""
        for c, m in self._check_mark(mark):
            c.commit(m)

    @property
    def reorderable(self) -> bool:
        """Whether every part can :meth:`reorder` its rows."""
        return not _refusing(self)

    def reorder(self, index: Tensor) -> None:
        """Keep the rows ``index`` (int ``[B']``, ids into the current ``batch_size`` rows) of every
        part: row ``i`` then decodes as row ``index[i]`` did (beam search). Every part is checked
        before any changes (``TypeError`` naming the parts that cannot); ``RuntimeError`` inside a
        :func:`transaction`."""
        owner = f"{type(self).__name__}.reorder"
        if self.in_transaction:
            raise RuntimeError(f"{owner}: not allowed inside a transaction (reorder between model calls)")
        batch = getattr(self, "batch_size", None)
        if not isinstance(batch, int):
            raise TypeError(f"{owner}: {type(self).__name__} has no batch_size; it cannot reorder its rows")
        index = check_reorder_index(index, batch, owner)
        refused = _refusing(self)
        if refused:
            raise TypeError(f"{owner}: these caches cannot reorder their rows: {sorted(set(refused))}")
        self._reorder(index)

    def _reorder(self, index: Tensor) -> None:
        for c in self.parts():
            _reorder_unchecked(c, index)


class CacheList(CompositeCache):
    """Caches side by side, one per member (a model's layers, a :class:`~attnzoo.nn.parallel.ParallelMixers`'
    parts), with the cache protocol: ``length`` and ``batch_size`` (every member has written as
    many tokens for as many rows: the first one's), ``reset()``, ``mark()``/``rollback()``/``commit()``
    over every member; index it for one member's cache."""

    def __init__(self, caches: Sequence[Any]) -> None:
        owner = type(self).__name__
        if len(caches) == 0:
            raise ValueError(f"{owner}: need at least one cache")
        bad = [type(c).__name__ for c in caches if not (hasattr(c, "length") and hasattr(c, "reset"))]
        if bad:
            raise TypeError(f"{owner}: caches must be decode caches (with length and reset()), got {bad}")
        self.layers = list(caches)

    @property
    def length(self) -> int:
        return int(self.layers[0].length)

    @property
    def batch_size(self) -> int:
        return int(self.layers[0].batch_size)

    def reset(self) -> None:
        for c in self.layers:
            c.reset()

    def parts(self) -> list[Any]:
        """Every member's cache."""
        return list(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> Any:
        return self.layers[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.layers)


class _LengthCache:
    """The cache protocol of buffers written by position, whose state is ``length`` (tokens
    written): ``batch_size``, ``reset``, ``mark``/``rollback``/``commit``. Shared with MLA's
    :class:`~attnzoo.nn.mla.LatentCache`."""

    _batch_size: int
    length: int
    #: True while a :func:`transaction` (one module call) is open on this cache
    in_transaction: bool = False

    @property
    def batch_size(self) -> int:
        """Batch size the cache was built for."""
        return self._batch_size

    def reset(self) -> None:
        """Forget every token (the buffers are reused, not freed)."""
        self.length = 0

    def mark(self) -> object:
        """An opaque token of the current state, for :meth:`rollback`."""
        return self.length

    def _check_mark(self, mark: object) -> int:
        if isinstance(mark, bool) or not isinstance(mark, int):
            raise TypeError(f"{type(self).__name__}.rollback: expected a mark from mark(), got {type(mark).__name__}")
        return mark

    def rollback(self, mark: object) -> None:
        """Undo the updates since :meth:`mark` returned ``mark`` (slots past ``length`` are unused)."""
        self.length = self._check_mark(mark)

    def commit(self, mark: object) -> None:
        """The call that took ``mark`` succeeded: nothing to keep."""

    #: whether :func:`truncate` may drop the last tokens by lowering ``length`` (the buffers are written
    #: by position and slots past ``length`` are unused, which is also what makes ``rollback`` a length)
    truncatable: ClassVar[bool] = True

    #: the attributes holding one row per batch row (dim 0: tensors, or dicts of tensors) that
    #: :meth:`reorder` permutes; a class declares its own (``None``, or inherited only: not reorderable,
    #: so that a subclass with more per-row state is never reordered half-way)
    _batch_tensors: ClassVar[tuple[str, ...] | None] = None

    @property
    def reorderable(self) -> bool:
        """Whether :meth:`reorder` is supported (the class declares its per-row tensors)."""
        return type(self).__dict__.get("_batch_tensors") is not None

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` (int ``[B']``, ids in ``[0, batch_size)``, repeats allowed) of every
        per-row tensor: row ``i`` then holds what row ``index[i]`` held and ``batch_size`` becomes
        ``B'`` (beam search: pick the surviving beams, or expand ``B`` rows to ``B * K``).
        ``RuntimeError`` inside a :func:`transaction`; ``TypeError`` when the class is not
        :attr:`reorderable`. Marks taken before it must not be rolled back to afterwards."""
        self._reorder(_reorder_index(self, index))

    def _reorder(self, index: Tensor) -> None:
        self._batch_size = _reorder_rows(self, type(self).__dict__["_batch_tensors"], index)


def _reorder_index(cache: Any, index: object) -> Tensor:
    """The checked ``index`` of ``cache.reorder``: ``RuntimeError`` inside a transaction,
    ``TypeError`` when the cache's class does not declare its per-row tensors (``_batch_tensors``)."""
    owner = f"{type(cache).__name__}.reorder"
    if cache.in_transaction:
        raise RuntimeError(f"{owner}: not allowed inside a transaction (reorder between model calls)")
    if not cache.reorderable:
        raise TypeError(f"{owner}: {type(cache).__name__} does not declare its per-row tensors "
                        f"(_batch_tensors); it cannot reorder its rows")
    return check_reorder_index(index, cache.batch_size, owner)


def _reorder_rows(cache: object, names: Iterable[str], index: Tensor) -> int:
    """Replace every attribute ``names`` of ``cache`` by its rows ``index``; the new batch size."""
    for name in names:
        setattr(cache, name, _take_rows(getattr(cache, name), index))
    return int(index.shape[0])


class RowsCache:
    """:meth:`reorder` and ``mark``/``rollback``/``commit`` for a cache class that keeps ``batch_size``
    and ``length`` as plain attributes and declares its per-row tensors in ``_batch_tensors``
    (tensors, dicts or lists of them; dim 0 the row): a family's small state cache. A mark holds
    ``length`` and those attributes by reference, so an update must *replace* them (or write only
    past ``length``), never change in place what a mark holds."""

    batch_size: int
    length: int
    #: declared by each class itself (inherited only: not reorderable, as :class:`_LengthCache`)
    _batch_tensors: ClassVar[tuple[str, ...] | None] = None
    in_transaction: bool = False
    #: a state cache: its last tokens cannot be dropped by lowering ``length`` (a class written by
    #: position declares ``True``)
    truncatable: ClassVar[bool] = False

    def mark(self) -> object:
        """An opaque token of the current state (``length`` and the per-row attributes), for :meth:`rollback`."""
        return (self.length, *(getattr(self, name) for name in type(self).__dict__.get("_batch_tensors") or ()))

    def rollback(self, mark: object) -> None:
        """Return to the state ``mark`` was taken in."""
        names = type(self).__dict__.get("_batch_tensors") or ()
        if not isinstance(mark, tuple) or len(mark) != 1 + len(names):
            raise TypeError(f"{type(self).__name__}.rollback: expected a mark from mark(), got {type(mark).__name__}")
        self.length = mark[0]
        for name, value in zip(names, mark[1:], strict=True):
            setattr(self, name, value)

    def commit(self, mark: object) -> None:
        """The call that took ``mark`` succeeded: nothing to keep."""

    @property
    def reorderable(self) -> bool:
        """Whether :meth:`reorder` is supported (the class declares its per-row tensors)."""
        return type(self).__dict__.get("_batch_tensors") is not None

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` (int ``[B']``, ids in ``[0, batch_size)``, repeats allowed) of every
        per-row tensor; ``batch_size`` becomes ``B'`` (beam search). ``TypeError`` when the class
        is not :attr:`reorderable`."""
        rows = _reorder_index(self, index)  # checks first: an undeclared class has no _batch_tensors of its own
        self.batch_size = _reorder_rows(self, type(self).__dict__["_batch_tensors"], rows)


class SnapshotCache(_LengthCache):
    """The protocol of caches whose updates *replace* a few attributes (state tensors, counters)
    instead of writing them in place (recurrent states, Infini memory, NSA counters): a mark is a
    snapshot of the attributes named in ``snapshot``, and :meth:`rollback` restores it."""

    #: the attributes a mark holds (``length`` first)
    snapshot: tuple[str, ...] = ("length",)
    truncatable: ClassVar[bool] = False  # a state: the tokens it absorbed cannot be taken out

    def _set_sizes(self, batch_size: object, **sizes: object) -> None:
        """Validate (ints >= 1, errors naming the cache) and store ``batch_size`` and ``sizes``;
        start at ``length = 0``."""
        owner = type(self).__name__
        self._batch_size = _check_int(batch_size, "batch_size", owner=owner)
        for name, value in sizes.items():
            setattr(self, name, _check_int(value, name, owner=owner))
        self.length = 0

    def mark(self) -> object:
        """An opaque token of the current state (a tuple of the ``snapshot`` attributes)."""
        return tuple(getattr(self, name) for name in self.snapshot)

    def rollback(self, mark: object) -> None:
        """Return to the state ``mark`` was taken in."""
        if not isinstance(mark, tuple) or len(mark) != len(self.snapshot):
            raise TypeError(f"{type(self).__name__}.rollback: expected a mark from mark(), got {type(mark).__name__}")
        for name, value in zip(self.snapshot, mark, strict=True):
            setattr(self, name, value)

    def advance(self, n: object, device: torch.device) -> Tensor:
        """Count ``n`` more tokens; return their positions ``[n]`` (int64, on ``device``)."""
        count = _check_int(n, "n", minimum=0)
        self.length += count
        return torch.arange(self.length - count, self.length, device=device)


class _CacheBase(_LengthCache):
    """Buffers ``k [B, Hkv, S, D]`` and ``v [B, Hkv, S, Dv]`` plus the protocol members."""

    #: what ``repr`` shows between ``batch_size`` and ``num_kv_heads`` (the subclass's own sizes)
    _repr_sizes: tuple[str, ...] = ()

    def __init__(self, batch_size: int, slots: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int | None, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        self._batch_size = _check_int(batch_size, "batch_size", minimum=1)
        self.num_kv_heads = _check_int(num_kv_heads, "num_kv_heads", minimum=1)
        self.head_dim = _check_int(head_dim, "head_dim", minimum=1)
        self.v_head_dim = self.head_dim if v_head_dim is None else _check_int(v_head_dim, "v_head_dim", minimum=1)
        dt = dtype or torch.get_default_dtype()
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise TypeError(f"{type(self).__name__}: dtype must be a floating torch.dtype (keys and values), got {dt!r}")
        self.k = torch.zeros(self._batch_size, self.num_kv_heads, slots, self.head_dim, device=device, dtype=dt)
        self.v = torch.zeros(self._batch_size, self.num_kv_heads, slots, self.v_head_dim, device=device, dtype=dt)
        self.length = 0

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors (what the cache costs in memory)."""
        return self.k.nbytes + self.v.nbytes

    def __repr__(self) -> str:
        names = ("batch_size", *self._repr_sizes, "num_kv_heads", "head_dim", "length", "dtype")
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)}' for n in names)})"

    def _check_new(self, k_new: object, v_new: object) -> tuple[Tensor, Tensor]:
        name = type(self).__name__
        for arg, t in (("k_new", k_new), ("v_new", v_new)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}.update: {arg} must be a tensor, got {type(t).__name__}")
        assert isinstance(k_new, Tensor) and isinstance(v_new, Tensor)
        B, H = self.k.shape[:2]
        if k_new.dim() != 4 or v_new.dim() != 4 or k_new.shape[2] != v_new.shape[2]:
            raise ValueError(f"{name}.update: expected k_new [B, Hkv, n, D] and v_new [B, Hkv, n, Dv] with equal n, "
                             f"got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
        if k_new.shape[0] != B or v_new.shape[0] != B:
            raise ValueError(f"{name}: the cache was built for batch size {B}, got a batch of {k_new.shape[0]} "
                             f"(build a new cache with init_cache(batch_size={k_new.shape[0]}, ...))")
        if (k_new.shape[1], k_new.shape[3]) != (H, self.head_dim) or (v_new.shape[1], v_new.shape[3]) != (
                H, self.v_head_dim):
            raise ValueError(f"{name}: the cache holds Hkv={H} heads of dims D={self.head_dim}, Dv={self.v_head_dim}; "
                             f"got k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)}")
        if k_new.dtype != self.k.dtype or v_new.dtype != self.k.dtype:
            raise TypeError(f"{name}: the cache stores {self.k.dtype}, got k_new {k_new.dtype} and v_new {v_new.dtype}")
        if k_new.device != self.k.device:
            raise ValueError(f"{name}: the cache is on {self.k.device}, got tensors on {k_new.device}")
        return k_new, v_new


class KVCache(_CacheBase):
    """A preallocated key/value cache written by position: ``k [B, Hkv, max_len, D]``, ``v [B, Hkv, max_len, Dv]``.

    :meth:`update` writes the ``n`` new tokens at positions ``length .. length + n - 1`` and returns
    views of every key and value so far with their positions ``0 .. length - 1``; ``length`` then
    advances by ``n``. Writing past ``max_len``
    raises ``ValueError``. Memory: ``batch_size * max_len * Hkv * (D + Dv) * itemsize`` bytes.

    Args:
        batch_size: ``B``.
        max_len: the most tokens it will hold (prompt + generated).
        num_kv_heads: ``Hkv`` (1 for MQA, a divisor of the query heads for GQA).
        head_dim: ``D``; ``v_head_dim``: ``Dv`` (default ``D``).
        device, dtype: of the buffers (the module's, when built by ``module.init_cache``).
    """

    _repr_sizes = ("max_len",)
    _batch_tensors = ("k", "v")

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, *,
                 v_head_dim: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.max_len = _check_int(max_len, "max_len", minimum=1)
        super().__init__(batch_size, self.max_len, num_kv_heads, head_dim, v_head_dim, device, dtype)

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Append ``k_new [B, Hkv, n, D]``, ``v_new [B, Hkv, n, Dv]``; return ``(k, v, positions)``:
        views ``[B, Hkv, length, D]`` / ``[B, Hkv, length, Dv]`` of every token written so far and
        their positions ``0 .. length - 1`` (int64 ``[length]``)."""
        self._check_new(k_new, v_new)
        n = k_new.shape[2]
        start = self.length
        if start + n > self.max_len:
            raise ValueError(f"KVCache overflow: {start} tokens cached + {n} new > max_len={self.max_len} "
                             f"(build the cache with a larger max_len)")
        idx = torch.arange(start, start + n, device=self.k.device)
        self.k.index_copy_(2, idx, k_new)
        self.v.index_copy_(2, idx, v_new)
        self.length = start + n
        return self.k[:, :, : self.length], self.v[:, :, : self.length], torch.arange(self.length, device=idx.device)

    def keys(self) -> Tensor:
        """Cached keys ``[B, Hkv, length, D]`` (a view)."""
        return self.k[:, :, : self.length]

    def values(self) -> Tensor:
        """Cached values ``[B, Hkv, length, Dv]`` (a view)."""
        return self.v[:, :, : self.length]

    def bytes_per_token(self) -> float:
        """Key + value bytes per cached token slot (``nbytes / max_len``)."""
        return self.nbytes / self.max_len



class _SlotCache(_CacheBase):
    """A fixed set of slots overwritten in place: the slots an update overwrites are kept until
    :meth:`commit`, so :meth:`rollback` can restore them. Inside an open :func:`transaction` every
    update keeps its own record (a transaction spanning several calls, as speculative decoding's,
    rolls back all of them, latest first); outside one only the last update is undoable."""

    _undo: list[tuple[int, Tensor, list[tuple[Tensor, int, Tensor]]]] | None = None
    capacity: int
    truncatable: ClassVar[bool] = False  # a ring: the slots of earlier tokens are overwritten

    def _save(self, mark: int, slots: Tensor, buffers: list[tuple[Tensor, int]]) -> None:
        """Keep the ``slots`` of every ``(buffer, dim)`` about to be overwritten by the update after ``mark``."""
        record = (mark, slots, [(buf, dim, buf.index_select(dim, slots)) for buf, dim in buffers])
        self._undo = [*self._undo, record] if self.in_transaction and self._undo else [record]

    def rollback(self, mark: object) -> None:
        """Undo the updates made after ``mark`` (their overwritten slots restored, latest first)."""
        mark = self._check_mark(mark)
        undo = self._undo or []
        if self.length != mark and not any(m == mark for m, _, _ in undo):
            raise RuntimeError(f"{type(self).__name__}.rollback: only the last update (or those of the open "
                               f"transaction) can be undone")
        while self.length != mark:
            start, slots, saved = undo.pop()
            for buf, dim, old in saved:
                buf.index_copy_(dim, slots, old)
            self.length = start
        self._undo = None

    def commit(self, mark: object) -> None:
        """The call that took ``mark`` succeeded: drop the copies of the overwritten slots."""
        self._undo = None

    def _reorder(self, index: Tensor) -> None:
        super()._reorder(index)
        self._undo = None  # the saved slots are in the old row order: the last update is no longer undoable

    def bytes_per_token(self) -> float:
        """Key + value bytes per slot (the cache holds ``capacity`` slots whatever the length)."""
        B, H = self.k.shape[:2]
        return float(B * H * (self.head_dim * self.k.element_size() + self.v_head_dim * self.v.element_size()))


class SlidingWindowKVCache(_SlotCache):
    """A ring buffer for causal sliding-window attention that never holds more than the window.

    With ``window = w`` (the module convention: a query sees itself and the ``w`` keys before
    it) the buffers hold ``capacity = w`` slots, ``k [B, Hkv, w, D]``: the keys *before* the next
    query (its own key comes with the call that needs it). Token ``p`` lives in slot ``p % w``;
    ``slot_positions[s]`` is the absolute position in slot ``s`` (``-1`` when empty). Keys are
    stored after RoPE, so their rotation stays right after wrap-around.

    :meth:`update` returns ``(k, v, key_positions)``: the held keys followed by the ``n`` new ones,
    in position order, and their absolute positions ``[Nk]`` (contiguous: ``length - Nk .. length -
    1`` after the update; decoding one token gets ``Nk <= w + 1`` keys, every one visible), then
    keeps the last ``min(n, w)`` new tokens in the ring.

    Args:
        batch_size: ``B``.
        window: ``w >= 0``, keys before the query that stay visible.
        num_kv_heads, head_dim, v_head_dim: as for :class:`KVCache`.
        max_len: optional limit on the total number of tokens (``None`` = unbounded; the memory does
            not depend on it). Exceeding it raises ``ValueError``.
        device, dtype: of the buffers.
    """

    _repr_sizes = ("window", "capacity")
    _batch_tensors = ("k", "v")

    def __init__(self, batch_size: int, window: int, num_kv_heads: int, head_dim: int, *,
                 v_head_dim: int | None = None, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self.window = _check_int(window, "window", minimum=0)
        self.capacity = self.window
        self.max_len = None if max_len is None else _check_int(max_len, "max_len", minimum=1)
        super().__init__(batch_size, self.capacity, num_kv_heads, head_dim, v_head_dim, device, dtype)
        self.slot_positions = torch.full((self.capacity,), -1, dtype=torch.long, device=self.k.device)

    def reset(self) -> None:
        self.length = 0
        self.slot_positions.fill_(-1)
        self._undo = None

    def _rewind_plan(self, length: int) -> list[tuple[Tensor, list[tuple[Tensor, int, Tensor]]]] | None:
        """The slots to restore (and their old contents) to come back to ``length`` tokens, from the
        open transaction's records: the positions ``length ..`` of every later update; ``None``
        when they cannot (an update cut by ``length`` that held fewer of its new tokens than the
        ring at ``length`` needs: more than ``capacity`` of them)."""
        if not 0 <= length <= self.length or (length < self.length and not self.in_transaction):
            return None
        plan, end = [], self.length
        for start, slots, saved in reversed(self._undo or []):
            if end <= length:
                break
            kept = end - slots.numel()  # positions kept..end-1 sit in `slots`
            if start < length and max(start, length - self.capacity) < kept:  # cut: the ring needs tokens it never held
                return None
            at = max(length, start, kept) - kept  # restore the slots of the positions from `length` (all: a whole update)
            count = slots.numel() - at
            plan.append((slots[at:at + count], [(buf, dim, old.narrow(dim, at, count)) for buf, dim, old in saved]))
            end = start
        return plan if end <= length else None

    def _rewind(self, length: int) -> None:
        """Come back to ``length`` tokens (:meth:`_rewind_plan` said it can): the overwritten slots restored."""
        for slots, saved in self._rewind_plan(length) or []:
            for buf, dim, old in saved:
                buf.index_copy_(dim, slots, old)
        self.length = length

    @property
    def num_cached(self) -> int:
        """Tokens currently held (``min(length, capacity)``)."""
        return min(self.length, self.capacity)

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Append ``n`` tokens; return ``(k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv], key_positions [Nk])``
        in position order."""
        self._check_new(k_new, v_new)
        n = k_new.shape[2]
        start = self.length
        if self.max_len is not None and start + n > self.max_len:
            raise ValueError(f"SlidingWindowKVCache overflow: {start} tokens seen + {n} new > max_len={self.max_len}")
        held = self.num_cached
        order = torch.arange(start - held, start, device=self.k.device) % max(self.capacity, 1)  # slots, by position
        out_k = torch.cat((self.k.index_select(2, order), k_new), dim=2)  # [B, Hkv, held + n, D]
        out_v = torch.cat((self.v.index_select(2, order), v_new), dim=2)
        if n == 0:  # nothing to absorb: the held keys, and the last update stays undoable
            return out_k, out_v, torch.arange(start - held, start, device=self.k.device)
        keep = min(n, self.capacity)  # only the last `capacity` new tokens can still be needed later
        pos_keep = torch.arange(start + n - keep, start + n, device=self.k.device)
        slots = pos_keep % max(self.capacity, 1)
        self._save(start, slots, [(self.k, 2), (self.v, 2), (self.slot_positions, 0)])
        self.k.index_copy_(2, slots, k_new[:, :, n - keep:])
        self.v.index_copy_(2, slots, v_new[:, :, n - keep:])
        self.slot_positions.index_copy_(0, slots, pos_keep)
        self.length = start + n
        return out_k, out_v, torch.arange(start - held, start + n, device=self.k.device)


class SinkWindowKVCache(_SlotCache):
    """StreamingLLM's cache: ``n`` attention-sink tokens kept forever plus a ring of the last ``w``.

    With ``sink_tokens = n`` and ``window = w`` the buffers hold ``capacity = n + w`` slots (``max_len``
    if smaller): token
    ``p < n`` lives in slot ``p``, token ``p >= n`` in slot ``n + (p - n) % w``. That is every key
    *before* the next query that it can see under
    ``causal() & (sliding_window(w, 0) | global_tokens(range(n)))``, and never more (its own key
    comes with the call that needs it).

    :meth:`update` returns ``(k, v, key_positions)`` in position order (ascending; contiguous except
    for the gap between the sinks and the window): the keys held before the call followed by its
    ``m`` new keys (decoding one token: ``Nk <= n + w + 1``, every key visible), then keeps only
    what later queries can need. Whether the keys are stored after RoPE (absolute positions) or before it
    (StreamingLLM's positions inside the cache) is the module's choice.

    Args:
        batch_size: ``B``.
        sink_tokens: ``n >= 0``, the first tokens that stay visible to every query.
        window: ``w >= 0``, keys before the query that stay visible.
        num_kv_heads, head_dim, v_head_dim: as for :class:`KVCache`.
        max_len: optional limit on the total number of tokens (``None`` = unbounded).
        device, dtype: of the buffers.
    """

    _repr_sizes = ("sink_tokens", "window", "capacity")
    _batch_tensors = ("k", "v")

    def __init__(self, batch_size: int, sink_tokens: int, window: int, num_kv_heads: int, head_dim: int, *,
                 v_head_dim: int | None = None, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self.sink_tokens = _check_int(sink_tokens, "sink_tokens", minimum=0)
        self.window = _check_int(window, "window", minimum=0)
        self.max_len = None if max_len is None else _check_int(max_len, "max_len", minimum=1)
        # a stream of at most max_len tokens never fills more slots (its positions map to themselves)
        ring = self.sink_tokens + self.window
        self.capacity = ring if self.max_len is None else min(ring, self.max_len)
        super().__init__(batch_size, self.capacity, num_kv_heads, head_dim, v_head_dim, device, dtype)

    def _held_ranges(self, length: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The held positions after ``length`` tokens as two ``[lo, hi)`` ranges (sinks, ring); Python
        ints, so that compiled callers see no data-dependent shapes."""
        n, ring = self.sink_tokens, self.window
        return (0, min(length, n)), (max(n, length - ring), max(n, length))

    def _positions(self, ranges: Iterable[tuple[int, int]], offset: int = 0) -> Tensor:
        parts = [torch.arange(lo, hi, device=self.k.device) - offset for lo, hi in ranges]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=self.k.device)

    def held_positions(self, length: int | None = None) -> Tensor:
        """Absolute positions of the keys held after ``length`` tokens (default: now), ascending."""
        return self._positions(self._held_ranges(self.length if length is None else length))

    def _slots(self, positions: Tensor) -> Tensor:
        n = self.sink_tokens
        return torch.where(positions < n, positions, n + (positions - n) % max(self.window, 1))

    def reset(self) -> None:
        self.length = 0
        self._undo = None

    @property
    def num_cached(self) -> int:
        """Keys currently held (at most ``capacity``)."""
        return int(self.held_positions().numel())

    def update(self, k_new: Tensor, v_new: Tensor, *, sink_offsets: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
        """Append ``m`` tokens; return ``(k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv], key_positions [Nk])``
        in position order.

        ``sink_offsets`` (int ``[B]``, left padding): row ``b``'s sink slot ``i`` holds its token at
        ``P_b + i`` (the first ``n`` from its first real token) instead of position ``i``; the ring
        is unchanged (it holds positions ``>= n``, so a padded row's sinks may also sit there: the
        module hides them). Positions in the result then label sink slot ``i`` as ``i``.
        """
        self._check_new(k_new, v_new)
        if sink_offsets is not None and (not isinstance(sink_offsets, Tensor) or sink_offsets.is_floating_point()
                                         or sink_offsets.dtype == torch.bool
                                         or tuple(sink_offsets.shape) != (k_new.shape[0],)):
            got = (f"{sink_offsets.dtype} {tuple(sink_offsets.shape)}" if isinstance(sink_offsets, Tensor)
                   else type(sink_offsets).__name__)
            raise ValueError(f"SinkWindowKVCache: sink_offsets must be an int tensor [B] = [{k_new.shape[0]}] or "
                             f"None, got {got}")
        m, start = k_new.shape[2], self.length
        if self.max_len is not None and start + m > self.max_len:
            raise ValueError(f"SinkWindowKVCache overflow: {start} tokens seen + {m} new > max_len={self.max_len}")
        before = self.held_positions(start)
        if m == 0:  # nothing to absorb: the held keys, unchanged
            old = self._slots(before)
            return self.k.index_select(2, old), self.v.index_select(2, old), before
        old = self._slots(before)
        out_k = torch.cat((self.k.index_select(2, old), k_new), dim=2)  # [B, Hkv, held + m, D]
        out_v = torch.cat((self.v.index_select(2, old), v_new), dim=2)
        out_pos = torch.cat((before, torch.arange(start, start + m, device=self.k.device)))
        after_ranges = self._held_ranges(start + m)
        n = self.sink_tokens
        if sink_offsets is None:
            needed = after_ranges
            sink_slots = torch.zeros(0, dtype=torch.long, device=self.k.device)
        else:  # the sink slots are written per row below; by position only the ring
            needed = after_ranges[1:]
            sink_slots = torch.arange(n, device=self.k.device)
        # indices into the chunk of the new tokens still needed
        keep = self._positions([(max(lo, start), hi) for lo, hi in needed if hi > max(lo, start)], start)
        slots = self._slots(keep + start)
        self._save(start, torch.cat((sink_slots, slots)), [(self.k, 2), (self.v, 2)])
        self.k.index_copy_(2, slots, k_new.index_select(2, keep))
        self.v.index_copy_(2, slots, v_new.index_select(2, keep))
        if sink_offsets is not None and n:
            self._write_sinks(k_new, v_new, sink_offsets, start)
        self.length = start + m
        return out_k, out_v, out_pos

    def _write_sinks(self, k_new: Tensor, v_new: Tensor, offsets: Tensor, start: int) -> None:
        """Row ``b``'s sink slot ``i`` <- its new token at position ``offsets[b] + i`` (if in this chunk)."""
        B, H, m = k_new.shape[:3]
        n = self.sink_tokens
        idx = offsets.to(self.k.device).view(B, 1) + torch.arange(n, device=self.k.device) - start  # [B, n]
        inside = ((idx >= 0) & (idx < m)).view(B, 1, n, 1)
        gather = idx.clamp(0, m - 1).view(B, 1, n, 1)
        for buf, new in ((self.k, k_new), (self.v, v_new)):
            picked = new.gather(2, gather.expand(B, H, n, new.shape[-1]))  # [B, Hkv, n, D]
            buf[:, :, :n] = torch.where(inside, picked, buf[:, :, :n])

    def sink_keys(self) -> tuple[Tensor, Tensor]:
        """The sink slots held now: ``k [B, Hkv, min(length, n), D]``, ``v`` likewise (views)."""
        ns = min(self.length, self.sink_tokens)
        return self.k[:, :, :ns], self.v[:, :, :ns]
