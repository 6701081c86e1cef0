"""Pictures: masks, attention maps (one head or a grid of heads) and positional encodings.

Plotting needs matplotlib (``pip install 'attnzoo[plot]'``); it is imported only when a plot is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnzoo import masks as M
from attnzoo._memory import refuse_if_too_big
from attnzoo._validate import check_int
from attnzoo.nn.positional import alibi_slopes, sinusoidal_table
from attnzoo.viz.maskexpr import dense_mask

__all__ = ["plot_attention", "plot_mask", "plot_positional"]

POSITIONAL_KINDS = ("sinusoidal", "rope", "alibi")


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - extra not installed
        raise ImportError("plotting needs matplotlib: pip install 'attnzoo[plot]'") from exc
    return plt


# =========================================================================== masks
def plot_mask(mask: M.Mask | Tensor | str, n_q: int, n_k: int | None = None, *, q_offset: int | None = None,
              batch: int = 0, title: str | None = None, path: str | Path | None = None) -> Any:
    """Draw a mask ``[Nq, Nk]`` as a PNG-ready figure (dark = may attend). Saves to ``path`` if given."""
    dense = dense_mask(mask, n_q, n_k, q_offset=q_offset, batch=batch)
    nq, nk = dense.shape
    off_q = (nk - nq) if q_offset is None else q_offset
    plt = _plt()
    size = max(3.5, min(10.0, 0.28 * max(nq, nk) + 1.5))
    fig, ax = plt.subplots(figsize=(size * nk / max(nq, nk) + 1.0, size * nq / max(nq, nk) + 0.8))
    ax.imshow(dense.numpy(), cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest", aspect="equal",
              extent=(-0.5, nk - 0.5, off_q + nq - 0.5, off_q - 0.5))
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    step = max(1, math.ceil(max(nq, nk) / 16))
    ax.set_xticks(range(0, nk, step))
    ax.set_yticks(range(off_q, off_q + nq, step))
    if max(nq, nk) <= 48:
        ax.set_xticks([x - 0.5 for x in range(nk + 1)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(off_q, off_q + nq + 1)], minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
    name = title if title is not None else (mask if isinstance(mask, str) else getattr(mask, "name", "mask"))
    ax.set_title(f"{name}\n{int(dense.sum())} of {nq * nk} pairs visible", fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# =========================================================================== attention maps
def _heads_of(weights: Tensor, heads: Sequence[int] | int | None, batch: int) -> tuple[Tensor, list[int]]:
    """``weights`` as ``[H, Nq, Nk]`` (float, CPU) and the validated list of heads to draw."""
    if not isinstance(weights, Tensor):
        raise TypeError(f"weights must be a tensor [Nq, Nk], [H, Nq, Nk] or [B, H, Nq, Nk], got {type(weights).__name__}")
    w = weights.detach().float().cpu()
    if w.dim() == 4:
        if not 0 <= batch < w.shape[0]:
            raise ValueError(f"batch={batch} out of range for weights of shape {tuple(weights.shape)}")
        w = w[batch]
    elif w.dim() == 2:
        w = w.unsqueeze(0)
    elif w.dim() != 3:
        raise ValueError(f"weights must be [Nq, Nk], [H, Nq, Nk] or [B, H, Nq, Nk], got shape {tuple(weights.shape)}")
    n_heads = w.shape[0]
    sel = list(range(n_heads)) if heads is None else ([heads] if isinstance(heads, int) else list(heads))
    for h in sel:
        if not isinstance(h, int) or not 0 <= h < n_heads:
            raise ValueError(f"heads: index {h!r} out of range for {n_heads} heads")
    return w, sel


def _check_labels(tokens: Sequence[str] | None, key_tokens: Sequence[str] | None, nq: int,
                  nk: int) -> Sequence[str] | None:
    """Validate the labels; returns the key labels (the query labels when ``Nq == Nk`` and none are given)."""
    if tokens is not None and len(tokens) != nq:
        raise ValueError(f"tokens has {len(tokens)} labels but weights have Nq={nq} queries")
    if key_tokens is None and tokens is not None and nq == nk:
        key_tokens = tokens
    if key_tokens is not None and len(key_tokens) != nk:
        raise ValueError(f"key_tokens has {len(key_tokens)} labels but weights have Nk={nk} keys")
    return key_tokens


def _draw_head(ax: Any, w: Tensor, h: int, vmax: float, tokens: Sequence[str] | None,
               key_tokens: Sequence[str] | None) -> Any:
    """One head's heat map ``w[h]`` (``[Nq, Nk]``) on ``ax``; returns the image."""
    nq, nk = w.shape[1:]
    im = ax.imshow(w[h].numpy(), cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest", aspect="auto")
    ax.set_title(f"head {h}", fontsize=9)
    if key_tokens is not None and nk <= 64:
        ax.set_xticks(range(nk))
        ax.set_xticklabels(list(key_tokens), rotation=90, fontsize=7)
    if tokens is not None and nq <= 64:
        ax.set_yticks(range(nq))
        ax.set_yticklabels(list(tokens), fontsize=7)
    return im


def plot_attention(
    weights: Tensor,
    tokens: Sequence[str] | None = None,
    *,
    heads: Sequence[int] | int | None = None,
    batch: int = 0,
    key_tokens: Sequence[str] | None = None,
    title: str | None = None,
    path: str | Path | None = None,
    max_cols: int = 4,
) -> Any:
    """Heat maps of attention weights: one head, or a grid of heads.

    Args:
        weights: ``[Nq, Nk]``, ``[H, Nq, Nk]`` or ``[B, H, Nq, Nk]`` (e.g. from
            :func:`capture_attention` or ``attention(..., return_weights=True)``).
        tokens: labels of the queries (and of the keys when ``key_tokens`` is not given and
            ``Nq == Nk``).
        heads: a head index or a list (default: all heads).
        batch: batch element of a 4-D ``weights``.
        key_tokens: labels of the keys.
        title: figure title.
        path: save the figure there (PNG) if given.
        max_cols: heads per row of the grid.

    Returns:
        The matplotlib figure.
    """
    w, sel = _heads_of(weights, heads, batch)  # [H, Nq, Nk]
    nq, nk = w.shape[1:]
    key_tokens = _check_labels(tokens, key_tokens, nq, nk)
    plt = _plt()
    cols = min(max_cols, len(sel))
    rows = math.ceil(len(sel) / cols)
    cell = max(2.6, min(5.0, 0.22 * max(nq, nk) + 1.2))
    room = 0.0 if tokens is None else 0.06 * max(len(t) for t in tokens)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * (cell + room) + 1.2, rows * (cell + room) + 0.6),
                             squeeze=False)
    vmax = float(w[sel].max()) or 1.0
    im = None
    for ax_i, ax in enumerate(axes.flat):
        if ax_i >= len(sel):
            ax.axis("off")
            continue
        im = _draw_head(ax, w, sel[ax_i], vmax, tokens, key_tokens)
        if ax_i % cols == 0:
            ax.set_ylabel("query")
        if ax_i // cols == rows - 1:
            ax.set_xlabel("key")
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.85, label="attention weight")
    fig.suptitle(title or "attention weights", fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig


# =========================================================================== positions
def _draw_sinusoidal(fig: Any, ax: Any, n: int, dim: int, base: float) -> None:
    table = sinusoidal_table(n, dim, base=base, dtype=torch.float32)  # [n, dim]
    im = ax.imshow(table.numpy(), aspect="auto", cmap="coolwarm", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("embedding dimension")
    ax.set_ylabel("position")
    ax.set_title(f"sinusoidal table [{n}, {dim}]")
    fig.colorbar(im, ax=ax, label="value")


def _draw_rope(ax: Any, n: int, dim: int, base: float) -> None:
    pairs = torch.arange(dim // 2, dtype=torch.float64)
    theta = base ** (-2 * pairs / dim)
    ax.semilogy(pairs.numpy(), theta.numpy(), marker=".", label="frequency theta_i (rad / position)")
    ax.semilogy(pairs.numpy(), (2 * math.pi / theta).numpy(), marker=".",
                label="wavelength 2 pi / theta_i (positions)")
    ax.axhline(n, color="gray", linestyle=":", label=f"n = {n} positions")
    ax.set_xlabel("channel pair i")
    ax.set_ylabel("theta_i  /  wavelength (log)")
    ax.set_title(f"RoPE frequencies (head dim {dim}, base {base:g})")
    ax.legend(fontsize=8)


def _draw_alibi(fig: Any, ax: Any, n: int, heads: int) -> None:
    slopes = alibi_slopes(heads)  # [H]
    pos = torch.arange(n, dtype=torch.float32)
    dist = (pos.view(-1, 1) - pos.view(1, -1)).abs()  # [n, n]
    show = min(heads, 4)
    bias = -(slopes[0] * dist)
    im = ax.imshow(bias.numpy(), cmap="magma", aspect="auto", interpolation="nearest")
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax.set_title(f"ALiBi bias -m|i-j|, head 0 (m={float(slopes[0]):.3g})\nslopes of {heads} heads: "
                 + ", ".join(f"{float(s):.3g}" for s in slopes[:show]) + (" ..." if heads > show else ""),
                 fontsize=9)
    fig.colorbar(im, ax=ax, label="bias added to the score")


def plot_positional(kind: str = "all", *, n: int = 128, dim: int = 128, heads: int = 8, base: float = 10000.0,
                    path: str | Path | None = None) -> Any:
    """Pictures of positional encodings, as the seed texts draw them.

    Args:
        kind: ``"sinusoidal"`` (the ``[n, dim]`` table as a heat map), ``"rope"`` (the rotation
            frequency of every channel pair, and the angle of a few pairs against position),
            ``"alibi"`` (the bias ``-slope_h |i - j|`` of every head and the slopes), or ``"all"``.
        n: positions. dim: model width (sinusoidal) or head dimension (RoPE). heads: ALiBi heads.
        base: frequency base of the sinusoidal table and RoPE.
        path: save the figure there (PNG) if given.

    Raises:
        ValueError: bad arguments, or an ALiBi picture whose ``[n, n]`` bias would not fit in the
            available memory.
    """
    if kind not in (*POSITIONAL_KINDS, "all"):
        raise ValueError(f"kind must be one of {(*POSITIONAL_KINDS, 'all')}, got {kind!r}")
    for name, v in (("n", n), ("dim", dim), ("heads", heads)):
        check_int(v, name)
    if dim % 2:
        raise ValueError(f"dim must be even (sine/cosine and RoPE pairs), got {dim}")
    todo = list(POSITIONAL_KINDS) if kind == "all" else [kind]
    if "alibi" in todo:  # the [n, n] bias, its distances and the image matplotlib makes of it
        refuse_if_too_big(32 * n * n, f"drawing the {n} x {n} ALiBi bias")
    plt = _plt()
    fig, axes = plt.subplots(1, len(todo), figsize=(6.0 * len(todo), 4.8), squeeze=False)
    for ax, k in zip(axes[0], todo, strict=True):
        if k == "sinusoidal":
            _draw_sinusoidal(fig, ax, n, dim, base)
        elif k == "rope":
            _draw_rope(ax, n, dim, base)
        else:
            _draw_alibi(fig, ax, n, heads)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
