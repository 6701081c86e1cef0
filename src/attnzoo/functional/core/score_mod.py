"""User score functions (``score_mod``): validation, the tensors they capture, and their backward.

A ``score_mod`` has FlexAttention's signature ``fn(score, b, h, q_idx, kv_idx) -> score``: ``score``
is a float tensor of scaled (and soft-capped) scores ``[B, Hq, bq, bk]`` for one tile, and the four
indices are int64 tensors that broadcast to it (``b [B, 1, 1, 1]``, ``h [1, Hq, 1, 1]``,
``q_idx [1, 1, bq, 1]``, ``kv_idx [1, 1, 1, bk]``) holding **absolute** positions (queries at
``q_offset ..``, keys at ``0 ..``; ``docs/conventions.md``). It must return a tensor of the score's
shape and dtype, using elementwise operations and indexing only (so that evaluating it on one tile
at a time is the same as evaluating it on the whole matrix).

Gradients to captured tensors: the backends that evaluate ``score_mod`` per tile (``tiled``) run
their own backward, so they must know which tensors it reads. :func:`check_score_mod` calls it
once on a tiny probe (2 x 2 x 2 x 2 scores at the extreme indices) under a
:class:`torch.overrides.TorchFunctionMode` that records every tensor the function touches that
it did not receive or create: a closure's table, a module's parameter, a global. Those needing
gradients become inputs of the tiled autograd function; its backward re-runs ``score_mod`` on each
tile under ``torch.enable_grad`` and asks autograd for the vector-Jacobian product w.r.t. the
tile's scores and those tensors, summing the latter over tiles (:func:`score_mod_vjp`). The same probe
follows what is computed from the score: a score_mod that only adds a bias (``score + bias(b, h,
q_idx, kv_idx)``, ALiBi, relative-position tables, FoX's forget bias) has the identity as its
gradient w.r.t. the score, so when no captured tensor needs a gradient the backward does not re-run
it (at 16k tokens this took a score_mod ALiBi training step from 1.40x to about 1.1x the built-in
``alibi_slopes`` path). Like FlexAttention, a score_mod must not branch in Python on tensor values:
the probe's path is taken to be every tile's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.overrides import TorchFunctionMode

from attnzoo._devices import tracing

__all__ = ["ScoreMod", "ScoreModFn", "check_score_mod", "score_indices", "score_mod_vjp"]

ScoreModFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ScoreMod:
    """A validated ``score_mod``, the captured tensors it reads (in first-use order) and whether it
    is additive: ``score_mod(score, ...) = score + bias(b, h, q_idx, kv_idx)`` (the score passes
    through one add or subtract, as its first operand for a subtraction, and nothing else), so that
    its gradient w.r.t. the score is the identity and the backward need not re-run it for the score."""

    fn: ScoreModFn
    captured: tuple[Tensor, ...] = ()
    additive: bool = False

    @property
    def needs_grad(self) -> bool:
        """Whether a captured tensor needs a gradient (autograd is enabled and one requires it)."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in self.captured)


_ADDS = (Tensor.__add__, Tensor.__radd__, Tensor.add, torch.add)
_SUBS = (Tensor.__sub__, Tensor.sub, torch.sub)
#: what may be read of the score without its values (a property getter's name is "__get__")
_METADATA = frozenset({"__get__", "size", "dim", "ndimension", "numel", "stride", "element_size", "is_contiguous",
                       "is_floating_point", "get_device"})


class _Captures(TorchFunctionMode):
    """Records the tensors a function reads that are neither its arguments nor made inside it, and
    follows what is computed from ``score`` (the first of ``own``) to tell whether the function is
    additive (see :class:`ScoreMod`): a chain of ``y + x`` / ``x + y`` / ``y - x`` from the score, each
    ``x`` not computed from the score, whose end is returned; any other operation on the score or on
    what was computed from it makes it not additive."""

    def __init__(self, own: tuple[Tensor, ...]) -> None:
        super().__init__()
        self._seen: dict[int, Tensor] = {id(t): t for t in own}  # holds them: ids stay unique
        self.found: list[Tensor] = []
        self._chain: set[int] = {id(own[0])}  # score + (terms not computed from it)
        self._derived: set[int] = {id(own[0])}  # everything computed from the score
        self._kept: list[Tensor] = []  # keeps the chain's tensors alive: ids stay unique
        self.other_use = False

    def _note(self, tree: object, *, made: bool) -> None:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, Tensor) and id(leaf) not in self._seen:
                self._seen[id(leaf)] = leaf
                if not made:
                    self.found.append(leaf)

    def _from_score(self, x: object) -> bool:
        return isinstance(x, Tensor) and id(x) in self._derived

    def _in_chain(self, x: object) -> bool:
        return isinstance(x, Tensor) and id(x) in self._chain

    def _is_shift(self, func: object, args: tuple, kwargs: dict) -> bool:
        if kwargs.get("alpha", 1) != 1 or len(args) != 2 or set(kwargs) - {"alpha"}:
            return False
        a, b = args
        if func in _SUBS:
            return self._in_chain(a) and not self._from_score(b)
        return func in _ADDS and ((self._in_chain(a) and not self._from_score(b))
                                  or (self._in_chain(b) and not self._from_score(a)))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self._note((args, kwargs), made=False)
        uses_score = any(self._from_score(x) for x in pytree.tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        self._note(out, made=True)
        made = [x for x in pytree.tree_leaves(out) if isinstance(x, Tensor)]
        if uses_score and not made and getattr(func, "__name__", "") not in _METADATA:
            self.other_use = True  # the score's values left torch (.tolist(), .numpy(), .item()): not followed
        elif uses_score and made:
            if self._is_shift(func, args, kwargs) and isinstance(out, Tensor):
                self._chain.add(id(out))
            else:
                self.other_use = True
            self._derived.update(id(x) for x in made)
            self._kept.extend(made)
        return out

    def additive(self, result: Tensor) -> bool:
        """Whether the function that returned ``result`` is additive in the score."""
        return not self.other_use and id(result) in self._chain


def score_indices(batch: int, heads: int, q_lo: int, q_hi: int, k_lo: int, k_hi: int,
                  device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(b [B,1,1,1], h [1,H,1,1], q_idx [1,1,q_hi-q_lo,1], kv_idx [1,1,1,k_hi-k_lo])`` int64, where
    ``q_lo:q_hi`` and ``k_lo:k_hi`` are absolute positions."""
    return (torch.arange(batch, device=device).view(-1, 1, 1, 1),
            torch.arange(heads, device=device).view(1, -1, 1, 1),
            torch.arange(q_lo, q_hi, device=device).view(1, 1, -1, 1),
            torch.arange(k_lo, k_hi, device=device).view(1, 1, 1, -1))


def _probe_indices(q: Tensor, nk: int, q_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The first and last batch row, head, query position and key (2 each; 1 where there is one)."""
    B, H, Nq = q.shape[:3]

    def ends(lo: int, n: int) -> list[int]:
        return [lo] if n == 1 else [lo, lo + n - 1]

    dev = q.device
    return (torch.tensor(ends(0, B), device=dev).view(-1, 1, 1, 1),
            torch.tensor(ends(0, H), device=dev).view(1, -1, 1, 1),
            torch.tensor(ends(q_offset, Nq), device=dev).view(1, 1, -1, 1),
            torch.tensor(ends(0, nk), device=dev).view(1, 1, 1, -1))


def check_score_mod(score_mod: object, q: Tensor, nk: int, q_offset: int) -> ScoreMod | None:
    """Validate ``score_mod`` for queries ``q [B, Hq, Nq, D]`` against ``nk`` keys at ``q_offset``.

    Calls it once on a probe of scores (2 per dimension, at the first and last batch row, head,
    query position and key; the compute dtype of ``q``) to check that it runs and returns a
    tensor of the score's shape and dtype, and to find the tensors it captures. Raises
    ``TypeError`` (not callable, wrong return type or dtype) or ``ValueError`` (wrong shape, or it
    raised) naming ``score_mod``. Empty inputs (no batch, query or key) skip the probe."""
    if score_mod is None:
        return None
    if not callable(score_mod):
        raise TypeError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, "
                        f"got {type(score_mod).__name__}")
    B, Nq = q.shape[0], q.shape[2]
    if B == 0 or Nq == 0 or nk == 0 or tracing():
        return ScoreMod(score_mod)  # type: ignore[arg-type]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    idx = _probe_indices(q, nk, q_offset)
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in idx)))
    score = torch.zeros(shape, dtype=cdt, device=q.device)
    mode = _Captures((score, *idx))
    try:
        with torch.no_grad(), mode:
            out = score_mod(score, *idx)
    except Exception as e:
        raise ValueError(f"score_mod raised {type(e).__name__}: {e} (called as score_mod(score {list(shape)} "
                         f"{cdt}, b, h, q_idx, kv_idx) with broadcastable int64 index tensors)") from e
    if not isinstance(out, Tensor):
        raise TypeError(f"score_mod must return a tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"score_mod must return a tensor of the score's shape: called with score "
                         f"{list(shape)}, it returned {list(out.shape)}")
    if out.dtype != cdt:
        raise TypeError(f"score_mod must return the score's dtype {cdt}, got {out.dtype} (a captured tensor "
                        f"of another dtype promotes the result: cast it, e.g. bias.to(score.dtype))")
    return ScoreMod(score_mod, tuple(t for t in mode.found if t.is_floating_point() or t.is_complex()),  # type: ignore[arg-type]
                    mode.additive(out))


def score_mod_vjp(mod: ScoreMod, s: Tensor, ds_out: Tensor, index: tuple[Tensor, Tensor, Tensor, Tensor],
                  captured_grads: list[Tensor | None] | None) -> Tensor:
    """Backward of ``score_mod`` on one tile: given the scores it received ``s [B, Hq, bq, bk]`` and
    the gradient of its output ``ds_out`` (same shape), return the gradient w.r.t. ``s`` and add
    those w.r.t. the captured tensors into ``captured_grads`` (one slot per ``mod.captured``)."""
    wanted = [t for t in mod.captured if t.requires_grad] if captured_grads is not None else []
    if mod.additive and not wanted:  # d(score + bias)/d(score) = 1: nothing to re-run
        return ds_out
    with torch.enable_grad():
        s_in = s.detach().requires_grad_(True)
        out = mod.fn(s_in, *index)
        grads = torch.autograd.grad(out, [s_in, *wanted], ds_out, allow_unused=True)
    if captured_grads is not None:
        it = iter(grads[1:])
        for i, t in enumerate(mod.captured):
            if not t.requires_grad:
                continue
            g = next(it)
            if g is not None:
                prev = captured_grads[i]
                captured_grads[i] = g if prev is None else prev + g
    return torch.zeros_like(s) if grads[0] is None else grads[0]
