"""Packed sequences (``x [1, T, C]`` with int32 ``cu_seqlens [S+1]``) for modules without a fused path.

:func:`run_per_sequence` runs a module on each sequence ``x[:, cu[i]:cu[i+1]]`` alone and concatenates
the outputs: exact by construction (each sequence sees only itself), at the cost of one call per
sequence. The recurrent mixers have a fused path instead (``attnzoo.nn.recurrent``).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnzoo.nn.frontier import packed_cu_seqlens

__all__ = ["accepts_cu_seqlens", "check_packed_call", "run_packed", "run_packed_cross", "run_per_sequence"]


def accepts_cu_seqlens(module: nn.Module, name: str = "cu_seqlens") -> bool:
    """Whether ``module.forward`` takes a ``name`` keyword (default ``cu_seqlens``)."""
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature
        return False


def check_packed_call(owner: str, x: Tensor, cu_seqlens: object, **unsupported: object) -> Tensor:
    """Validated ``cu_seqlens`` (on x's device) for a packed call that takes none of ``unsupported``."""
    given = [name for name, value in unsupported.items() if value is not None and value is not False]
    if given:
        raise ValueError(f"{owner}: packed input (cu_seqlens) takes no {', '.join(given)}")
    return packed_cu_seqlens(cu_seqlens, x, owner)


def run_per_sequence(forward: Callable[[Tensor], Tensor], x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """``forward`` on each packed sequence of ``x [1, T, C]`` alone -> ``[1, T, C_out]`` (``cu_seqlens``
    validated by the caller; empty sequences are skipped)."""
    bounds = [int(c) for c in cu_seqlens.tolist()]
    lengths = [hi - lo for lo, hi in itertools.pairwise(bounds)]
    # one split, not a slice per sequence: autograd would build a full-length gradient for each slice
    outs = [forward(piece) for piece, n in zip(x.split(lengths, dim=1), lengths, strict=True) if n > 0]
    return torch.cat(outs, dim=1)


#: What a module's ValueError says when it takes ``cu_seqlens`` but has no fused path for its configuration
#: (``MultiHeadAttention`` with sink tokens, a local-global pattern, sigmoid scores, ...).
REFUSAL = "packed input (cu_seqlens)"


def run_packed(module: nn.Module, x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """``module`` on packed ``x [1, T, C]``: its fused path when it has one, else :func:`run_per_sequence`.

    ``cu_seqlens`` must be validated by the caller. A module whose forward takes no ``cu_seqlens``, or
    refuses it for its configuration (a ``ValueError`` naming "packed input (cu_seqlens)", raised before
    any work), runs one sequence at a time: exact either way. (A ``packs_cu_seqlens()`` method on such
    modules would let this choose without the call.)"""
    if accepts_cu_seqlens(module):
        try:
            return module(x, cu_seqlens=cu_seqlens)  # type: ignore[no-any-return]
        except ValueError as err:
            if REFUSAL not in str(err):
                raise
    return run_per_sequence(module, x, cu_seqlens)


def run_packed_cross(module: nn.Module, x: Tensor, context: Tensor, cu_seqlens: Tensor,
                     context_cu_seqlens: Tensor) -> Tensor:
    """Cross-attention ``module(x, context)`` of packed pairs: query sequence ``i`` of ``x [1, Tq, C]``
    (``cu_seqlens [S+1]``) reads context sequence ``i`` of ``context [1, Tk, C_kv]``
    (``context_cu_seqlens [S+1]``, the same ``S``) only -> ``[1, Tq, C_out]``.

    The module's fused path when its forward takes ``context_cu_seqlens`` (and does not refuse this
    configuration with a ``ValueError`` naming "packed input (cu_seqlens)"), else one pair at a
    time: exact either way. Both ``cu_seqlens`` must be validated by the caller; a pair without
    queries is skipped."""
    if accepts_cu_seqlens(module, "context_cu_seqlens"):
        try:
            return module(x, context, cu_seqlens=cu_seqlens,  # type: ignore[no-any-return]
                          context_cu_seqlens=context_cu_seqlens)
        except ValueError as err:
            if REFUSAL not in str(err):
                raise
    q_bounds, k_bounds = ([int(c) for c in cu.tolist()] for cu in (cu_seqlens, context_cu_seqlens))
    q_len = [hi - lo for lo, hi in itertools.pairwise(q_bounds)]
    k_len = [hi - lo for lo, hi in itertools.pairwise(k_bounds)]
    pairs = zip(x.split(q_len, dim=1), context.split(k_len, dim=1), q_len, strict=True)
    return torch.cat([module(piece, ctx) for piece, ctx, n in pairs if n > 0], dim=1)
