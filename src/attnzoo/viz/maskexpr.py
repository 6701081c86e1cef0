"""Mask expressions: ``"causal & window(4,0)"`` -> a :class:`attnzoo.masks.Mask`, a dense table, text."""

from __future__ import annotations

import ast
import re
from typing import Any

import torch
from torch import Tensor

from attnzoo import masks as M
from attnzoo._memory import refuse_if_too_big
from attnzoo._validate import check_int

__all__ = ["BYTES_PER_PAIR", "dense_mask", "mask_to_text", "parse_mask"]

#: Memory per (query, key) pair of drawing a mask: the bool table with the predicate's temporaries
#: and the text (a Python str of one wide character per pair, built and joined row by row; measured
#: 14-21 bytes per pair at n = 2000-4000) and its UTF-8 encoding when printed.
BYTES_PER_PAIR = 24

_BUILDERS: dict[str, Any] = {
    "causal": M.causal,
    "window": M.sliding_window,
    "sliding_window": M.sliding_window,
    "prefix_lm": M.prefix_lm,
    "global_tokens": lambda *pos: M.global_tokens(list(pos)),
    "key_padding": lambda *lengths: M.key_padding(list(lengths)),
    "padding": lambda *lengths: M.key_padding(list(lengths)),
    "document": lambda *lengths: M.document(torch.repeat_interleave(
        torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))),
}


def _arg(expr: str, node: ast.AST) -> Any:
    """An argument of a builder call: an int (possibly negative) or None."""
    if isinstance(node, ast.Constant) and (node.value is None or (isinstance(node.value, int)
                                                                  and not isinstance(node.value, bool))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    raise ValueError(f"mask expression {expr!r}: arguments must be integers or None, got {ast.unparse(node)!r}")


def _build(expr: str, node: ast.AST) -> M.Mask:
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
        a, b = _build(expr, node.left), _build(expr, node.right)
        return a & b if isinstance(node.op, ast.BitAnd) else a | b
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        return ~_build(expr, node.operand)
    if isinstance(node, ast.Name) and node.id == "causal":
        return M.causal()
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BUILDERS:
        if node.keywords:
            raise ValueError(f"mask expression {expr!r}: keyword arguments are not supported")
        try:
            return _BUILDERS[node.func.id](*[_arg(expr, a) for a in node.args])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"mask expression {expr!r}: {node.func.id}(...): {exc}") from None
    raise ValueError(f"mask expression {expr!r}: unexpected {ast.unparse(node)!r}; expected "
                     f"causal, window(l, r), prefix_lm(n), global(p, ...), padding(n, ...), "
                     f"document(len, ...) combined with & | ~")


def parse_mask(expr: str) -> M.Mask:
    """Build a :class:`attnzoo.masks.Mask` from an expression.

    Names: ``causal``, ``window(left, right)`` (``None`` = unbounded), ``prefix_lm(n)``,
    ``global(p, ...)``, ``padding(len, ...)`` (one length per batch element) and
    ``document(len, ...)`` (lengths of the packed documents); operators ``&``, ``|``, ``~`` and
    parentheses. Example: ``"causal & (window(4, 0) | global(0))"``. Only these forms are
    accepted (the expression is parsed, never evaluated).
    """
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError(f"mask expression must be a non-empty string, got {expr!r}")
    # "global" is a Python keyword: read it as the builder name before parsing.
    text = re.sub(r"\bglobal\s*\(", "global_tokens(", expr.strip())
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"mask expression {expr!r} is not valid: {exc.msg}") from None
    return _build(expr, tree.body)


def dense_mask(mask: M.Mask | Tensor | str, n_q: int, n_k: int | None = None, *, q_offset: int | None = None,
               batch: int = 0) -> Tensor:
    """The bool table ``[Nq, Nk]`` of ``mask`` (True = may attend) for batch element ``batch``.

    Refuses (``ValueError``) sizes whose drawing would need more memory than is available.
    """
    n_k = n_q if n_k is None else n_k
    for name, v in (("n_q", n_q), ("n_k", n_k)):
        check_int(v, name)
    if isinstance(mask, str):
        mask = parse_mask(mask)
    if isinstance(mask, M.Mask):
        refuse_if_too_big(BYTES_PER_PAIR * n_q * n_k, f"drawing a {n_q} x {n_k} mask")
        b = max(1, max((leaf.batch or 1) for leaf in mask._leaves()))
        if not 0 <= batch < b:
            raise ValueError(f"batch index {batch} out of range for a mask of batch size {b}")
        return mask.materialize(b, 1, n_q, n_k, q_offset=q_offset)[batch, 0]
    if isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"mask tensor must be bool, got {mask.dtype}")
        while mask.dim() > 2:
            mask = mask[0]
        return mask
    raise TypeError(f"mask must be a Mask, a bool tensor or an expression string, got {type(mask).__name__}")


def mask_to_text(mask: M.Mask | Tensor | str, n_q: int, n_k: int | None = None, *, q_offset: int | None = None,
                 batch: int = 0, on: str = "█", off: str = "·") -> str:
    """Draw a mask as text: one row per query, ``on`` where it may attend.

    Args:
        mask: a :class:`attnzoo.masks.Mask`, an expression for :func:`parse_mask`, or a bool
            tensor ``[Nq, Nk]`` (leading dimensions take index 0).
        n_q, n_k: queries and keys (``n_k`` defaults to ``n_q``).
        q_offset: position of the first query (default ``n_k - n_q``, bottom-right).
        batch: which batch element of a batch-dependent mask.
    """
    dense = dense_mask(mask, n_q, n_k, q_offset=q_offset, batch=batch)
    nq, nk = dense.shape
    off_q = (nk - nq) if q_offset is None else q_offset
    width = len(str(max(nk - 1, off_q + nq - 1)))
    tens = "".join(str((j // 10) % 10) if j % 10 == 0 and j >= 10 else " " for j in range(nk))
    ones = "".join(str(j % 10) for j in range(nk))
    lines = [f"{'':>{width}}  keys ->"]
    if nk > 10:
        lines.append(f"{'':>{width}}  {tens}")
    lines.append(f"{'':>{width}}  {ones}")
    for i in range(nq):
        row = "".join(on if bool(x) else off for x in dense[i])
        lines.append(f"{off_q + i:>{width}}  {row}   {int(dense[i].sum())}")
    lines.append(f"(rows: query positions; right: visible keys; {int(dense.sum())} of {nq * nk} pairs visible)")
    return "\n".join(lines)
