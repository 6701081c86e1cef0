"""See what attention does: capture weights from any model, plot them, draw masks and positions.

* :func:`capture_attention` records the weights of every attention module of a model, by layer
  and head, without changing the model's outputs.
* :func:`plot_attention` draws one head or a grid of heads as heat maps with token labels.
* :func:`parse_mask`, :func:`mask_to_text`, :func:`plot_mask` turn a mask expression such as
  ``"causal & window(4,0)"`` into a picture in the terminal or a PNG.
* :func:`plot_positional` draws the sinusoidal table, the RoPE frequencies and the ALiBi biases.

Plotting needs matplotlib (``pip install 'attnzoo[plot]'``); it is imported only when a plot is
drawn. Everything else needs torch only.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo import masks as M

__all__ = [
    "AttentionCapture",
    "capture_attention",
    "load_model",
    "mask_to_text",
    "parse_mask",
    "plot_attention",
    "plot_mask",
    "plot_positional",
]


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - extra not installed
        raise ImportError("plotting needs matplotlib: pip install 'attnzoo[plot]'") from exc
    return plt


# =========================================================================== capture
@dataclass
class AttentionCapture:
    """Weights recorded by :func:`capture_attention`.

    ``maps[layer]`` is the list of weight tensors ``[B, H, Nq, Nk]`` one module produced, one per
    call, in call order (decoding with a cache makes one call per step). ``layers`` lists the
    attention modules' qualified names in model order; ``skipped`` the modules that could not
    return weights, with the reason.
    """

    layers: list[str] = field(default_factory=list)
    maps: dict[str, list[Tensor]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, layer: str | int) -> Tensor:
        """The last weights of ``layer`` (a name or an index into :attr:`layers`): ``[B, H, Nq, Nk]``."""
        name = self.layers[layer] if isinstance(layer, int) else layer
        if name not in self.maps or not self.maps[name]:
            raise KeyError(f"no attention weights recorded for layer {name!r}; recorded: {list(self.maps)}")
        return self.maps[name][-1]

    def __len__(self) -> int:
        return len(self.layers)

    def stacked(self) -> Tensor:
        """The last weights of every layer as ``[L, B, H, Nq, Nk]`` (layers must agree in shape)."""
        return torch.stack([self[name] for name in self.layers if self.maps.get(name)])


def _takes_return_weights(m: nn.Module) -> bool:
    try:
        return "return_weights" in inspect.signature(m.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtin forward
        return False


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Innermost modules whose ``forward`` accepts ``return_weights``."""
    found = [(n, m) for n, m in model.named_modules() if _takes_return_weights(m)]
    names = {n for n, _ in found}
    inner = []
    for n, m in found:
        below = any(o != n and (o.startswith(n + ".") or n == "") for o in names)
        if not below:
            inner.append((n or type(m).__name__, m))
    return inner


@contextmanager
def capture_attention(model: nn.Module, *, detach: bool = True) -> Iterator[AttentionCapture]:
    """Record the attention weights of every attention module of ``model``.

    Attention modules are the innermost submodules whose ``forward`` takes ``return_weights``
    (every attnzoo attention module). While the context is open each call of such a module runs
    as usual and its output is returned unchanged; the weights come from a second, gradient-free
    call with ``return_weights=True`` on the same inputs. A call that updates a KV cache is not
    repeated (that would write the cache twice): it is made once with ``return_weights=True``,
    whose output equals the normal one up to float rounding (weights need the ``reference``
    backend). Use it in ``eval()`` mode: with dropout the two calls would draw different masks.

    Example::

        with az.viz.capture_attention(model) as cap:
            model(tokens)
        cap.layers            # ['blocks.0.attn', 'blocks.1.attn', ...]
        cap[0].shape          # [B, H, N, N]

    Yields:
        An :class:`AttentionCapture`, filled as the model runs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture_attention: model must be a torch.nn.Module, got {type(model).__name__}")
    cap = AttentionCapture()
    originals: list[tuple[nn.Module, Any]] = []
    for name, mod in _attention_modules(model):
        cap.layers.append(name)
        cap.maps[name] = []
        orig = mod.forward

        def wrapped(*args: Any, _orig: Any = orig, _name: str = name, **kwargs: Any) -> Any:
            if kwargs.get("return_weights"):
                out = _orig(*args, **kwargs)
                cap.maps[_name].append(out[1].detach() if detach else out[1])
                return out
            if kwargs.get("cache") is not None:
                try:
                    out, w = _orig(*args, **kwargs, return_weights=True)
                except (ValueError, TypeError, NotImplementedError) as exc:
                    cap.skipped[_name] = str(exc)
                    return _orig(*args, **kwargs)
                cap.maps[_name].append(w.detach() if detach else w)
                return out
            out = _orig(*args, **kwargs)
            try:
                with torch.no_grad():
                    res = _orig(*args, **kwargs, return_weights=True)
                cap.maps[_name].append(res[1].detach())
            except (ValueError, TypeError, NotImplementedError) as exc:
                cap.skipped[_name] = str(exc)
            return out

        mod.forward = wrapped  # type: ignore[method-assign]
        originals.append((mod, orig))
    try:
        yield cap
    finally:
        for mod, _orig in originals:
            del mod.forward  # the instance attribute; the class method shows through again


# =========================================================================== mask expressions
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

    def arg(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and (node.value is None or (isinstance(node.value, int)
                                                                      and not isinstance(node.value, bool))):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            return -node.operand.value
        raise ValueError(f"mask expression {expr!r}: arguments must be integers or None, got {ast.unparse(node)!r}")

    def build(node: ast.AST) -> M.Mask:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            a, b = build(node.left), build(node.right)
            return a & b if isinstance(node.op, ast.BitAnd) else a | b
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            return ~build(node.operand)
        if isinstance(node, ast.Name) and node.id == "causal":
            return M.causal()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BUILDERS:
            if node.keywords:
                raise ValueError(f"mask expression {expr!r}: keyword arguments are not supported")
            try:
                return _BUILDERS[node.func.id](*[arg(a) for a in node.args])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"mask expression {expr!r}: {node.func.id}(...): {exc}") from None
        raise ValueError(f"mask expression {expr!r}: unexpected {ast.unparse(node)!r}; expected "
                         f"causal, window(l, r), prefix_lm(n), global(p, ...), padding(n, ...), "
                         f"document(len, ...) combined with & | ~")

    return build(tree.body)


def _dense(mask: M.Mask | Tensor | str, n_q: int, n_k: int | None, q_offset: int | None,
           batch: int) -> Tensor:
    n_k = n_q if n_k is None else n_k
    for name, v in (("n_q", n_q), ("n_k", n_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if isinstance(mask, str):
        mask = parse_mask(mask)
    if isinstance(mask, M.Mask):
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
    dense = _dense(mask, n_q, n_k, q_offset, batch)
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


def plot_mask(mask: M.Mask | Tensor | str, n_q: int, n_k: int | None = None, *, q_offset: int | None = None,
              batch: int = 0, title: str | None = None, path: str | Path | None = None) -> Any:
    """Draw a mask as a PNG-ready figure (dark = may attend). Saves to ``path`` if given."""
    dense = _dense(mask, n_q, n_k, q_offset, batch)
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
    n_heads, nq, nk = w.shape
    sel = list(range(n_heads)) if heads is None else ([heads] if isinstance(heads, int) else list(heads))
    for h in sel:
        if not isinstance(h, int) or not 0 <= h < n_heads:
            raise ValueError(f"heads: index {h!r} out of range for {n_heads} heads")
    if tokens is not None and len(tokens) != nq:
        raise ValueError(f"tokens has {len(tokens)} labels but weights have Nq={nq} queries")
    if key_tokens is None and tokens is not None and nq == nk:
        key_tokens = tokens
    if key_tokens is not None and len(key_tokens) != nk:
        raise ValueError(f"key_tokens has {len(key_tokens)} labels but weights have Nk={nk} keys")
    plt = _plt()
    cols = min(max_cols, len(sel))
    rows = math.ceil(len(sel) / cols)
    cell = max(2.6, min(5.0, 0.22 * max(nq, nk) + 1.2))
    label_room = 0.0 if tokens is None else 0.06 * max(len(t) for t in tokens)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * (cell + label_room) + 1.2, rows * (cell + label_room) + 0.6),
                             squeeze=False)
    im = None
    for ax_i, ax in enumerate(axes.flat):
        if ax_i >= len(sel):
            ax.axis("off")
            continue
        h = sel[ax_i]
        im = ax.imshow(w[h].numpy(), cmap="viridis", vmin=0.0, vmax=float(w[sel].max()) or 1.0,
                       interpolation="nearest", aspect="auto")
        ax.set_title(f"head {h}", fontsize=9)
        if key_tokens is not None and nk <= 64:
            ax.set_xticks(range(nk))
            ax.set_xticklabels(list(key_tokens), rotation=90, fontsize=7)
        if tokens is not None and nq <= 64:
            ax.set_yticks(range(nq))
            ax.set_yticklabels(list(tokens), fontsize=7)
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
def _sinusoidal(n: int, dim: int, base: float) -> Tensor:
    try:
        from attnzoo.nn.positional import sinusoidal_table

        return sinusoidal_table(n, dim, base=base, dtype=torch.float32)
    except ImportError:  # pragma: no cover - the positional module is part of the package
        i = torch.arange(0, dim, 2, dtype=torch.float64)
        ang = torch.arange(n, dtype=torch.float64).view(-1, 1) * base ** (-i / dim)
        return torch.stack((ang.sin(), ang.cos()), dim=-1).reshape(n, -1)[:, :dim].float()


def _alibi(num_heads: int) -> Tensor:
    try:
        from attnzoo.nn.positional import alibi_slopes

        return alibi_slopes(num_heads)
    except ImportError:  # pragma: no cover
        r = 2.0 ** (-8.0 / num_heads)
        return torch.tensor([r ** (h + 1) for h in range(num_heads)])


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
    """
    kinds = ("sinusoidal", "rope", "alibi")
    if kind not in (*kinds, "all"):
        raise ValueError(f"kind must be one of {(*kinds, 'all')}, got {kind!r}")
    for name, v in (("n", n), ("dim", dim), ("heads", heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if dim % 2:
        raise ValueError(f"dim must be even (sine/cosine and RoPE pairs), got {dim}")
    todo = list(kinds) if kind == "all" else [kind]
    plt = _plt()
    fig, axes = plt.subplots(1, len(todo), figsize=(6.0 * len(todo), 4.8), squeeze=False)
    for ax, k in zip(axes[0], todo, strict=True):
        if k == "sinusoidal":
            table = _sinusoidal(n, dim, base)
            im = ax.imshow(table.numpy(), aspect="auto", cmap="coolwarm", vmin=-1, vmax=1, interpolation="nearest")
            ax.set_xlabel("embedding dimension")
            ax.set_ylabel("position")
            ax.set_title(f"sinusoidal table [{n}, {dim}]")
            fig.colorbar(im, ax=ax, label="value")
        elif k == "rope":
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
        else:
            slopes = _alibi(heads)
            pos = torch.arange(n, dtype=torch.float32)
            dist = (pos.view(-1, 1) - pos.view(1, -1)).abs()
            show = min(heads, 4)
            bias = -(slopes[0] * dist)
            im = ax.imshow(bias.numpy(), cmap="magma", aspect="auto", interpolation="nearest")
            ax.set_xlabel("key position j")
            ax.set_ylabel("query position i")
            ax.set_title(f"ALiBi bias -m|i-j|, head 0 (m={float(slopes[0]):.3g})\nslopes of {heads} heads: "
                         + ", ".join(f"{float(s):.3g}" for s in slopes[:show]) + (" ..." if heads > show else ""),
                         fontsize=9)
            fig.colorbar(im, ax=ax, label="bias added to the score")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


# =========================================================================== saved models
Tokenize = Any  # Callable[[str], tuple[Tensor, list[str]]]: text -> (ids [1, N], token labels)


def load_model(path: str | Path) -> tuple[nn.Module, Tokenize]:
    """Load a saved model for ``attnzoo viz --model`` and a matching tokenizer.

    Accepted: an arena checkpoint (``.pt`` written by ``attnzoo arena``; the ``lm`` task's
    character vocabulary, or space-separated token ids for ``mqar``), or a Hugging Face model
    folder (``config.json`` + weights) read by :func:`attnzoo.interop.load_pretrained`, with
    the folder's ``vocab.txt`` (BERT WordPiece) or, when ``transformers`` is installed, its
    tokenizer files (never downloaded).

    Returns:
        ``(model in eval mode, tokenize)`` where ``tokenize(text) -> (ids [1, N], labels)``.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_dir():
        return _load_hf_folder(p)
    state = torch.load(p, map_location="cpu", weights_only=True)
    if not (isinstance(state, dict) and isinstance(state.get("extra"), dict) and "signature" in state["extra"]):
        raise ValueError(f"{p} is not an arena checkpoint (expected keys model/extra.signature) nor a model folder")
    from attnzoo.arena.runner import TaskSettings, _build_model

    sig = dict(state["extra"]["signature"])
    variant = sig.pop("variant")
    seed = sig.pop("seed", 0)
    sig.pop("world_size", None)
    settings = TaskSettings(**sig)
    if settings.task == "lm":
        from attnzoo.arena.tasks import ShakespeareTask

        task = ShakespeareTask(seq_len=settings.seq_len)
        vocab = task.vocab_size

        def tokenize(text: str) -> tuple[Tensor, list[str]]:
            ids = task.encode(text)
            return ids.unsqueeze(0), ["␣" if c == " " else repr(c)[1:-1] for c in text]
    else:
        vocab = settings.vocab_size

        def tokenize(text: str) -> tuple[Tensor, list[str]]:
            try:
                ids = [int(t) for t in text.split()]
            except ValueError:
                raise ValueError("an mqar model reads space-separated token ids, e.g. --text '3 17 4 9'") from None
            if any(not 0 <= i < vocab for i in ids):
                raise ValueError(f"token ids must be in [0, {vocab}), got {ids}")
            return torch.tensor([ids]), [str(i) for i in ids]

    model = _build_model(settings, variant, vocab, seed, torch.device("cpu"))
    model.load_state_dict(state["model"])
    return model.eval(), tokenize


def _load_hf_folder(p: Path) -> tuple[nn.Module, Tokenize]:
    from attnzoo.interop import WordPieceTokenizer, load_pretrained

    model = load_pretrained(p)
    if (p / "vocab.txt").exists():
        tok = WordPieceTokenizer.from_folder(p)
        inverse = {i: t for t, i in tok.vocab.items()}

        def tokenize(text: str) -> tuple[Tensor, list[str]]:
            ids = tok.encode(text)
            return torch.tensor([ids]), [inverse.get(i, str(i)) for i in ids]

        return model, tokenize
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError(f"{p} has no vocab.txt; reading its tokenizer needs transformers "
                         f"(pip install 'attnzoo[hf]')") from exc
    hf_tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)

    def tokenize_hf(text: str) -> tuple[Tensor, list[str]]:
        ids = hf_tok(text)["input_ids"]
        return torch.tensor([ids]), hf_tok.convert_ids_to_tokens(ids)

    return model, tokenize_hf
